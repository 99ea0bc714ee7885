"""The core install, as a user with only logs has it: `pip install xf-align` into a fresh environment (numpy,
pandas, matplotlib, h5py, PyYAML at their newest: numpy 2), no torch, no MindSpore. Every verb that needs no
framework works there; the ones that do say in one line which extra to install."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("core") / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and ("Could not find a version" in r.stderr or "Failed to establish" in r.stderr):
        pytest.skip(f"no package index reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    return py


def align(py: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # cwd outside the checkout: the installed package runs, not the working tree
    return subprocess.run([str(py), "-m", "align", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_no_framework_and_numpy_2(core: Path) -> None:
    code = ("import importlib.util, numpy; print(numpy.__version__.split('.')[0], "
            "[m for m in ('torch', 'mindspore', 'mindformers', 'megatron', 'safetensors') "
            "if importlib.util.find_spec(m)])")
    out = subprocess.run([str(core), "-c", code], capture_output=True, text=True, check=True).stdout.split(None, 1)
    assert out[1].strip() == "[]"
    assert int(out[0]) >= 2


def test_every_framework_free_verb_works(core: Path, tmp_path: Path) -> None:
    r = subprocess.run([str(core), "-m", "demo.example_logs", str(tmp_path / "ex"), "--steps", "40"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ex = tmp_path / "ex"
    runs = [str(ex / "megatron_baseline.log"), str(ex / "mindformers_candidate.log")]
    ok = [
        ("report", "-q", *runs, "--repeat", str(ex / "megatron_repeat.log"), "--out", str(tmp_path / "r1")),
        ("report", "-q", str(DATA / "msprobe" / "pt"), str(DATA / "msprobe" / "ms"), "--out", str(tmp_path / "r2")),
        ("import", runs[0], "--out", str(tmp_path / "store")),
        ("check-config", str(DATA / "configs" / "megatron_qwen3_32b.sh"),
         str(DATA / "configs" / "pretrain_qwen3_32b_4k.yaml")),
        ("mapping", "list"),
        ("mapping", "show", "megatron_core__mindformers_mcore_moe"),
    ]
    for args in ok:
        r = align(core, tmp_path, *args)
        assert r.returncode in (0, 1) and "internal error" not in r.stderr, (args, r.stderr[-2000:])
    assert (tmp_path / "r2" / "summary.json").is_file()
    r = align(core, tmp_path, "check-data", str(tmp_path / "store"))
    assert r.returncode in (0, 1, 2) and "internal error" not in r.stderr, r.stderr


@pytest.mark.parametrize("args,extra", [
    (("convert-weights", "--to", "mindformers", "IN.pt", "--out", "OUT.safetensors", "--num-heads", "2"), "torch"),
    (("demo", "--steps", "3", "--out", "DEMO"), "torch"),
])
def test_a_verb_that_needs_an_extra_says_which(core: Path, tmp_path: Path, args: tuple[str, ...], extra: str) -> None:
    (tmp_path / "IN.pt").write_bytes(b"x")
    r = align(core, tmp_path, *args)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and f"pip install 'xf-align[{extra}]'" in err[0], r.stderr
