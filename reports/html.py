"""report.html: one self-contained file (images inlined as data URIs), every name escaped."""

from __future__ import annotations

import base64
import math
from html import escape
from typing import Any

from core.findings import StageResult

COLOURS = {"pass": "#1a7f37", "warn": "#b35900", "fail": "#c62828", "skipped": "#666666"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1100px}
.banner{padding:14px 18px;border-radius:6px;color:#fff;font-size:22px;font-weight:600;margin-bottom:12px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px;font-weight:600}
table{border-collapse:collapse;margin:8px 0 18px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top;overflow-wrap:anywhere}
th{background:#f4f4f4;white-space:nowrap}
td:first-child,.badge{white-space:nowrap;overflow-wrap:normal}
td.num{text-align:right;font-family:ui-monospace,Menlo,monospace}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
h2{margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.muted{color:#666;font-size:12px} code{background:#f4f4f4;padding:0 3px}
"""


def badge(verdict: str) -> str:
    return f'<span class="badge" style="background:{COLOURS.get(verdict, "#666")}">{escape(verdict)}</span>'


def fmt(v: Any) -> str:
    if v is None:
        return "&mdash;"
    if isinstance(v, float):
        if not math.isfinite(v):
            return escape(str(v))
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return escape(", ".join(str(x) for x in v))
    return escape(str(v))


def table(rows: list[dict[str, Any]], row_class: str | None = None) -> str:
    """Rows of dicts as an HTML table (columns from the first row); every value escaped. ``row_class``
    names a column whose value becomes the row's CSS class (e.g. a status)."""
    if not rows:
        return ""
    keys = list(rows[0])
    head = "".join(f"<th>{escape(str(k))}</th>" for k in keys)
    body = []
    for r in rows:
        cls = f" class='{escape(str(r.get(row_class, '')))}'" if row_class else ""
        cells = "".join(f"<td{' class=num' if isinstance(r.get(k), (int, float)) else ''}>{fmt(r.get(k))}</td>"
                        for k in keys)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def image(png: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render(verdict: str, runs: list[dict[str, Any]], stages: dict[str, StageResult],
           figures: list[tuple[str, bytes]], step_table: list[dict[str, Any]],
           extra_sections: list[tuple[str, str]] | None = None) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Alignment report: {escape(verdict)}"
             f"</title><style>{CSS}</style></head><body>"]
    parts.append(f'<div class="banner" style="background:{COLOURS.get(verdict, "#666")}">Verdict: '
                 f"{escape(verdict.upper())}</div>")
    parts.append("<table><tr><th>role</th><th>source</th><th>kind</th><th>steps</th><th>notes</th></tr>")
    for r in runs:
        notes = "<br>".join(escape(n) for n in r.get("notes", [])) or "&mdash;"
        parts.append(f"<tr><td>{escape(r['role'])}</td><td><code>{escape(r['path'])}</code></td>"
                     f"<td>{escape(r['kind'])}</td><td class='num'>{fmt(r.get('steps'))}</td>"
                     f"<td class='muted'>{notes}</td></tr>")
    parts.append("</table>")

    parts.append("<h2>Stages</h2><table><tr><th>stage</th><th>verdict</th><th>what was found</th></tr>")
    for name, st in stages.items():
        msgs = [f.message for f in st.findings if f.verdict != "pass"] or [f.message for f in st.findings]
        if st.verdict == "skipped":
            msgs = [st.details.get("reason", "no data")]
            if st.details.get("capture"):
                msgs.append(f"to run it: {st.details['capture']}")
        text = "<br>".join(escape(m) for m in msgs[:6])
        if len(msgs) > 6:
            text += f"<br><span class='muted'>... {len(msgs) - 6} more in the findings table</span>"
        parts.append(f"<tr><td>{escape(name)}</td><td>{badge(st.verdict)}</td><td>{text}</td></tr>")
    parts.append("</table>")

    if step_table:
        parts.append("<h2>Step 1 and step 2</h2><table><tr><th>stage</th><th>step</th><th>baseline</th>"
                     "<th>candidate</th><th>abs delta</th><th>rel delta</th><th>threshold</th><th>verdict</th>"
                     "</tr>")
        for row in step_table:
            parts.append("<tr>" + "".join(
                f"<td{' class=num' if k not in ('stage', 'verdict') else ''}>"
                f"{badge(row[k]) if k == 'verdict' else fmt(row.get(k))}</td>"
                for k in ("stage", "step", "baseline", "candidate", "abs_delta", "rel_delta", "threshold",
                          "verdict")) + "</tr>")
        parts.append("</table>")

    if figures:
        parts.append("<h2>Figures</h2>")
        for title, png in figures:
            parts.append(f"<div>{image(png, title)}</div>")

    for title, body in extra_sections or []:
        parts.append(f"<h2>{escape(title)}</h2>{body}")

    findings = [f for st in stages.values() for f in st.findings]
    order = {"fail": 0, "warn": 1, "pass": 2}
    findings.sort(key=lambda f: order[f.verdict])
    parts.append("<h2>Findings</h2><table><tr><th>stage</th><th>verdict</th><th>component</th><th>metric</th>"
                 "<th>value</th><th>threshold</th><th>message</th></tr>")
    for f in findings:
        parts.append(f"<tr><td>{escape(f.stage)}</td><td>{badge(f.verdict)}</td><td>{fmt(f.component)}</td>"
                     f"<td>{escape(f.metric)}</td><td class='num'>{fmt(f.value)}</td>"
                     f"<td class='num'>{fmt(f.threshold)}</td><td>{escape(f.message)}</td></tr>")
    parts.append("</table>")
    parts.append("<p class='muted'>Band: how far the baseline differs from itself when run again; "
                 "delta = candidate - baseline. See the README section 'How the verdict is reached'.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
