"""docs/extending.md followed to the letter: each recipe's files, and nothing else, dropped into a copy of the
project, make `align` do the new thing. A recipe that needs one more file than it lists fails here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "extending.md"
PACKAGES = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]


def recipe(section: str) -> dict[str, str]:
    """The files a section of docs/extending.md tells the reader to write: each code block whose first line is
    ``# path/to/file`` under that heading."""
    text = DOC.read_text()
    start = text.index(f"## {section}")
    ends = [i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0]
    body = text[start: min(ends) if ends else None]        # up to the next heading
    files = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, re.S):
        first = code.splitlines()[0]
        if first.startswith("# ") and "/" in first and lang in ("python", "yaml"):
            files[first[2:].strip()] = code
    assert files, f"docs/extending.md '{section}': no file to write"
    return files


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A copy of the project's packages (no tests, no docs)."""
    src = tmp_path / "src"
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def follow(project: Path, section: str) -> list[str]:
    written = []
    for rel, code in recipe(section).items():
        path = project / rel
        assert not path.exists(), f"{rel}: the recipe overwrites a shipped file"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        written.append(rel)
    return written


def align(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run([sys.executable, "-m", "align", *args], cwd=project.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def write_store(path: Path, project: Path, scalars: dict[int, dict[str, float]]) -> None:
    code = ("import json, sys\nfrom runstore import RunWriter\n"
            "with RunWriter(sys.argv[1], rank=0) as w:\n"
            "    for step, values in json.loads(sys.argv[2]).items():\n"
            "        w.log_scalars(int(step), values)\n")
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(scalars)], check=True,
                   env={**os.environ, "PYTHONPATH": str(project)})


def test_a_stage_is_one_file(project: Path, tmp_path: Path) -> None:
    written = follow(project, "A stage of the procedure")
    assert written == ["align/stages/loss_scale.py"]
    b, c = tmp_path / "b", tmp_path / "c"
    write_store(b, project, {s: {"loss": 10.0 - s * 0.1, "loss_scale": 8.0} for s in range(1, 6)})
    write_store(c, project, {s: {"loss": 10.0 - s * 0.1, "loss_scale": 16.0 / 2 ** s} for s in range(1, 6)})
    r = align(project, "report", "-q", str(b), str(c), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    st = summary(tmp_path / "rep")["stages"]["loss_scale"]
    assert st["verdict"] == "warn"
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "loss_scale" in page and "Loss scale curves" in page      # the stage's own figure, embedded
    assert (tmp_path / "rep" / "figures" / "loss_scale.png").read_bytes().startswith(b"\x89PNG")


def test_a_source_kind_is_one_file(project: Path, tmp_path: Path) -> None:
    written = follow(project, "A source kind (")
    assert written == ["sources/csv_losses.py"]
    (tmp_path / "a.csv").write_text("step,loss\n1,10.5\n2,10.25\n3,10.0\n")
    (tmp_path / "b.csv").write_text("step,loss\n1,10.5\n2,10.25\n3,10.0\n")
    r = align(project, "report", "-q", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    s = summary(tmp_path / "rep")
    assert [run["kind"] for run in s["runs"]][:2] == ["csv_losses", "csv_losses"]
    assert s["stages"]["step1_loss"]["verdict"] == "pass"
    h = align(project, "import", "--help")
    assert "step,loss CSV" in "".join(h.stdout.split()) or "step,lossCSV" in "".join(h.stdout.split())


def test_a_tensor_dump_source_is_one_file(project: Path, tmp_path: Path) -> None:
    from test_layer_sources import MODULES, _dump

    assert follow(project, "A tensor-dump source") == ["sources/npy_layers.py"]
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b", perturb=MODULES[1])
    r = align(project, "report", "-q", str(a), str(b), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    s = summary(tmp_path / "rep")
    assert [run["kind"] for run in s["runs"]] == ["npy_layers", "npy_layers"]
    assert s["stages"]["layer_tensors"]["first_departing_forward"]["module"] == MODULES[1]


def test_a_model_family_is_one_folder(project: Path, tmp_path: Path) -> None:
    written = follow(project, "A model family")
    assert sorted(written) == ["models/my_family/__init__.py",
                               "models/my_family/megatron_core__mindformers_my_family.yaml"]
    listed = align(project, "mapping", "list")
    assert "megatron_core__mindformers_my_family" in listed.stdout.split(), listed.stderr
    # chosen without --mapping, from the candidate's MindFormers YAML
    cfg = (ROOT / "tests" / "data" / "configs" / "pretrain_qwen3_32b_4k.yaml").read_text()
    assert 'model_type: "qwen3"' in cfg
    (tmp_path / "mine.yaml").write_text(cfg.replace('model_type: "qwen3"', 'model_type: "my_model"'))
    b, c = tmp_path / "b", tmp_path / "c"
    for run in (b, c):
        write_store(run, project, {s: {"loss": 10.0 - s * 0.1} for s in range(1, 4)})
    r = align(project, "report", str(b), str(c), "--candidate-config", str(tmp_path / "mine.yaml"),
              "--out", str(tmp_path / "rep"))
    assert r.returncode in (0, 1), r.stderr
    assert "mapping: megatron_core__mindformers_my_family" in r.stderr, r.stderr
