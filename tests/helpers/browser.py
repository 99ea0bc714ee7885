"""report.html in a real headless Chromium, looked at through the DevTools protocol.

Why the protocol and not a screenshot: a screenshot proves only that something was drawn. Over
``--remote-debugging-pipe`` (JSON messages ending in NUL on fds 3 and 4; stdlib only, no websockets, no
pyppeteer/playwright) the test reads what the page really shows after layout: the verdict banner, every
stage row and whether it is visible, every image's decoded size, and every console error or exception.

Chromium comes from Debian (`make browser`). Without it the browser tests skip, unless
XF_ALIGN_REQUIRE_BROWSER=1 (set by .ci/run), where a missing browser is a failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import selectors
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-extensions", "--disable-quic", "--mute-audio", "--hide-scrollbars",
         "--window-size=1200,900", "--remote-debugging-pipe")

# What the page shows, read after the load event (every data-URI image has been decoded or has failed by then).
LOOK = r"""
(() => {
  const shown = el => !!el && el.checkVisibility({opacityProperty: true, visibilityProperty: true})
                      && el.getBoundingClientRect().width > 0 && el.getBoundingClientRect().height > 0;
  const banner = document.querySelector('.banner');
  const verdict = banner && banner.querySelector('.verdict');
  const scope = banner && banner.querySelector('.scope');
  const box = document.getElementById('diagnosis');
  const h2 = [...document.querySelectorAll('h2')].find(h => h.textContent.trim() === 'Stages');
  let table = h2 && h2.nextElementSibling;
  const stages = [];
  if (table && table.tagName === 'TABLE') {
    for (const tr of [...table.rows].slice(1)) {
      const badge = tr.querySelector('.badge');
      stages.push({name: tr.cells[0] ? tr.cells[0].textContent : '', verdict: badge ? badge.textContent : '',
                   shown: shown(tr) && shown(tr.cells[0]) && shown(badge)});
    }
  }
  // a PNG cut short still has its size (naturalWidth > 0) and decode() resolves; the rows never decoded
  // stay transparent, and every figure the report draws is opaque: count the pixels that are not
  const unpainted = i => {
    if (!i.naturalWidth) return -1;
    const c = document.createElement('canvas');
    c.width = i.naturalWidth; c.height = i.naturalHeight;
    const ctx = c.getContext('2d');
    ctx.drawImage(i, 0, 0);
    const d = ctx.getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let k = 3; k < d.length; k += 4) if (d[k] !== 255) n++;
    return n;
  };
  return {
    title: document.title,
    banner: verdict ? verdict.textContent : null, banner_shown: shown(verdict),
    scope: scope ? scope.textContent : null,
    // the first screen: the diagnosis box's text and whether it starts within the window's height
    diagnosis: box ? {text: box.innerText, shown: shown(box),
                      first_screen: box.getBoundingClientRect().top < window.innerHeight} : null,
    stages_table: !!table && table.tagName === 'TABLE', stages,
    images: [...document.images].map(i => ({alt: i.alt, complete: i.complete, natural: [i.naturalWidth,
             i.naturalHeight], unpainted: unpainted(i), shown: shown(i)})),
    scripts: document.scripts.length,
    text: document.body ? document.body.innerText : '',
  };
})()
"""


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium process; ``look(url)`` opens a fresh tab, reads the page, closes the tab."""

    def __init__(self, exe: str, profile: Path, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.log = profile / "chromium.stderr"
        profile.mkdir(parents=True, exist_ok=True)
        to_r, self._to_w = os.pipe()          # we write, Chromium reads on fd 3
        self._from_r, from_w = os.pipe()      # Chromium writes on fd 4, we read
        # bash moves Chromium's two ends onto fds 3 and 4 (Popen cannot renumber fds; no preexec_fn); first
        # they are moved above 4 here, so that neither is 3 or 4 itself
        to_r, from_w = (_above4(fd) for fd in (to_r, from_w))
        script = f'exec "$0" "$@" 3<&{to_r} 4>&{from_w} {to_r}<&- {from_w}>&-'
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(["bash", "-c", script, exe, *FLAGS, f"--user-data-dir={profile / 'p'}",
                                          "about:blank"], pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL,
                                         stdout=err, stderr=err, start_new_session=True)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._next = 0
        self._events: list[dict[str, Any]] = []
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._from_r, selectors.EVENT_READ)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise BrowserError(f"no answer from Chromium in {self.timeout:.0f} s; its log: {self._tail()}")
            chunk = os.read(self._from_r, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed the pipe (exit {self.proc.poll()}); its log: {self._tail()}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:] if self.log.exists() else "(none)"

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its answer; events that arrive meanwhile are kept for ``wait_for``."""
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            got = self._read_message(deadline)
            if got.get("id") == self._next:
                if "error" in got:
                    raise BrowserError(f"{method}: {got['error']}")
                return got.get("result", {})
            if "method" in got:
                self._events.append(got)

    def wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(e["method"] == method and e.get("sessionId") == session for e in self._events):
            got = self._read_message(deadline)
            if "method" in got:
                self._events.append(got)

    def look(self, url: str) -> dict[str, Any]:
        """What ``url`` shows once loaded (see LOOK) plus ``errors``: console errors, exceptions, error logs."""
        self._events.clear()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable", session=session)
            nav = self.call("Page.navigate", {"url": url}, session=session)
            if nav.get("errorText"):
                raise BrowserError(f"{url}: {nav['errorText']}")
            self.wait_for("Page.loadEventFired", session)
            res = self.call("Runtime.evaluate", {"expression": LOOK, "returnByValue": True}, session=session)
            if "exceptionDetails" in res:
                raise BrowserError(f"the page check itself failed: {res['exceptionDetails']}")
            page = res["result"]["value"]
            # one round trip more, so console messages logged during load have surely arrived
            self.call("Runtime.evaluate", {"expression": "0"}, session=session)
        finally:
            self.call("Target.closeTarget", {"targetId": target})
        page["errors"] = [_error_text(e) for e in self._events if e.get("sessionId") == session
                          and _is_error(e)]
        return page

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: the renderers go with it
            self.proc.wait()
        self._sel.close()
        os.close(self._to_w)
        os.close(self._from_r)


def _above4(fd: int) -> int:
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return new


def _is_error(e: dict[str, Any]) -> bool:
    p = e.get("params", {})
    return (e["method"] == "Runtime.exceptionThrown"
            or (e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"))
            or (e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error"))


def _error_text(e: dict[str, Any]) -> str:
    p = e["params"]
    if e["method"] == "Runtime.exceptionThrown":
        d = p["exceptionDetails"]
        return "exception: " + (d.get("exception", {}).get("description") or d.get("text", ""))
    if e["method"] == "Runtime.consoleAPICalled":
        return "console.error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
    return f"log {p['entry'].get('source')}: {p['entry'].get('text')}"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@contextmanager
def chromium(tmp: Path) -> Iterator[Chromium]:
    """A running headless Chromium; skipped when none is installed (a failure under XF_ALIGN_REQUIRE_BROWSER=1)."""
    exe = chromium_path()
    if exe is None:
        msg = "chromium not installed (`make browser` installs Debian's chromium)"
        if os.environ.get("XF_ALIGN_REQUIRE_BROWSER") == "1":
            pytest.fail(msg + "; XF_ALIGN_REQUIRE_BROWSER=1 requires it")
        pytest.skip(msg)
    browser = Chromium(exe, tmp)
    try:
        yield browser
    finally:
        browser.close()


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def report_problems(page: dict[str, Any], summary: dict[str, Any], figures: list[Path]) -> list[str]:
    """Everything wrong with the rendered report against its own summary.json and figures/: [] when the page
    shows the verdict, every stage with its verdict, every figure fully decoded at its size, and logged no error."""
    problems = [f"console: {e}" for e in page["errors"]]
    want = f"Verdict: {summary['verdict'].upper()}"
    if page["banner"] != want or not page["banner_shown"]:
        problems.append(f"verdict banner {page['banner']!r} (shown: {page['banner_shown']}), want {want!r}")
    if page["scope"] != summary["coverage"]["banner"]:
        problems.append(f"banner scope {page['scope']!r}, want {summary['coverage']['banner']!r}")
    roots = [e for e in summary["diagnosis"] if e["consequence_of"] is None]
    box = page["diagnosis"]
    if roots and not (box and box["shown"] and box["first_screen"]):
        problems.append(f"the diagnosis is not on the first screen: {box}")
    elif roots and not (roots[0]["stage"] in box["text"] and str(roots[0]["component"] or "") in box["text"]):
        problems.append(f"the diagnosis box does not name {roots[0]['stage']} {roots[0]['component']}: {box}")
    if not page["stages_table"]:
        problems.append("no stages table after the 'Stages' heading")
    rows = {s["name"]: s for s in page["stages"]}
    if len(rows) != len(page["stages"]):
        problems.append(f"a stage listed twice: {[s['name'] for s in page['stages']]}")
    for name, st in summary["stages"].items():
        row = rows.get(name)
        if row is None:
            problems.append(f"stage {name}: not on the page")
        elif not row["shown"]:
            problems.append(f"stage {name}: on the page but not visible")
        elif row["verdict"] != st["verdict"]:
            problems.append(f"stage {name}: page says {row['verdict']!r}, summary.json {st['verdict']!r}")
    for name in set(rows) - set(summary["stages"]):
        problems.append(f"stage {name}: on the page, not in summary.json")
    sizes = sorted(png_size(p.read_bytes()) for p in figures)
    imgs = page["images"]
    for im in imgs:
        if not im["complete"] or im["natural"][0] == 0 or im["unpainted"] or not im["shown"]:
            problems.append(f"figure {im['alt']!r}: not decoded, partly decoded or not visible ({im})")
    got = sorted(tuple(im["natural"]) for im in imgs)
    if got != sizes:
        problems.append(f"figures on the page (decoded sizes {got}) are not figures/*.png ({sizes})")
    if page["scripts"]:
        problems.append(f"{page['scripts']} <script> element(s): the report has none of its own")
    return problems


def tamper(html: str, what: str) -> str:
    """A copy of report.html with one thing broken, to show that report_problems sees it."""
    if what == "hide_stage":                     # the last stage row styled away
        i = html.index("<h2>Stages</h2>")
        j = html.rindex("<tr><td>", i, html.index("</table>", i))
        return html[:j] + "<tr style='display:none'>" + html[j + 4:]
    if what == "drop_stage":                     # the first stage row removed
        i = html.index("<h2>Stages</h2>")
        j = html.index("<tr><td>", i)
        return html[:j] + html[html.index("</tr>", j) + 5:]
    if what == "broken_image":                   # the first figure's PNG cut in half
        m = re.search(r'src="data:image/png;base64,([^"]+)"', html)
        assert m, "no inlined figure"
        data = m.group(1)
        return html[:m.start(1)] + data[: len(data) // 2 // 4 * 4] + html[m.end(1):]
    if what == "corrupt_image":                  # the first figure's bytes are not a PNG at all
        return re.sub(r'src="data:image/png;base64,[^"]{8}', 'src="data:image/png;base64,AAAAAAAA', html, count=1)
    if what == "bury_diagnosis":                 # the culprit pushed below the first screen
        return html.replace('<div class="box" id="diagnosis"', '<div style="height:3000px"></div><div class="box" '
                            'id="diagnosis"', 1)
    if what == "console_error":
        return html.replace("</body>", "<script>console.error('tampered')</script></body>")
    if what == "exception":
        return html.replace("</body>", "<script>notDefinedAnywhere()</script></body>")
    raise ValueError(what)
