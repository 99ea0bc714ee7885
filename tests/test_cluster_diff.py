"""The cluster diff: `align capture-env` on each side, `align report --baseline-env/--candidate-env`, and the
checklist naming each difference that matters (env variable, TF32 on one side, dataset file, a weight through
the mapping); identical captures name nothing; a bad capture is exit 2 with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from align.cli import main
from comparators.environment import compare_environments, read_capture
from core.errors import BadInput
from dumpers import environment as envcap
from tests.helpers.tiny_checkpoints import HEADS, save_pt, tiny_state
from tests.test_stages import make_run

torch = pytest.importorskip("torch")

MAPPING = "megatron_core__mindformers_mcore_dense"
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The GPU side's files (a Megatron state_dict, a dataset folder) and the NPU side's (the weights converted
    to MindFormers safetensors, a copy of the dataset); two run stores to report on."""
    t = tmp_path_factory.mktemp("clusters")
    data_b = t / "gpu_data"
    data_b.mkdir()
    rng = np.random.default_rng(0)
    (data_b / "train.bin").write_bytes(rng.integers(0, 255, 300_000, dtype=np.uint8).tobytes())
    (data_b / "train.idx").write_bytes(b"index v1")
    data_c = t / "npu_data"
    shutil.copytree(data_b, data_c)
    pt = save_pt(tiny_state(), t / "megatron.pt")
    st = t / "mf.safetensors"
    assert main(["convert-weights", str(pt), "--to", "mindformers", "--out", str(st), *HEADS]) == 0
    return {"dir": t, "data_b": data_b, "data_c": data_c, "pt": pt, "st": st,
            "b": make_run(t / "b", steps=4), "c": make_run(t / "c", steps=4)}


def capture(out: Path, framework: str, data: Path, weights: Path, monkeypatch: pytest.MonkeyPatch,
            env: dict[str, str]) -> Path:
    for k in ("NCCL_ALGO", "HCCL_ALGO", "OMP_NUM_THREADS", "HCCL_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["capture-env", "--framework", framework, "--out", str(out), "--data", str(data),
                 "--weights", str(weights)]) == 0
    return out


def report(clusters: dict[str, Path], out: str, *extra: str) -> tuple[int, dict]:
    rc = main(["report", "-q", str(clusters["b"]), str(clusters["c"]), "--mapping", MAPPING,
               "--out", str(clusters["dir"] / out), *extra])
    return rc, json.loads((clusters["dir"] / out / "summary.json").read_text())


def checklist_findings(summary: dict) -> dict[str, dict]:
    return {f["component"]: f for f in summary["findings"] if f["stage"] == "checklist" and f["verdict"] != "pass"}


def test_identical_captures_name_nothing(clusters: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    env = {"OMP_NUM_THREADS": "4"}
    a = capture(clusters["dir"] / "same_a.json", "torch", clusters["data_b"], clusters["pt"], monkeypatch, env)
    line = capsys.readouterr().out
    assert "capture-env:" in line and "MB/s" in line and "weights: 15 tensors" in line
    b = capture(clusters["dir"] / "same_b.json", "torch", clusters["data_c"], clusters["pt"], monkeypatch, env)
    rc, s = report(clusters, "r_same", "--baseline-env", str(a), "--candidate-env", str(b))
    st = s["stages"]["checklist"]
    assert rc == 0 and st["verdict"] == "pass" and checklist_findings(s) == {}
    rows = st["environment"]["rows"]
    assert {r["status"] for r in rows} <= {"same", "info", "unknown"}
    assert any(r["section"] == "weights" and r["status"] == "same" for r in rows)
    # the dataset folder is another path on the other cluster, with the same bytes
    assert any(r["section"] == "data" and r["status"] == "same" for r in rows)


def test_planted_differences_are_named(clusters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # GPU side: NCCL_ALGO pinned, 8 OpenMP threads, and TF32 on (a CUDA device that allows it)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            torch.backends.cuda.matmul.allow_tf32 = True
            b = capture(clusters["dir"] / "gpu.json", "torch", clusters["data_b"], clusters["pt"], m,
                        {"NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "8"})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    # NPU side: another thread count, MindSpore's compile cache on, one dataset file changed, one weight changed in
    # the converted file
    data_c = clusters["dir"] / "npu_data_changed"
    shutil.copytree(clusters["data_c"], data_c)
    raw = bytearray((data_c / "train.bin").read_bytes())
    raw[200_000] ^= 0xFF
    (data_c / "train.bin").write_bytes(bytes(raw))
    from checkpoints.mindformers import read_safetensors, write_safetensors

    arrays, _ = read_safetensors(clusters["st"])
    arrays[FC1] = arrays[FC1].copy()
    arrays[FC1][3, 1] += 1e-3
    st = write_safetensors(arrays, clusters["dir"] / "mf_changed.safetensors")
    c = capture(clusters["dir"] / "npu.json", "mindspore", data_c, st, monkeypatch,
                {"OMP_NUM_THREADS": "16", "MS_COMPILER_CACHE_ENABLE": "1"})

    rc, s = report(clusters, "r_diff", "--baseline-env", str(b), "--candidate-env", str(c))
    found = checklist_findings(s)
    assert s["stages"]["checklist"]["verdict"] == "fail" and rc == 1
    assert found["fp32_matmul_reduced"]["verdict"] == "fail"          # TF32 on the baseline only
    assert found["collective_algorithm"]["verdict"] == "warn"         # NCCL_ALGO set on one side
    assert found["determinism"]["verdict"] == "warn"
    assert found["fp32_conv_reduced"]["verdict"] == "warn"            # cuDNN's TF32 default, on a GPU
    assert "OMP_NUM_THREADS: baseline 8 vs candidate 16" in found["env:OMP_NUM_THREADS"]["message"]
    cache = found["compiled_graph_cache"]               # a cached graph keeps its folded constants
    assert cache["verdict"] == "warn" and "rms_norm_eps" in cache["message"], cache
    data = found[f"data:{clusters['data_b']}"]
    assert data["verdict"] == "fail" and "train.bin" in data["message"] and "train.idx" not in data["message"]
    assert found[FC1]["verdict"] == "fail" and found[FC1]["value"] == 1      # the one changed weight, by name
    assert "relative" in found[FC1]["message"]
    assert set(found) == {"fp32_matmul_reduced", "fp32_conv_reduced", "collective_algorithm", "determinism",
                          "compiled_graph_cache", "env:OMP_NUM_THREADS", f"data:{clusters['data_b']}", FC1}
    html = (clusters["dir"] / "r_diff" / "report.html").read_text()
    assert "Cluster diff (torch vs mindspore)" in html and "OMP_NUM_THREADS" in html


def test_bad_capture_file_is_exit_2_one_line(clusters: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    t = clusters["dir"]
    good = envcap.capture_environment("torch", by="test", observe_random=False)
    envcap.write_capture(t / "good.json", good)
    assert read_capture(t / "good.json")["framework"] == "torch"
    cases = {"not_json.json": "{not json", "summary.json": json.dumps({"verdict": "pass"}),
             "bad_env.json": json.dumps({**good, "env": {"NCCL_ALGO": 3}})}
    expect = {"not_json.json": "not valid JSON", "summary.json": "missing required key 'kind'",
              "bad_env.json": "key 'env.NCCL_ALGO': expected string"}
    for name, text in cases.items():
        (t / name).write_text(text)
        out = t / f"r_{name}"
        assert main(["report", "-q", str(clusters["b"]), str(clusters["c"]), "--out", str(out),
                     "--candidate-env", str(t / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and name in err and expect[name] in err, err
        assert not out.exists()        # nothing written


def test_dataset_hash_places_the_difference_and_reports_speed(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envcap, "CHUNK", 1 << 16)
    big = tmp_path / "a.bin"
    big.write_bytes(np.random.default_rng(1).integers(0, 255, 5 * (1 << 16) + 7, dtype=np.uint8).tobytes())
    (e,) = envcap.hash_files([big], workers=2)
    (f,) = e["files"]
    assert len(f["chunks"]) == 6 and f["chunk_size"] == 1 << 16 and e["mb_per_s"] > 0
    small = tmp_path / "s.txt"
    small.write_text("abc")
    import hashlib
    assert envcap.hash_files([small])[0]["files"][0]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    raw = bytearray(big.read_bytes())
    raw[3 * (1 << 16) + 5] ^= 1
    other = tmp_path / "b.bin"
    other.write_bytes(bytes(raw))
    cap = {"kind": "xf-align environment capture", "framework": "torch", "env": {}, "versions": {},
           "settings": {}, "random": {"observed": False}, "weights": None}
    res = compare_environments({**cap, "data": envcap.hash_files([big])}, {**cap, "data": envcap.hash_files([other])})
    (fnd,) = res.findings
    assert "a.bin: same size, first difference in bytes" in fnd.message
    with pytest.raises(BadInput, match="no such dataset"):
        envcap.hash_files([tmp_path / "missing"])


def test_versions_from_driver_files_and_secrets_redacted(tmp_path: Path) -> None:
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "version.info").write_text("Version=24.1.rc2\nascendhal_version=7.35.19\n")
    kit = tmp_path / "ascend-toolkit" / "latest" / "aarch64-linux"
    kit.mkdir(parents=True)
    (kit / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\n")
    assert envcap.ascend_versions(tmp_path, environ={}) == {"cann": "8.0.RC3", "ascend_driver": "24.1.rc2"}
    proc = tmp_path / "nvidia"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert envcap.nvidia_driver(proc) == "550.54.15"
    env = envcap.read_env({"HCCL_AUTH_TOKEN": "hunter2", "NCCL_ALGO": "Ring", "HOME": "/root", "MY_KEY": "x"})
    assert env["NCCL_ALGO"] == "Ring" and "hunter2" not in json.dumps(env) and set(env) == {"HCCL_AUTH_TOKEN",
                                                                                            "NCCL_ALGO"}


def test_corrupted_captures_are_refused_or_compared_never_a_crash(tmp_path: Path) -> None:
    """Seeded mutations of a real capture (keys dropped, values swapped for other JSON types): each one is
    refused with a one-line BadInput or compared; nothing else is raised."""
    import random

    (tmp_path / "d.bin").write_bytes(b"x" * 100)
    good = envcap.capture_environment("torch", by="test", data=[tmp_path / "d.bin"],
                                      weights=[("decoder.final_layernorm.weight", lambda: np.ones(4, np.float32),
                                                "float32")])
    good = json.loads(json.dumps(good))
    junk = [None, True, -1, 2**70, 1.5, float("nan"), "", "zz", [], [1], {}, {"a": 1}]
    rng = random.Random(5)

    def paths(obj, at=()):  # noqa: ANN001, ANN202
        yield at
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
        for k, v in items:
            yield from paths(v, (*at, k))

    every = [p for p in paths(good) if p]
    outcomes, last = {"refused": 0, "compared": 0}, ""
    # torch's seed when nothing seeded it is a random unsigned 64-bit integer: a capture, not bad input
    from comparators.environment import check_capture
    check_capture({**good, "random": {"observed": True, "torch": {"seed": 2**64 - 1, "state": "ab"}}}, "x.json")
    for _ in range(300):
        doc = json.loads(json.dumps(good))
        path = rng.choice(every)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and rng.random() < 0.3:
            del parent[path[-1]]
        else:
            parent[path[-1]] = rng.choice(junk)
        try:
            compare_environments(good, check_capture(doc, "x.json"))
            compare_environments(doc, good)
            outcomes["compared"] += 1
        except BadInput as exc:
            assert "\n" not in str(exc) and str(exc).startswith("x.json: ")
            outcomes["refused"] += 1
            last = str(exc)
    assert outcomes["refused"] > 50 and outcomes["compared"] > 50, (outcomes, last)
