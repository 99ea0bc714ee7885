"""report.html: one self-contained file (images inlined as data URIs), every name escaped."""

from __future__ import annotations

import base64
import math
from html import escape
from typing import Any

from core.findings import StageResult, severity

COLOURS = {"pass": "#1a7f37", "warn": "#b35900", "fail": "#c62828", "skipped": "#666666"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
.banner{padding:14px 18px;border-radius:6px;color:#fff;font-size:22px;font-weight:600;margin-bottom:12px}
.banner .scope{display:block;font-size:15px;font-weight:500;margin-top:4px}
.box{border:1px solid #ddd;border-left:6px solid #666;border-radius:4px;padding:10px 16px;margin:10px 0 16px 0}
.box h3{margin:4px 0 8px 0;font-size:17px} .box p{margin:4px 0}
.culprit{font-size:16px} .culprit code{font-size:15px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px;font-weight:600}
table{border-collapse:collapse;margin:8px 0 18px 0;font-size:13px;max-width:100%}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top;overflow-wrap:break-word}
th{background:#f4f4f4;white-space:nowrap}
td:first-child,.badge,td.num{white-space:nowrap;overflow-wrap:normal}
td.num{text-align:right;font-family:ui-monospace,Menlo,monospace}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
h2{margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.muted{color:#666;font-size:12px} code{background:#f4f4f4;padding:0 3px} a{color:#0b57d0}
"""


def badge(verdict: str) -> str:
    return f'<span class="badge" style="background:{COLOURS.get(verdict, "#666")}">{escape(verdict)}</span>'


def fmt(v: Any) -> str:
    if v is None:
        return "&mdash;"
    if isinstance(v, float):
        if not math.isfinite(v):
            return escape(str(v))
        return f"{v:.4g}"   # a table is read at a glance; summary.json and the CSV keep every digit
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


def anchor(stage: str) -> str:
    return f"stage-{stage}"


def stage_link(stage: str, linked: set[str]) -> str:
    """A stage's name, linked to its section where it has one."""
    name = escape(stage)
    return f'<a href="#{escape(anchor(stage))}">{name}</a>' if stage in linked else name


def _value_line(e: dict[str, Any]) -> str:
    if e.get("value") is None:
        return ""
    line = f"{escape(str(e.get('metric')))} = {fmt(e['value'])}"
    if e.get("threshold") is not None:
        line += f" against {fmt(e['threshold'])}"
    return f"<p>{line}</p>"


def diagnosis_box(diagnosis: list[dict[str, Any]], linked: set[str]) -> str:
    """The first screen's answer: the culprit (stage, component, number against its line, why, what next),
    the other root causes, and the failures they explain."""
    roots = [e for e in diagnosis if e.get("consequence_of") is None]
    if not roots:
        return ""
    first = roots[0]
    comp = f" &mdash; <code>{fmt(first['component'])}</code>" if first.get("component") else ""
    parts = [f'<div class="box" id="diagnosis" style="border-left-color:{COLOURS["fail"]}"><h3>Diagnosis</h3>',
             f"<p class='culprit'><b>Culprit:</b> {stage_link(first['stage'], linked)}{comp}</p>",
             f"<p>{escape(first['message'])}</p>", _value_line(first)]
    if first.get("seen_at"):
        parts.append("<p><b>Where it shows:</b> " + "; ".join(
            f"{stage_link(e['stage'], linked)} <code>{fmt(e['component'])}</code>" for e in first["seen_at"])
            + "</p>")
    if first.get("why"):
        parts.append(f"<p><b>Why it matters:</b> {escape(first['why'])}</p>")
    if first.get("next"):
        parts.append(f"<p><b>Next:</b> <code>{escape(first['next'])}</code></p>")
    if len(roots) > 1:
        items = "".join(f"<li>{stage_link(e['stage'], linked)}"
                        f"{' (' + fmt(e['component']) + ')' if e.get('component') else ''}: {escape(e['message'])}</li>"
                        for e in roots[1:6])
        more = f"<li class='muted'>... {len(roots) - 6} more</li>" if len(roots) > 6 else ""
        parts.append(f"<p><b>Other failures not explained by it:</b></p><ul>{items}{more}</ul>")
    cons = [e for e in diagnosis if e.get("consequence_of") is not None]
    if cons:
        by: dict[str, list[str]] = {}
        for e in cons:
            by.setdefault(e["consequence_of"], []).append(stage_link(e["stage"], linked))
        parts.append("<p class='muted'>Consequences (they follow from the failure named, fix it first): "
                     + "; ".join(f"{', '.join(v)} (from {escape(k)})" for k, v in by.items()) + "</p>")
    parts.append("</div>")
    return "".join(parts)


def warnings_box(stages: dict[str, StageResult], linked: set[str]) -> str:
    """No failure: the warnings, one line a stage (its strongest warning first)."""
    rows = [(name, next(f for f in st.findings if f.verdict == "warn"))
            for name, st in stages.items() if st.verdict == "warn"
            and any(f.verdict == "warn" for f in st.findings)]
    if not rows:
        return ""
    items = "".join(f"<li>{stage_link(n, linked)}{' (' + fmt(f.component) + ')' if f.component else ''}: "
                    f"{escape(f.message)}</li>" for n, f in rows[:8])
    more = f"<li class='muted'>... {len(rows) - 8} more</li>" if len(rows) > 8 else ""
    return (f'<div class="box" id="diagnosis" style="border-left-color:{COLOURS["warn"]}"><h3>Warnings (nothing '
            f"failed)</h3><ul>{items}{more}</ul></div>")


def pass_box(stages: dict[str, StageResult], linked: set[str]) -> str:
    """Nothing failed or warned: what the pass proves, in each stage's own words where it states its power
    (the smallest difference it would have caught)."""
    said = [(n, st.details["power"]["text"]) for n, st in stages.items() if st.verdict == "pass"
            and isinstance(st.details.get("power"), dict) and st.details["power"].get("text")]
    items = "".join(f"<li>{stage_link(n, linked)}: {escape(str(text))}</li>" for n, text in said)
    return (f'<div class="box" id="diagnosis" style="border-left-color:{COLOURS["pass"]}"><h3>No stage failed or '
            "warned</h3>" + (f"<p>What the passing stages prove:</p><ul>{items}</ul>" if items else "") + "</div>")


def coverage_box(coverage: dict[str, Any], stages: dict[str, StageResult], linked: set[str]) -> str:
    """What the verdict covers: per part of the procedure, the stages compared and the ones skipped."""
    parts = coverage.get("parts") or {}
    if not parts:
        return ""
    rows = []
    for part, names in parts.items():
        ran = " ".join(f"{stage_link(n, linked)}&nbsp;{badge(stages[n].verdict)}" for n in names["ran"]
                       if n in stages)
        rows.append(f"<tr><td>{escape(part)}</td><td>{ran or '&mdash;'}</td>"
                    f"<td class='muted'>{escape(', '.join(names['skipped'])) or '&mdash;'}</td></tr>")
    return (f'<div class="box" id="coverage"><h3>What this verdict covers</h3><p>{escape(coverage["statement"])}'
            "</p><table><tr><th>part of the procedure</th><th>compared</th><th>not compared (no evidence; "
            "each says what to capture below)</th></tr>" + "".join(rows) + "</table></div>")


def _stage_messages(st: StageResult) -> list[str]:
    """A stage row's text: fail findings first, then warnings; a clean stage its pass findings."""
    if st.verdict == "skipped":
        msgs = [st.details.get("reason", "no data")]
        if st.details.get("capture"):
            msgs.append(f"to run it: {st.details['capture']}")
        return msgs
    bad = sorted((f for f in st.findings if f.verdict != "pass"), key=lambda f: -severity(f.verdict))
    return [f.message for f in bad] or [f.message for f in st.findings]


def render(verdict: str, runs: list[dict[str, Any]], stages: dict[str, StageResult],
           figures: list[tuple[str, bytes]], step_table: list[dict[str, Any]],
           extra_sections: list[tuple[str, str]] | None = None, *,
           diagnosis: list[dict[str, Any]] | None = None, coverage: dict[str, Any] | None = None,
           titles: dict[str, str] | None = None, stage_sections: dict[str, str] | None = None) -> str:
    """The page: the verdict and what it covers, the diagnosis, then the stages, figures and each stage's
    section (its findings, fail first, and its own tables). ``titles``: a section title per stage name."""
    titles = titles or {}
    coverage = coverage or {}
    linked = {n for n, st in stages.items() if st.verdict != "skipped"}
    colour = COLOURS.get(verdict, "#666")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Alignment report: {escape(verdict)}"
             f"</title><style>{CSS}</style></head><body>"]
    scope = f"<span class='scope'>{escape(coverage['banner'])}</span>" if coverage.get("banner") else ""
    parts.append(f'<div class="banner" style="background:{colour}"><span class="verdict">Verdict: '
                 f"{escape(verdict.upper())}</span>{scope}</div>")
    parts.append(diagnosis_box(diagnosis or [], linked) or (warnings_box(stages, linked) if verdict == "warn"
                                                             else pass_box(stages, linked)))
    parts.append(coverage_box(coverage, stages, linked))

    parts.append("<h2>Stages</h2><table><tr><th>stage</th><th>verdict</th><th>what was found</th></tr>")
    for name, st in stages.items():
        msgs = _stage_messages(st)
        text = "<br>".join(escape(m) for m in msgs[:3])
        if len(msgs) > 3:
            text += (f"<br><a class='muted' href='#{escape(anchor(name))}'>... {len(msgs) - 3} more in its "
                     "section</a>")
        parts.append(f"<tr><td>{stage_link(name, linked)}</td><td>{badge(st.verdict)}</td><td>{text}</td></tr>")
    parts.append("</table>")

    parts.append("<h2>Runs</h2><table><tr><th>role</th><th>source</th><th>kind</th><th>steps</th><th>notes</th>"
                 "</tr>")
    for r in runs:
        notes = "<br>".join(escape(n) for n in r.get("notes", [])) or "&mdash;"
        parts.append(f"<tr><td>{escape(r['role'])}</td><td><code>{escape(r['path'])}</code></td>"
                     f"<td>{escape(r['kind'])}</td><td class='num'>{fmt(r.get('steps'))}</td>"
                     f"<td class='muted'>{notes}</td></tr>")
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

    for name, st in stages.items():
        if st.verdict == "skipped":
            continue
        parts.append(f"<h2 id='{escape(anchor(name))}'>{escape(titles.get(name, name))} {badge(st.verdict)}</h2>")
        rows = sorted(st.findings, key=lambda f: -severity(f.verdict))
        if rows:
            parts.append("<table><tr><th>verdict</th><th>component</th><th>metric</th><th>value</th>"
                         "<th>threshold</th><th>message</th></tr>")
            parts += [f"<tr><td>{badge(f.verdict)}</td><td>{fmt(f.component)}</td><td>{escape(f.metric)}</td>"
                      f"<td class='num'>{fmt(f.value)}</td><td class='num'>{fmt(f.threshold)}</td>"
                      f"<td>{escape(f.message)}</td></tr>" for f in rows]
            parts.append("</table>")
        parts.append((stage_sections or {}).get(name, ""))
    parts.append("<p class='muted'>Band: how far the baseline differs from itself when run again; "
                 "delta = candidate - baseline. See the README section 'How the verdict is reached'.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
