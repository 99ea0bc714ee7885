"""`align compare-weights`: a checkpoint converted by convert-weights agrees with the original exactly, a
planted fault is named by parameter with the right verdict, and bad input is one line, exit 2, nothing written.

The checkpoints are tiny Megatron-core dense state dicts in the real on-disk formats (torch_dist saved by
torch.distributed.checkpoint with the layers stacked as Megatron stores them, legacy mp_rank_* at TP=2, a torch
.pt) and what `align convert-weights` writes from them (MindFormers mcore safetensors, the legacy Llama's
MindSpore .ckpt). The real megatron-core models are compared in test_mcore_presets.py (MoE, swapped experts)
and test_megatron_layouts.py (dist_checkpointing torch_dist TP=2 vs legacy PP=2).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from align.cli import main  # noqa: E402
from checkpoints.convert import convert_megatron_to_mindformers  # noqa: E402
from checkpoints.mindformers import read_safetensors, write_safetensors  # noqa: E402
from tests.helpers.tiny_checkpoints import HN, NG, NH, save_legacy, save_pt, save_torch_dist, tiny_state  # noqa: E402

DENSE = "megatron_core__mindformers_mcore_dense"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    sd = tiny_state()
    out = {"state": sd, "dist": save_torch_dist(sd, root / "dist"), "legacy": save_legacy(sd, root / "legacy"),
           "pt": save_pt(sd, root / "m.pt")}
    res = convert_megatron_to_mindformers([out["dist"]], root / "mf.safetensors", num_heads=NH, num_query_groups=NG)
    assert res.verdict == "pass"
    out["mf"] = root / "mf.safetensors"
    return out


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["compare-weights", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _rows(out: Path) -> dict[str, dict]:
    import pandas as pd

    return {r["name"]: r for r in pd.read_csv(out / "weights.csv").to_dict("records")}


def test_converted_checkpoint_agrees_exactly_both_ways(ckpts, tmp_path, capsys) -> None:
    out = tmp_path / "o"
    rc, text, err = _run(capsys, ckpts["dist"], ckpts["mf"], "--out", out)
    assert rc == 0, text + err
    assert "15 of 15 parameters compared" in text and "bit-identical" in text and "verdict: pass" in text
    st = _summary(out)["stages"]["weights"]
    assert st["verdict"] == "pass" and st["mapping"] == DENSE and st["max_rel_l2"] == 0.0
    assert (st["baseline_format"], st["candidate_format"]) == ("megatron torch_dist", "safetensors")
    rows = _rows(out)
    assert sorted(rows) == sorted(ckpts["state"])
    assert all(r["rel_l2"] == 0 and r["max_abs_err"] == 0 and r["cosine"] == pytest.approx(1.0) for r in rows.values())
    assert (out / "figures" / "weights.png").read_bytes()[:4] == b"\x89PNG"
    assert "Most drifted parameters" in (out / "report.html").read_text()
    # MindFormers as the baseline, a legacy TP=2 folder as the candidate: named by the safetensors' names
    rc, text, _ = _run(capsys, ckpts["mf"], ckpts["legacy"], "--out", tmp_path / "o2")
    assert rc == 0 and _summary(tmp_path / "o2")["stages"]["weights"]["max_rel_l2"] == 0.0, text


@pytest.mark.parametrize("other", ["legacy", "pt"])
def test_same_framework_pairs_agree(ckpts, other, tmp_path, capsys) -> None:
    rc, text, _ = _run(capsys, ckpts["dist"], ckpts[other], "--out", tmp_path / "o")
    st = _summary(tmp_path / "o")["stages"]["weights"]
    assert rc == 0 and st["compared"] == 15 and st["max_rel_l2"] == 0.0, text
    assert st["baseline_side"] == st["candidate_side"] == "baseline"


def _qkv_rows(kind: str) -> list[int]:
    """Rows of the fused QKV (per query group: NH/NG q heads, then k, then v; HN rows each) of group 0."""
    per = NH // NG
    return {"q": list(range(HN)), "k": list(range(per * HN, (per + 1) * HN))}[kind]


def _perturb(a: dict) -> list[str]:
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    a[name] = a[name] + 3e-2 * np.random.default_rng(1).standard_normal(a[name].shape).astype(np.float32)
    return [name]


def _swap_qk(a: dict) -> list[str]:
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    w = a[name].copy()
    q, k = _qkv_rows("q"), _qkv_rows("k")
    w[q + k] = w[k + q]
    a[name] = w
    return [name]


def _transpose(a: dict) -> list[str]:
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    a[name] = np.ascontiguousarray(a[name].T)
    return [name]


def _missing(a: dict) -> list[str]:
    del a["decoder.final_layernorm.weight"]
    return ["decoder.final_layernorm.weight"]


def _shape(a: dict) -> list[str]:
    a["output_layer.weight"] = a["output_layer.weight"][:-2].copy()
    return ["output_layer.weight"]


def _swap_layers(a: dict) -> list[str]:
    n0, n1 = (f"decoder.layers.{i}.self_attention.linear_proj.weight" for i in (0, 1))
    a[n0], a[n1] = a[n1], a[n0]
    return [n0, n1]


def _fc1_stacked(a: dict) -> list[str]:
    """fc1 written in Megatron's [gate; up] order where MindFormers interleaves gate/up rows."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    w = a[name]
    a[name] = np.concatenate([w[0::2], w[1::2]])
    return [name]


FAULTS = {  # fault -> (plant, what the failing row's problem or diagnosis says)
    "perturbed": (_perturb, "every row differs"),
    "qk_rows_swapped": (_swap_qk, f"rows 0-{HN - 1} hold the baseline's rows {2 * HN}-{3 * HN - 1}"),
    "transposed": (_transpose, "stored transposed ([12, 8] for the baseline's [8, 12]), values equal once transposed"),
    "missing": (_missing, "missing in candidate"),
    "shape": (_shape, "shape [14, 8] where the baseline has [16, 8]"),
    "layers_swapped": (_swap_layers, "holds the baseline's decoder.layers.1.self_attention.linear_proj.weight"),
    "fc1_layout": (_fc1_stacked, "interleaved on one side and stacked on the other"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_fault_is_named_by_parameter(ckpts, fault, tmp_path, capsys) -> None:
    plant, says = FAULTS[fault]
    arrays, _ = read_safetensors(ckpts["mf"])
    named = plant(arrays)
    write_safetensors(arrays, tmp_path / "bad.safetensors")
    rc, text, err = _run(capsys, ckpts["dist"], tmp_path / "bad.safetensors", "--out", tmp_path / "o")
    assert rc == 1, text + err
    rows = _rows(tmp_path / "o")
    failing = sorted(n for n, r in rows.items() if r["verdict"] != "pass")
    assert failing == sorted(named), failing
    first = rows[named[0]]
    assert says in f"{first['problem']}; {first['diagnosis']}", first
    if fault == "perturbed":     # 3e-2 of a unit-variance weight: rel L2 ~3e-2, above float32's 1e-2
        assert 2e-2 < first["rel_l2"] < 4e-2 and first["cosine"] > 0.999
    data = _summary(tmp_path / "o")
    assert data["verdict"] == "fail"
    assert {f["component"] for f in data["findings"] if f["verdict"] == "fail"} == set(named)
    assert f"FAIL {named[0]}" in text and "verdict: fail" in text


def test_warn_band_strict_and_tolerance_option(ckpts, tmp_path, capsys) -> None:
    """A 1e-3 relative drift is inside float32's warn band (exit 0; --strict: 1); --tolerance moves both
    limits, for every dtype or for one."""
    arrays, _ = read_safetensors(ckpts["mf"])
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    arrays[name] = arrays[name] * np.float32(1 + 1e-3)
    write_safetensors(arrays, tmp_path / "drift.safetensors")
    base = [ckpts["dist"], tmp_path / "drift.safetensors"]
    rc, text, _ = _run(capsys, *base, "--out", tmp_path / "w")
    row = _rows(tmp_path / "w")[name]
    assert rc == 0 and row["verdict"] == "warn" and row["rel_l2"] == pytest.approx(1e-3, rel=1e-3), text
    assert f"WARN {name}" in text
    assert _run(capsys, *base, "--out", tmp_path / "s", "--strict")[0] == 1
    assert _run(capsys, *base, "--out", tmp_path / "p", "--tolerance", "2e-3")[0] == 0
    assert _summary(tmp_path / "p")["verdict"] == "pass"
    assert _run(capsys, *base, "--out", tmp_path / "f", "--tolerance", "float32=1e-5,5e-4")[0] == 1
    assert _rows(tmp_path / "f")[name]["warn_tolerance"] == 5e-4
    assert _run(capsys, *base, "--out", tmp_path / "b", "--tolerance", "bfloat16=1e-9")[0] == 0   # not float32


def test_bfloat16_copy_is_judged_as_bfloat16(ckpts, tmp_path, capsys) -> None:
    arrays, _ = read_safetensors(ckpts["mf"])
    write_safetensors(arrays, tmp_path / "bf16.safetensors", dtype="bfloat16")
    rc, text, _ = _run(capsys, ckpts["dist"], tmp_path / "bf16.safetensors", "--out", tmp_path / "o")
    rows = _rows(tmp_path / "o")
    assert rc == 0 and {r["judged_dtype"] for r in rows.values()} == {"bfloat16"}, text
    worst = max(r["rel_l2"] for r in rows.values())
    assert 5e-4 < worst < 4e-3           # bfloat16 rounding (u / sqrt(3) ~ 2.3e-3), not 0, within 1e-2
    assert _run(capsys, ckpts["dist"], tmp_path / "bf16.safetensors", "--out", tmp_path / "w",
                "--tolerance", "1e-4")[0] == 0                 # fails above 100 x PASS = 1e-2: a warn
    assert _summary(tmp_path / "w")["verdict"] == "warn"
    assert _run(capsys, ckpts["dist"], tmp_path / "bf16.safetensors", "--out", tmp_path / "f",
                "--tolerance", "1e-4,1e-3")[0] == 1


def test_unmapped_name_fails_and_is_escaped_in_the_report(ckpts, tmp_path, capsys) -> None:
    arrays, _ = read_safetensors(ckpts["mf"])
    arrays["<b>extra</b>.weight"] = np.ones(3, np.float32)
    write_safetensors(arrays, tmp_path / "x.safetensors")
    rc, text, _ = _run(capsys, ckpts["dist"], tmp_path / "x.safetensors", "--out", tmp_path / "o")
    assert rc == 1 and "unmapped in candidate" in text
    page = (tmp_path / "o" / "report.html").read_text()
    assert "&lt;b&gt;extra&lt;/b&gt;" in page and "<b>extra" not in page


class _Evil:
    """Stands for arbitrary code pickled into a file."""


def _truncated(tmp_path: Path, ckpts: dict) -> Path:
    p = tmp_path / "t.safetensors"
    p.write_bytes(ckpts["mf"].read_bytes()[:-64])
    return p


def _pickled_pt(tmp_path: Path, ckpts: dict) -> Path:
    torch.save({"model": {"w": torch.zeros(2)}, "x": _Evil()}, tmp_path / "evil.pt")
    return tmp_path / "evil.pt"


def _raw_pickle(tmp_path: Path, ckpts: dict) -> Path:
    p = tmp_path / "raw.pt"
    p.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    return p


def _pickle_as_safetensors(tmp_path: Path, ckpts: dict) -> Path:
    p = tmp_path / "p.safetensors"
    p.write_bytes(pickle.dumps({"w": 1}))
    return p


def _missing_dir(tmp_path: Path, ckpts: dict) -> Path:
    return tmp_path / "nowhere"


def _empty_dir(tmp_path: Path, ckpts: dict) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _garbage_ckpt(tmp_path: Path, ckpts: dict) -> Path:
    p = tmp_path / "g.ckpt"
    p.write_bytes(b"\x0a\xff\xff\xff\xff\x0fnot protobuf")
    return p


BAD = {"truncated safetensors": (_truncated, "t.safetensors: tensor"),
       "pickled class in a .pt": (_pickled_pt, "evil.pt: not loadable with weights_only=True"),
       "raw pickle .pt": (_raw_pickle, "raw.pt: not a torch checkpoint"),
       "pickle named .safetensors": (_pickle_as_safetensors, "p.safetensors: not a safetensors file"),
       "missing folder": (_missing_dir, "nowhere: no such file or folder"),
       "empty folder": (_empty_dir, "empty: not a checkpoint folder"),
       "garbage .ckpt": (_garbage_ckpt, "g.ckpt: not a MindSpore checkpoint")}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_nothing_written(ckpts, case, tmp_path, capsys) -> None:
    make, says = BAD[case]
    bad = make(tmp_path, ckpts)
    before = sorted(tmp_path.iterdir())
    for argv in ([ckpts["dist"], bad], [bad, ckpts["mf"]]):
        rc, text, err = _run(capsys, *argv, "--out", tmp_path / "o")
        assert rc == 2 and not text and len(err.strip().splitlines()) == 1 and says in err, (rc, text, err)
        assert sorted(tmp_path.iterdir()) == before      # no output folder, nothing else


def test_checkpoints_no_preset_covers_are_refused_naming_their_names(tmp_path, capsys) -> None:
    """Issue 37: without --mapping the preset comes from the names; two checkpoints of a model no preset knows are
    refused in one line naming some of their names, nothing written."""
    for side in ("a", "b"):
        save_pt({f"transformer.h.{i}.mlp.c_fc.{side}": np.ones((2, 2), np.float32) for i in range(3)},
                tmp_path / f"{side}.pt")
    before = sorted(tmp_path.iterdir())
    rc, text, err = _run(capsys, tmp_path / "a.pt", tmp_path / "b.pt", "--out", tmp_path / "o")
    assert rc == 2 and not text and len(err.strip().splitlines()) == 1, (rc, text, err)
    assert "no preset covers their tensor names" in err and "'transformer.h.0.mlp.c_fc.a'" in err, err
    assert "'transformer.h.0.mlp.c_fc.b'" in err and "--mapping" in err
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("argv,says", [
    (["--tolerance", "abc"], "--tolerance 'abc'"), (["--tolerance", "1e-2,1e-3"], "0 <= PASS <= FAIL"),
    (["--num-heads", "0"], "--num-heads 0"), (["--mapping", "nope"], "nope: neither a mapping file nor a preset")])
def test_command_line_mistakes_are_bad_input(ckpts, argv, says, tmp_path, capsys) -> None:
    rc, text, err = _run(capsys, ckpts["dist"], ckpts["mf"], "--out", tmp_path / "o", *argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "o").exists()


def test_mindspore_ckpt_read_lazily_equals_mindspore(ckpts, tmp_path, capsys) -> None:
    """The legacy Llama's .ckpt (fused QKV split into wq/wk/wv): read without MindSpore, equal to
    mindspore.load_checkpoint (bfloat16, CRC trailer, a parameter split over two records included), and
    compared through the Llama preset (QKV merged back by head, so --num-heads is needed)."""
    ms = pytest.importorskip("mindspore")
    from checkpoints.mindspore_ckpt import MindSporeCkpt

    ckpt = tmp_path / "llama.ckpt"
    assert convert_megatron_to_mindformers([ckpts["pt"]], ckpt, num_heads=NH, num_query_groups=NG).verdict == "pass"
    heads = ["--num-heads", NH, "--num-query-groups", NG]
    rc, text, _ = _run(capsys, ckpts["pt"], ckpt, "--out", tmp_path / "o", *heads)
    st = _summary(tmp_path / "o")["stages"]["weights"]
    assert rc == 0 and st["mapping"] == "megatron_core_llama__mindformers_llama" and st["max_rel_l2"] == 0.0, text
    assert st["compared"] == 15
    rc, _, err = _run(capsys, ckpts["pt"], ckpt, "--out", tmp_path / "o2")
    assert rc == 2 and "--num-heads" in err and not (tmp_path / "o2").exists()

    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    items = [{"name": "a", "data": ms.Parameter(ms.Tensor(w), name="a")},
             {"name": "b", "data": ms.Parameter(ms.Tensor(w).astype(ms.bfloat16), name="b")}]
    ms.save_checkpoint(items, str(tmp_path / "crc.ckpt"), crc_check=True)
    got = MindSporeCkpt(tmp_path / "crc.ckpt")
    ref = ms.load_checkpoint(str(tmp_path / "crc.ckpt"))
    assert got.names() == ["a", "b"] and (got.dtype("a"), got.dtype("b")) == ("float32", "bfloat16")
    for n in ("a", "b"):
        np.testing.assert_array_equal(got.get(n), ref[n].astype(ms.float32).asnumpy())
    # MindSpore writes a parameter above 512 MB as consecutive records of one tag: built here by hand
    from mindspore.train.checkpoint_pb2 import Checkpoint

    blob = b""
    for part in np.array_split(w, 2):
        c = Checkpoint()
        v = c.value.add()
        v.tag, v.tensor.tensor_type, v.tensor.tensor_content = "big", "Float32", part.tobytes()
        v.tensor.dims.extend(w.shape)
        blob += c.SerializeToString()
    (tmp_path / "split.ckpt").write_bytes(blob)
    np.testing.assert_array_equal(MindSporeCkpt(tmp_path / "split.ckpt").get("big"), w)
    np.testing.assert_array_equal(ms.load_checkpoint(str(tmp_path / "split.ckpt"))["big"].asnumpy(), w)
    raw = bytearray((tmp_path / "crc.ckpt").read_bytes())
    raw[40] ^= 1
    (tmp_path / "crc.ckpt").write_bytes(bytes(raw))
    rc, _, err = _run(capsys, tmp_path / "crc.ckpt", ckpt, "--out", tmp_path / "o3")
    assert rc == 2 and "crc.ckpt: CRC check failed" in err


def _drifted(state: dict, rel: float, seed: int) -> dict:
    r = np.random.default_rng(seed)
    return {k: (v + rel * float(np.sqrt(np.mean(v * v))) * r.standard_normal(v.shape)).astype(np.float32)
            for k, v in state.items()}


def _save_legacy_tp2(shards: list[dict], folder: Path) -> Path:
    import argparse

    for r, shard in enumerate(shards):
        d = folder / f"mp_rank_{r:02d}"
        d.mkdir(parents=True)
        torch.save({"model": {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in shard.items()},
                    "args": argparse.Namespace(swiglu=True, tensor_model_parallel_size=2)}, d / "model_optim_rng.pt")
    return folder


def test_repeat_band_judges_weights_after_n_steps(ckpts, tmp_path, capsys) -> None:
    """--repeat: each parameter's tolerance becomes 3 x (fail: 10 x) how far the baseline is from its repeat.
    A candidate 1e-3 away warns by float32's tolerance alone and passes inside a 2e-3 band; 5e-2 away fails."""
    from mapping import TransformParams
    from models import load_mapping

    state = ckpts["state"]
    repeat = save_legacy(_drifted(state, 2e-3, seed=5), tmp_path / "repeat")
    m, heads = load_mapping(DENSE), TransformParams(num_heads=NH, num_query_groups=NG)
    for rel, name in ((1e-3, "near"), (5e-2, "far")):
        conv, _ = m.convert(_drifted(state, rel, seed=6), "candidate", heads)
        write_safetensors(conv, tmp_path / f"{name}.safetensors")
    rc, text, _ = _run(capsys, ckpts["dist"], tmp_path / "near.safetensors", "--out", tmp_path / "alone")
    assert rc == 0 and _summary(tmp_path / "alone")["verdict"] == "warn" and "--repeat" in text
    rc, text, _ = _run(capsys, ckpts["dist"], tmp_path / "near.safetensors", "--repeat", repeat,
                       "--out", tmp_path / "b")
    rows = _rows(tmp_path / "b")
    assert rc == 0 and _summary(tmp_path / "b")["verdict"] == "pass", text
    for r in rows.values():
        assert r["band"] == pytest.approx(2e-3, rel=0.5) and r["tolerance"] == pytest.approx(3 * r["band"])
    assert [x["role"] for x in _summary(tmp_path / "b")["runs"]] == ["baseline", "candidate", "repeat"]
    rc, text, _ = _run(capsys, ckpts["dist"], tmp_path / "far.safetensors", "--repeat", repeat, "--out", tmp_path / "f")
    assert rc == 1 and all(r["verdict"] == "fail" for r in _rows(tmp_path / "f").values()), text
    assert "x the baseline's band" in text


def test_tp_copies_of_a_replicated_parameter_must_agree(ckpts, tmp_path, capsys) -> None:
    """A norm weight is replicated on every TP rank; a copy that drifted (its gradient not all-reduced over TP,
    as qk_layernorm without Megatron's finalize_model_grads) fails, named, even where rank 0 equals the other
    checkpoint."""
    from tests.helpers.tiny_checkpoints import tp_shards

    shards = tp_shards(ckpts["state"], 2)
    name = "decoder.layers.1.input_layernorm.weight"
    shards[1][name] = shards[1][name] * np.float32(1.02)
    legacy = _save_legacy_tp2(shards, tmp_path / "legacy")
    rc, text, _ = _run(capsys, ckpts["dist"], legacy, "--out", tmp_path / "o")
    data = _summary(tmp_path / "o")
    bad = [f for f in data["findings"] if f["verdict"] != "pass"]
    assert rc == 1 and [f["component"] for f in bad] == [name], bad
    assert bad[0]["metric"] == "tp_replica_rel_l2" and bad[0]["value"] == pytest.approx(0.02, rel=1e-3)
    assert "copies on the TP ranks" in text
    assert all(r["verdict"] == "pass" for r in _rows(tmp_path / "o").values())   # rank 0's copy is right


def test_corrupted_checkpoints_compare_right_or_refused(ckpts, tmp_path) -> None:
    """Fuzz (seeded, 45 cases): each reader's file truncated, bit-flipped or replaced by garbage, compared with
    its clean counterpart. Every case reads right (exit 0, everything bit-identical), or is refused (exit 2,
    one line naming the file, nothing written); where the format has no checksum (safetensors, a .ckpt saved
    without crc_check) a flipped bit is a changed value, reported as such (its rel L2 > 0, a fail naming the
    parameter beyond the tolerance). Never a traceback; damage under torch's CRCs is never read as values."""
    import contextlib
    import io
    import random
    import shutil
    from collections import Counter

    ms = pytest.importorskip("mindspore")
    rng = random.Random(27)
    ckpt = tmp_path / "clean.ckpt"
    ms.save_checkpoint([{"name": k, "data": ms.Parameter(ms.Tensor(v), name=k)} for k, v in ckpts["state"].items()],
                       str(ckpt))
    sources = {"safetensors": ckpts["mf"], "ckpt": ckpt, "pt": ckpts["pt"],
               "dist shard": next((ckpts["dist"] / "iter_0000001").glob("*.distcp")),
               "legacy rank": ckpts["legacy"] / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"}
    # the clean counterpart each is compared with (same names, same layout)
    other = {"safetensors": ckpts["dist"], "ckpt": ckpts["pt"], "pt": ckpts["dist"], "dist shard": ckpts["pt"],
             "legacy rank": ckpts["pt"]}
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    for k in range(45):
        what = list(sources)[k % len(sources)]
        case = tmp_path / f"case{k}"
        src = sources[what]
        if what in ("dist shard", "legacy rank"):      # the whole folder, one file damaged
            top = ckpts["dist"] if what == "dist shard" else ckpts["legacy"]
            shutil.copytree(top, case / "ck")
            target, victim = case / "ck", case / "ck" / src.relative_to(top)
        else:
            case.mkdir()
            target = victim = case / src.name
            shutil.copy(src, victim)
        blob = bytearray(victim.read_bytes())
        how = rng.choice(["truncate", "flip", "garbage"])
        if how == "truncate":
            blob = blob[:rng.randrange(len(blob))]
        elif how == "flip":
            for _ in range(rng.randint(1, 4)):
                blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        else:
            blob = bytearray(rng.randbytes(rng.randint(1, 512)))
        victim.write_bytes(bytes(blob))
        out = case / "out"
        so, se = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            rc = main(["compare-weights", str(other[what]), str(target), "--out", str(out)] +
                      (["--num-heads", str(NH), "--num-query-groups", str(NG)] if what == "ckpt" else []))
        label = f"{what} {how}: exit {rc}"
        outcomes[label] += 1
        if rc == 2:
            err = se.getvalue().strip().splitlines()
            if len(err) != 1 or out.exists() or victim.name not in err[0] and target.name not in err[0]:
                problems.append(f"{label}: {err} (out written: {out.exists()})")
        elif rc in (0, 1):
            data = _summary(out)
            st = data["stages"]["weights"]
            checksum = what not in ("safetensors", "ckpt")     # torch archives: a CRC-32 per record
            if checksum and (rc != 0 or st["max_rel_l2"] != 0.0):
                problems.append(f"{label}: damage under a checksum read as values (max rel {st['max_rel_l2']})")
            if rc == 1 and not any(f["component"] for f in data["findings"] if f["verdict"] == "fail"):
                problems.append(f"{label}: a fail naming no parameter")
            if rc == 0 and st["max_rel_l2"]:
                outcomes[f"{what} {how}: values changed within tolerance (no checksum)"] += 1
        else:
            problems.append(f"{label}: {se.getvalue()[-300:]}")
    print(f"\ncompare-weights fuzz: {dict(sorted(outcomes.items()))}")
    assert not problems, problems
    assert sum(v for k, v in outcomes.items() if k.endswith("exit 2")) > 25     # most damage is refused


def test_lazy_reading_loads_each_torch_dist_key_once(ckpts, tmp_path, monkeypatch, capsys) -> None:
    """torch_dist is read one stored key (one parameter of every layer) at a time, each key once, whichever
    side it is on; a folder of safetensors files (MindFormers' unified safetensors) reads as one checkpoint,
    and a tensor held by two of its files is bad input."""
    from checkpoints import megatron

    loads: list[list[str]] = []
    real = megatron.load_torch_dist_keys
    monkeypatch.setattr(megatron, "load_torch_dist_keys", lambda *a: loads.append(list(a[3])) or real(*a))
    arrays, _ = read_safetensors(ckpts["mf"])
    names = sorted(arrays)
    (tmp_path / "unified").mkdir()
    write_safetensors({n: arrays[n] for n in names[:7]}, tmp_path / "unified" / "part-1.safetensors")
    write_safetensors({n: arrays[n] for n in names[7:]}, tmp_path / "unified" / "part-2.safetensors")
    for a, b in ((tmp_path / "unified", ckpts["dist"]), (ckpts["dist"], tmp_path / "unified")):
        loads.clear()
        rc, text, _ = _run(capsys, a, b, "--out", tmp_path / f"o{len(str(a))}")
        assert rc == 0 and "bit-identical" in text, text
        keys = [k for batch in loads for k in batch]
        assert len(keys) == len(set(keys)) == 9 and all(len(batch) == 1 for batch in loads), loads
    write_safetensors({names[0]: arrays[names[0]]}, tmp_path / "unified" / "part-3.safetensors")
    rc, _, err = _run(capsys, ckpts["dist"], tmp_path / "unified", "--out", tmp_path / "dup")
    assert rc == 2 and f"tensor '{names[0]}' is also in part-1.safetensors" in err
