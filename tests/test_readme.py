"""The README's copy-paste examples run as written (paths moved into a temporary folder)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- tested: tests/test_readme.py runs this block -->"


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(re.escape(MARK) + r"\s*```bash\n(.*?)```", text, re.S)


def test_readme_examples_run(tmp_path):
    blocks = readme_blocks()
    assert blocks, "README lost its tested example"
    venv_bin = str(Path(sys.executable).parent)
    for block in blocks:
        script = block.replace("/tmp/ex", str(tmp_path / "ex")).replace(".venv/bin/", venv_bin + "/")
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "ex" / "report" / "report.html").is_file()
