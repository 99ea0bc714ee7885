"""Issue 24, checkpoints: `align convert-weights` and the checkpoint readers are never silently wrong.

Each case was measured wrong before (a "(pass)" on an incomplete result, or a traceback): now a mapped
tensor that is absent, empty, of a non-weight dtype or of a shape unlike its siblings fails (exit 1, one
line naming it, nothing written), and ordinary mistakes are bad input (exit 2, one line naming the file).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from align.cli import main  # noqa: E402
from checkpoints.megatron import read_megatron_checkpoint  # noqa: E402
from checkpoints.mindformers import read_safetensors, write_safetensors  # noqa: E402
from core.errors import BadInput  # noqa: E402
from tests.helpers.tiny_checkpoints import (  # noqa: E402
    HEADS,
    save_legacy,
    save_pt,
    save_torch_dist,
    tiny_state,
)


def _cli(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = main(["convert-weights", *argv])
    cap = capsys.readouterr()
    return rc, (cap.out + cap.err).strip().splitlines()


def _nothing_written(folder: Path, keep: set[str]) -> bool:
    return {p.name for p in folder.iterdir()} == keep


def test_clean_tiny_state_converts_both_ways_exactly(tmp_path, capsys) -> None:
    sd = tiny_state()
    save_pt(sd, tmp_path / "m.pt")
    rc, lines = _cli(capsys, str(tmp_path / "m.pt"), "--to", "mindformers", "--out", str(tmp_path / "m.safetensors"),
                     *HEADS)
    assert rc == 0 and lines[-1].startswith("wrote 15 tensors") and lines[-1].endswith("(pass)"), lines
    rc, lines = _cli(capsys, str(tmp_path / "m.safetensors"), "--to", "megatron", "--out", str(tmp_path / "b.pt"),
                     *HEADS)
    assert rc == 0, lines
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(back[k].numpy(), v, err_msg=k)


def _fails_naming(capsys, tmp_path, src: Path, to: str, needle: str) -> None:
    out = tmp_path / ("o.pt" if to == "megatron" else "o.safetensors")
    before = {p.name for p in tmp_path.iterdir()}
    rc, lines = _cli(capsys, str(src), "--to", to, "--out", str(out), *HEADS)
    assert rc == 1, lines
    assert len(lines) == 1 and needle in lines[0] and str(src) in lines[0], lines
    assert "pass" not in lines[0]
    assert _nothing_written(tmp_path, before)


def test_missing_layer_tensor_fails(tmp_path, capsys) -> None:
    """Measured: a safetensors file without one layer's linear_fc1.weight -> "wrote 14 tensors (pass)"."""
    sd = tiny_state()
    del sd["decoder.layers.1.mlp.linear_fc1.weight"]
    write_safetensors(sd, tmp_path / "miss.safetensors")
    _fails_naming(capsys, tmp_path, tmp_path / "miss.safetensors", "megatron", "decoder.layers.1.mlp.linear_fc1.weight")
    save_pt(sd, tmp_path / "miss.pt")
    _fails_naming(capsys, tmp_path, tmp_path / "miss.pt", "mindformers", "decoder.layers.1.mlp.linear_fc1.weight")


def test_empty_state_dict_fails(tmp_path, capsys) -> None:
    """Measured: an empty state dict -> "wrote 0 tensors (pass)"."""
    write_safetensors({}, tmp_path / "empty.safetensors")
    _fails_naming(capsys, tmp_path, tmp_path / "empty.safetensors", "megatron", "no tensors")
    torch.save({}, tmp_path / "empty.pt")
    _fails_naming(capsys, tmp_path, tmp_path / "empty.pt", "mindformers", "no tensors")


def test_zero_size_and_complex_tensors_fail(tmp_path, capsys) -> None:
    """Measured: zero-size and complex tensors passed."""
    sd = tiny_state()
    sd["decoder.layers.0.input_layernorm.weight"] = np.zeros((0,), np.float32)
    write_safetensors(sd, tmp_path / "zero.safetensors")
    _fails_naming(capsys, tmp_path, tmp_path / "zero.safetensors", "megatron", "is empty")
    d = {k: torch.from_numpy(v) for k, v in tiny_state().items()}
    d["decoder.layers.1.pre_mlp_layernorm.weight"] = torch.ones(8, dtype=torch.complex64)
    torch.save(d, tmp_path / "complex.pt")
    _fails_naming(capsys, tmp_path, tmp_path / "complex.pt", "mindformers", "complex64")


def test_object_dtype_and_sibling_shape_fail_through_the_library(tmp_path) -> None:
    from checkpoints.convert import check_weights
    from models import load_mapping

    m = load_mapping("megatron_core__mindformers_mcore_dense")
    sd: dict = dict(tiny_state())
    sd["decoder.layers.0.input_layernorm.weight"] = np.array(["a"] * 8, dtype=object)
    res = check_weights(sd, m, "baseline", "x.pt")
    assert res.verdict == "fail" and any("dtype object" in f.message for f in res.findings)
    sd = dict(tiny_state())
    sd["decoder.layers.1.input_layernorm.weight"] = np.ones(5, np.float32)     # identity rule: any shape "fits"
    res = check_weights(sd, m, "baseline", "x.pt")
    assert res.verdict == "fail" and any(f.metric == "shape_mismatch" for f in res.findings), res.findings


def test_sibling_shape_mismatch_fails_on_the_command_line(tmp_path, capsys) -> None:
    sd = tiny_state()
    sd["decoder.layers.1.pre_mlp_layernorm.weight"] = np.ones(6, np.float32)
    write_safetensors(sd, tmp_path / "shape.safetensors")
    _fails_naming(capsys, tmp_path, tmp_path / "shape.safetensors", "megatron",
                  "pre_mlp_layernorm.weight has shape [6]")


# -- ordinary mistakes: exit 2, one line naming the file -----------------------------------------------------

def _bad(capsys, tmp_path, argv: list[str], needle: str) -> None:
    before = {p.name for p in tmp_path.iterdir()}
    rc, lines = _cli(capsys, *argv)
    assert rc == 2 and len(lines) == 1 and needle in lines[0], lines
    assert _nothing_written(tmp_path, before)


def test_command_line_mistakes_are_bad_input(tmp_path, capsys) -> None:
    pt = save_pt(tiny_state(), tmp_path / "m.pt")
    to = [str(pt), "--to", "mindformers"]
    _bad(capsys, tmp_path, [*to, "--out", str(tmp_path / "no" / "x.safetensors"), *HEADS], "does not exist")
    (tmp_path / "adir").mkdir()
    _bad(capsys, tmp_path, [*to, "--out", str(tmp_path / "adir"), *HEADS], "existing folder")
    _bad(capsys, tmp_path, [*to, "--out", str(tmp_path / "x.safetensors"), "--num-heads", "0"], "--num-heads 0")
    _bad(capsys, tmp_path, [*to, "--out", str(tmp_path / "x.safetensors"), "--num-heads", "4",
                            "--num-query-groups", "3"], "--num-query-groups 3")


def test_mismatched_tp_shards_odd_fc1_and_scalars_are_bad_input(tmp_path, capsys) -> None:
    sd = tiny_state()
    a = save_pt(sd, tmp_path / "a.pt")
    other = dict(sd)
    del other["output_layer.weight"]
    b = save_pt(other, tmp_path / "b.pt")
    out = ["--to", "mindformers", "--out", str(tmp_path / "x.safetensors"), *HEADS]
    _bad(capsys, tmp_path, [str(a), str(b), *out], "TP shards")
    c = dict(sd)
    c["decoder.final_layernorm.weight"] = np.ones(3, np.float32)      # a duplicated tensor differing by rank
    _bad(capsys, tmp_path, [str(a), str(save_pt(c, tmp_path / "c.pt")), *out], "TP shards")
    odd = dict(sd)
    for i in range(2):
        odd[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = np.ones((25, 8), np.float32)
    _bad(capsys, tmp_path, [str(save_pt(odd, tmp_path / "odd.pt")), *out], "odd.pt: rule linear_fc1")
    sc = {k: torch.from_numpy(v) for k, v in sd.items()}
    sc["decoder.final_layernorm.weight"] = torch.tensor(1.0)                  # 0-d
    torch.save(sc, tmp_path / "sc.pt")
    _bad(capsys, tmp_path, [str(tmp_path / "sc.pt"), *out], "is a scalar")


def test_nested_safetensors_header_is_bad_input(tmp_path, capsys) -> None:
    """Measured: RecursionError from json.loads on a deeply nested header."""
    head = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    p = tmp_path / "nest.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head)
    _bad(capsys, tmp_path, [str(p), "--to", "megatron", "--out", str(tmp_path / "x.pt"), *HEADS], "nested too deeply")


def test_safetensors_header_must_tile_the_data(tmp_path) -> None:
    """Overlapping offsets, huge declared shapes and duplicate names would otherwise read wrong bytes."""
    write_safetensors({"a": np.arange(4, dtype=np.float32), "b": np.ones(4, np.float32)}, tmp_path / "ok.safetensors")
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head, data = raw[8:8 + n], raw[8 + n:]
    for what, new in [("overlap", head.replace(b'"data_offsets":[16,32]', b'"data_offsets":[0 ,16]')),
                      ("huge", head.replace(b'"shape":[4]', b'"shape":[99999999999999]', 1)),
                      ("dup", head.replace(b'"b":', b'"a":'))]:
        assert new != head, what
        p = tmp_path / f"{what}.safetensors"
        p.write_bytes(struct.pack("<Q", len(new)) + new + data)
        with pytest.raises(BadInput, match=f"{what}.safetensors"):
            read_safetensors(p)


def test_convert_weights_without_torch_names_the_extra(tmp_path, monkeypatch, capsys) -> None:
    pt = save_pt(tiny_state(), tmp_path / "m.pt")
    monkeypatch.setitem(sys.modules, "torch", None)
    rc, lines = _cli(capsys, str(pt), "--to", "mindformers", "--out", str(tmp_path / "x.safetensors"), *HEADS)
    assert rc == 2 and len(lines) == 1 and "'torch' extra" in lines[0], lines
    assert not (tmp_path / "x.safetensors").exists()


# -- Megatron checkpoint folders -----------------------------------------------------------------------------

def test_torch_dist_damage_is_bad_input_not_a_traceback(tmp_path) -> None:
    """Measured: torch's CheckpointException (a BaseException) escaped `except Exception` as a traceback."""
    root = save_torch_dist(tiny_state(), tmp_path / "ck")
    it = root / "iter_0000001"
    ref, _ = read_megatron_checkpoint(root)
    shards = sorted(it.glob("*.distcp"))
    assert len(shards) == 2
    blob = shards[1].read_bytes()
    shards[1].write_bytes(blob[: len(blob) // 2])                       # truncated shard
    with pytest.raises(BadInput, match="distcp"):
        read_megatron_checkpoint(root)
    shards[1].unlink()                                                   # missing shard
    with pytest.raises(BadInput, match="missing shard"):
        read_megatron_checkpoint(root)
    shards[1].write_bytes(blob)
    got, _ = read_megatron_checkpoint(root)
    assert sorted(got) == sorted(ref)
    assert all(np.array_equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("text", [b"abc", b"-1", b"\xff\xfe\x00\x01", b""])
def test_latest_checkpointed_iteration_garbage_is_bad_input(tmp_path, text) -> None:
    root = save_torch_dist(tiny_state(), tmp_path / "ck")
    (root / "latest_checkpointed_iteration.txt").write_bytes(text)
    with pytest.raises(BadInput, match="latest_checkpointed_iteration.txt"):
        read_megatron_checkpoint(root)


def test_metadata_allow_list_names_classes_not_modules(tmp_path) -> None:
    """Measured: the allow-list admitted anything importable from the DCP modules, e.g. `filesystem.os`."""
    root = save_torch_dist(tiny_state(), tmp_path / "ck")
    it = root / "iter_0000001"

    # GLOBAL torch.distributed.checkpoint.filesystem.os: the module object itself, from an admitted module
    (it / ".metadata").write_bytes(b"\x80\x04ctorch.distributed.checkpoint.filesystem\nos\n.")
    with pytest.raises(BadInput, match=r"\.metadata: checkpoint metadata holds torch\.distributed\.checkpoint"
                                       r"\.filesystem\.os, outside the allow-list"):
        read_megatron_checkpoint(it)
    (it / ".metadata").write_bytes(b"\x80\x04ctorch.distributed.checkpoint.filesystem\nFileSystemWriter\n.")
    with pytest.raises(BadInput, match="FileSystemWriter, outside the allow-list"):
        read_megatron_checkpoint(it)


def test_legacy_missing_rank_and_damage_are_bad_input(tmp_path) -> None:
    root = save_legacy(tiny_state(), tmp_path / "ck")
    got, _ = read_megatron_checkpoint(root)
    for k, v in tiny_state().items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    f1 = root / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    blob = bytearray(f1.read_bytes())
    i = blob.find(np.ascontiguousarray(tiny_state()["output_layer.weight"][8:]).tobytes()[:16])
    assert i > 0
    blob[i] ^= 0x10                                                         # one bit of tensor data
    f1.write_bytes(bytes(blob))
    with pytest.raises(BadInput, match="mp_rank_01.*damaged"):
        read_megatron_checkpoint(root)
    f0 = root / "iter_0000001" / "mp_rank_00"
    (f0 / "model_optim_rng.pt").rename(tmp_path / "away.pt")
    f0.rmdir()
    with pytest.raises(BadInput, match="missing"):
        read_megatron_checkpoint(root)


# -- issue 37: the preset comes from the tensor names; the suffix picks the format ------------------------------

def test_preset_comes_from_the_names_not_the_suffix(tmp_path, capsys) -> None:
    """Legacy Llama names in a .safetensors file convert with the Llama preset (the suffix once chose mcore dense
    and failed on every name), back to the same Megatron tensors; a dense Megatron checkpoint, whose names fit
    both mcore dense and the legacy Llama, becomes mcore names in a .safetensors file."""
    from mapping import TransformParams
    from models import DEFAULT_PRESET, load_mapping

    sd = tiny_state()
    llama, res = load_mapping(DEFAULT_PRESET).convert(sd, "candidate", TransformParams(num_heads=4, num_query_groups=2))
    assert res.verdict == "pass" and "model.layers.0.attention.wq.weight" in llama
    write_safetensors(llama, tmp_path / "llama.safetensors")
    rc, lines = _cli(capsys, str(tmp_path / "llama.safetensors"), "--to", "megatron", "--out", str(tmp_path / "b.pt"),
                     *HEADS)
    assert rc == 0 and f"(preset {DEFAULT_PRESET})" in lines[-1], lines
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(back[k].numpy(), v, err_msg=k)
    save_pt(sd, tmp_path / "m.pt")
    rc, lines = _cli(capsys, str(tmp_path / "m.pt"), "--to", "mindformers", "--out", str(tmp_path / "m.safetensors"),
                     *HEADS)
    assert rc == 0 and "(preset megatron_core__mindformers_mcore_dense)" in lines[-1], lines
    assert "decoder.layers.0.mlp.linear_fc1.weight" in read_safetensors(tmp_path / "m.safetensors")[0]


def test_names_no_preset_covers_are_refused_naming_some(tmp_path, capsys) -> None:
    """A checkpoint of another model is refused (exit 2, one line naming the file and a few of its names, nothing
    written) instead of converting what a guessed preset happens to cover."""
    other = {f"transformer.h.{i}.attn.c_attn.weight": np.ones((4, 4), np.float32) for i in range(5)}
    save_pt(other, tmp_path / "gpt2.pt")
    _bad(capsys, tmp_path, [str(tmp_path / "gpt2.pt"), "--to", "mindformers", "--out", str(tmp_path / "x.safetensors"),
                            *HEADS], "no preset covers its tensor names")
    rc, lines = _cli(capsys, str(tmp_path / "gpt2.pt"), "--to", "mindformers", "--out", str(tmp_path / "x.ckpt"),
                     *HEADS)
    assert rc == 2 and str(tmp_path / "gpt2.pt") in lines[0] and "'transformer.h.0.attn.c_attn.weight'" in lines[0]
    assert "and 2 more" in lines[0] and "--mapping" in lines[0], lines
    # one name no preset knows beside a whole dense model: named, with the closest preset
    sd = tiny_state()
    sd["decoder.layers.0.mlp.mystery.weight"] = np.ones(3, np.float32)
    save_pt(sd, tmp_path / "odd.pt")
    _bad(capsys, tmp_path, [str(tmp_path / "odd.pt"), "--to", "mindformers", "--out", str(tmp_path / "x.safetensors"),
                            *HEADS], "1 of 16 match no rule of the closest, megatron_core__mindformers_mcore_dense): "
                                     "'decoder.layers.0.mlp.mystery.weight'")
