"""The README's and docs/' commands run as written, in page order (paths under /tmp moved into a temporary folder).

Every ```bash block of README.md and docs/*.md carries one of two marks on the line before it:
- `<!-- tested: tests/test_readme.py runs this block -->` (optionally `(needs torch, mindspore, ...)`): this file
  runs the page's tested blocks one after the other in one working folder, as a reader would type them, from a
  folder where the checkout's `tests/`, `docs/`, `demo/` and `models/` are at hand; `align` and `python` are this
  environment's. `tests/test_demo.py` runs docs/workflow.md's blocks marked for it (they train models).
- `<!-- not run in tests: REASON -->`: commands for a cluster, a checkout or a model training run that the
  suite cannot run in its time; the reason says which.
A command fails the test when it exits non-zero, except an `align` verb's verdict (1: fail), which is the
example's point; an `align` exit of 2 (bad input) or 3 (internal error) fails, as does any traceback.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTED = re.compile(r"<!-- tested: tests/test_readme\.py runs this block(?: \(needs ([^)]*)\))? -->")
ANY_MARK = re.compile(r"<!-- (?:tested: tests/test_(?:readme|demo)\.py runs this block[^>]*"
                      r"|not run in tests: [^>]+) -->")
BLOCK = re.compile(r"^([ \t]*)```bash\n(.*?)^\1```", re.S | re.M)
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
# an align verb may exit 1 (its verdict); anything else must exit 0
TRAP = ("trap 'rc=$?; case \"$BASH_COMMAND\" in align\\ *|*/align\\ *) [ $rc -le 1 ] || exit $rc;; "
        "*) exit $rc;; esac' ERR\n")


def bash_blocks(page: str) -> list[tuple[str, str, str]]:
    """(the line before the block, the block, its first line) for every ```bash block of the page."""
    text = (ROOT / page).read_text()
    out = []
    for m in BLOCK.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        body = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
        out.append((before, body, body.splitlines()[0] if body else ""))
    return out


def blocks_to_run(page: str) -> list[tuple[list[str], str]]:
    """(modules needed, block) for the page's blocks this file runs, in page order."""
    out = []
    for before, body, _ in bash_blocks(page):
        m = TESTED.fullmatch(before)
        if m:
            needs = [n.strip() for n in (m.group(1) or "").split(",") if n.strip()]
            out.append((needs, body))
    return out


def test_every_bash_block_is_tested_or_says_why() -> None:
    unmarked = [f"{page}: {first}" for page in PAGES for before, _, first in bash_blocks(page)
                if not ANY_MARK.fullmatch(before)]
    assert not unmarked, "blocks neither tested nor marked `<!-- not run in tests: REASON -->`:\n" + "\n".join(unmarked)


def run_page(page: str, tmp_path: Path) -> list[str]:
    """Run the page's tested blocks in order; returns each block's stdout."""
    blocks = blocks_to_run(page)
    assert blocks, f"{page} lost its tested blocks"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in ("tests", "docs", "demo", "models"):
        (cwd / name).symlink_to(ROOT / name)
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg")
    outputs, missing = [], []
    for needs, block in blocks:
        # a block whose modules are missing is left out; so is every later block that needs any module (it may
        # use the files the left-out one makes); blocks that need none still run
        missing += [m for m in needs if importlib.util.find_spec(m) is None]
        if needs and missing:
            continue
        script = block.replace("/tmp/ex", str(tmp_path / "ex")).replace(".venv/bin/", venv_bin + "/")
        r = subprocess.run(["bash", "-c", "set -o pipefail\n" + TRAP + script + "\nexit 0\n"], cwd=cwd, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{page}:\n{block}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, f"{page}:\n{block}\n{r.stderr}"
        outputs.append(r.stdout)
    return outputs


def test_readme_examples_run(tmp_path: Path) -> None:
    run_page("README.md", tmp_path)
    assert (tmp_path / "ex" / "report" / "report.html").is_file()


DOC_PAGES = [p for p in PAGES if p != "README.md" and blocks_to_run(p)]


@pytest.mark.parametrize("page", DOC_PAGES)
def test_doc_examples_run(page: str, tmp_path: Path) -> None:
    outputs = run_page(page, tmp_path)
    if page == "docs/alignment.md":
        text = "\n".join(outputs)
        # the check-data example: the clean batches pass, the planted faults are named
        assert "check-data: pass (5 batches)" in text and "check-data: fail (5 batches)" in text
        assert "pad id == eos id" in text and "a cached mask is probably being modified in place" in text
