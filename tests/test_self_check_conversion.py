"""Converted weights check themselves (checkpoints.conversion_totals): every rule group's converted tensors keep
the source's element count and L2 norm, and so does the whole checkpoint. The real conversion code runs on the
tiny Megatron checkpoints (tests/helpers/tiny_checkpoints.py); the faults are planted in the real transform it
calls (mapping.transforms.interleave_halves, the gated fc1's layout), not in a stand-in for it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import mapping.transforms as transforms  # noqa: E402
from align.cli import main  # noqa: E402
from checkpoints.conversion_totals import check_totals, tolerance  # noqa: E402
from tests.helpers.tiny_checkpoints import HEADS, save_legacy, save_pt, tiny_state  # noqa: E402

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def _convert(capsys, tmp_path: Path, src: Path, *extra: str) -> tuple[int, list[str], Path]:
    out = tmp_path / "o.safetensors"
    rc = main(["convert-weights", str(src), "--to", "mindformers", "--out", str(out), *HEADS, *extra])
    cap = capsys.readouterr()
    return rc, (cap.out + cap.err).strip().splitlines(), out


def test_clean_conversion_keeps_every_norm_both_ways(tmp_path, capsys) -> None:
    """A .pt and a legacy TP=2 folder convert with the totals equal (relative 0 measured: the same squares);
    the report carries the numbers; the way back to Megatron checks the same."""
    sd = tiny_state()
    total = float(np.sqrt(sum(float(np.dot(v.ravel().astype(np.float64), v.ravel())) for v in sd.values())))
    for src in (save_pt(sd, tmp_path / "m.pt"), save_legacy(sd, tmp_path / "legacy")):
        rc, lines, out = _convert(capsys, tmp_path, src, "--json")
        rep = json.loads("\n".join(lines))
        assert rc == 0 and rep["verdict"] == "pass", lines
        check = rep["self_check"]
        assert check["groups"] == 15 and check["source_numel"] == check["converted_numel"] == 1256
        assert check["source_norm"] == pytest.approx(total, rel=1e-12) and check["relative"] <= check["line"]
        assert any(f["metric"] == "norm_kept" for f in rep["findings"])
    rc = main(["convert-weights", str(out), "--to", "megatron", "--out", str(tmp_path / "b.pt"), *HEADS, "--json"])
    back = json.loads(capsys.readouterr().out)
    assert rc == 0 and back["self_check"]["converted_numel"] == 1256 and back["self_check"]["relative"] == 0.0


@pytest.mark.parametrize("plant, cause", [
    (lambda a, tp, real: real(a, tp)[:-2], "a part dropped (16 of 192 elements missing)"),
    (lambda a, tp, real: np.concatenate([real(a, tp), a[:1]]), "a part duplicated (8 elements more"),
    (lambda a, tp, real: np.concatenate([a[: a.shape[0] // 2]] * 2), "a wrong chunk (the same number of elements"),
])
def test_planted_bad_transform_is_refused_naming_the_tensor(tmp_path, capsys, monkeypatch, plant, cause) -> None:
    """The gated fc1's transform loses two rows, appends one twice, or takes the gate half twice: the conversion
    fails (exit 1) naming the source tensor, both norms and the cause, and writes nothing."""
    real = transforms.interleave_halves
    monkeypatch.setattr(transforms, "interleave_halves", lambda a, tp: plant(a, tp, real))
    src = save_pt(tiny_state(), tmp_path / "m.pt")
    rc, lines, out = _convert(capsys, tmp_path, src)
    assert rc == 1 and not out.exists(), lines
    line = lines[-1]
    assert line.startswith("FAIL ") and FC1 in line and "the converted L2 norm is" in line and cause in line, line
    assert "(and 2 more problems" in line     # layer 1's fc1, and the total


def test_a_target_written_twice_shows_in_the_total() -> None:
    """Two groups whose targets collide: each group's own tensors may look whole, the checkpoint is not."""
    a = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 5.0, dtype=np.float32)
    res = check_totals([(["a"], ["x"]), (["b"], ["x"])], {"a": a, "b": b}, {"x": b}, "m.pt")
    assert res.verdict == "fail"
    metrics = [f.metric for f in res.findings]
    assert metrics == ["norm_not_kept", "total_norm_not_kept"], metrics
    assert "a part dropped (6 of 12 elements missing)" in res.findings[-1].message
    assert tolerance(10 ** 6) == pytest.approx(1.1e-10, rel=0.01)


def test_conversion_stage_shows_the_self_check(tmp_path, capsys) -> None:
    """The report's conversion stage carries convert-weights' numbers, or says the report predates them."""
    from align.stages import Evidence, Inputs, run_stages

    src = save_pt(tiny_state(), tmp_path / "m.pt")
    rc, lines, _ = _convert(capsys, tmp_path, src, "--json")
    assert rc == 0
    (tmp_path / "conv.json").write_text("\n".join(lines))
    log = str(Path(__file__).parent / "data" / "mindformers_train.log")
    st = run_stages(Evidence.load(Inputs(log, log, conversion=str(tmp_path / "conv.json"))),
                    only=["conversion"])["conversion"]
    assert st.verdict == "pass" and st.details["self_check"]["converted_numel"] == 1256
    assert [f.metric for f in st.findings] == ["norm_kept"]
    old = json.loads("\n".join(lines))
    del old["self_check"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    st = run_stages(Evidence.load(Inputs(log, log, conversion=str(tmp_path / "old.json"))),
                    only=["conversion"])["conversion"]
    assert st.details["self_check"].startswith("not in this report")


def test_planted_qkv_split_taking_k_for_v_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """The legacy Llama (.ckpt) splits the fused QKV by query group: a split that returns k where v belongs keeps
    every count and changes the norm: refused as a wrong chunk, nothing written."""
    pytest.importorskip("mindspore")
    real = transforms.split_qkv
    monkeypatch.setattr(transforms, "split_qkv", lambda a, p: (lambda q, k, v: [q, k, k])(*real(a, p)))
    src = save_pt(tiny_state(), tmp_path / "m.pt")
    out = tmp_path / "o.ckpt"
    rc = main(["convert-weights", str(src), "--to", "mindformers", "--out", str(out), *HEADS])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and not out.exists() and not list(tmp_path.glob("*.ckpt")), line
    assert "decoder.layers.0.self_attention.linear_qkv.weight -> " in line and "a wrong chunk" in line, line
