"""Mapping engine: names both ways, fused layouts, unmapped names reported, CLI show/check."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

import mapping as mp
from align.cli import mapping as mapping_verb
from core.errors import BadInput
from mapping import Mapping, TransformParams
from models import load_mapping

L = 2


def megatron_names(te: bool = False, ddp: bool = False) -> list[str]:
    names = ["embedding.word_embeddings.weight"]
    for i in range(L):
        p = f"decoder.layers.{i}."
        if te:
            names += [p + "self_attention.linear_qkv.layer_norm_weight",
                      p + "mlp.linear_fc1.layer_norm_weight"]
        else:
            names += [p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"]
        names += [p + "self_attention.linear_qkv.weight", p + "self_attention.linear_proj.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return ["module." + n for n in names] if ddp else names


def mindformers_names() -> list[str]:
    names = ["model.tok_embeddings.embedding_weight"]
    for i in range(L):
        p = f"model.layers.{i}."
        names += [p + "attention_norm.weight", p + "ffn_norm.weight"]
        names += [p + f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")]
        names += [p + f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
    return names + ["model.norm_out.weight", "lm_head.weight"]


@pytest.fixture(scope="module")
def m() -> Mapping:
    return load_mapping("megatron_core_llama__mindformers_llama")


@pytest.mark.parametrize("te", [False, True])
@pytest.mark.parametrize("ddp", [False, True])
def test_every_name_paired_both_schemes_and_prefixes(m: Mapping, te: bool, ddp: bool) -> None:
    res = m.check(megatron_names(te, ddp), mindformers_names())
    assert res.verdict == "pass", [f.message for f in res.findings]
    assert res.details["pairs"] == 1 + 6 * L + 2


def test_names_both_directions(m: Mapping) -> None:
    assert m.map_name("module.decoder.layers.7.self_attention.linear_qkv.weight") == [
        f"model.layers.7.attention.{w}.weight" for w in ("wq", "wk", "wv")]
    assert m.map_name("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == [
        "model.layers.1.ffn_norm.weight"]
    assert m.map_name("model.layers.3.feed_forward.w3.weight", "candidate") == [
        "decoder.layers.3.mlp.linear_fc1.weight"]
    assert m.map_name("model.layers.3.attention_norm.weight", "candidate") == [
        "decoder.layers.3.input_layernorm.weight"]
    assert m.map_module("module.decoder.layers.4.self_attention.linear_proj") == "model.layers.4.attention.wo"
    assert m.map_module("model.layers.4.feed_forward", "candidate") == "decoder.layers.4.mlp"
    assert m.map_name("decoder.layers.0.self_attention.unknown.weight") == []


def test_unmapped_names_reported_on_both_sides(m: Mapping) -> None:
    b = megatron_names() + ["decoder.layers.0.self_attention.q_layernorm.weight",
                            "decoder.layers.0.self_attention.linear_qkv._extra_state"]
    c = [n for n in mindformers_names() if n != "model.layers.1.attention.wv.weight"] + ["model.extra.bias"]
    res = m.check(b, c)
    assert res.verdict == "fail"
    by_metric = {(f.metric, f.component) for f in res.findings}
    assert ("unmapped", "decoder.layers.0.self_attention.q_layernorm.weight") in by_metric
    assert ("unmapped", "model.extra.bias") in by_metric
    assert ("missing_counterpart", "decoder.layers.1.self_attention.linear_qkv.weight") in by_metric
    # _extra_state is a buffer: listed as ignored, not a failure, not dropped
    assert res.details["ignored_baseline"] == ["decoder.layers.0.self_attention.linear_qkv._extra_state"]
    assert len(res.findings) == 3


@pytest.mark.parametrize("nh,ng", [(8, 8), (8, 2), (4, 1)])
def test_split_qkv_matches_mindformers_reference(nh: int, ng: int) -> None:
    """MindFormers' own converter (qkv_concat_hf2mg) builds Megatron's interleaved QKV from [q; k; v]:
    our split must undo it exactly, for MHA and GQA."""
    convert_utils = pytest.importorskip("mindformers.utils.convert_utils")
    hn, hidden = 4, nh * 4
    rng = np.random.default_rng(0)
    q = rng.standard_normal((nh * hn, hidden)).astype(np.float32)
    k = rng.standard_normal((ng * hn, hidden)).astype(np.float32)
    v = rng.standard_normal((ng * hn, hidden)).astype(np.float32)
    fused = convert_utils.qkv_concat_hf2mg(np.concatenate([q, k, v]), nh, ng, hidden)
    p = TransformParams(num_heads=nh, num_query_groups=ng)
    sq, sk, sv = mp.split_qkv(fused, p)
    assert np.array_equal(sq, q) and np.array_equal(sk, k) and np.array_equal(sv, v)
    assert np.array_equal(mp.merge_qkv([sq, sk, sv], p), fused)


def test_split_qkv_layout_by_hand() -> None:
    """Group g holds [q heads of g | k_g | v_g]; rows labelled so a mistake shows which row went where."""
    nh, ng, hn = 4, 2, 1
    fused = np.array([0, 1, 10, 20, 2, 3, 11, 21], dtype=np.float32)[:, None]   # q0 q1 k0 v0 q2 q3 k1 v1
    q, k, v = mp.split_qkv(fused, TransformParams(nh, ng, hn))
    assert q.ravel().tolist() == [0, 1, 2, 3]
    assert k.ravel().tolist() == [10, 11] and v.ravel().tolist() == [20, 21]


def test_chunk_fc1_per_tp_shard(m: Mapping) -> None:
    ffn, h = 8, 3
    gate, up = np.arange(ffn * h).reshape(ffn, h), 100 + np.arange(ffn * h).reshape(ffn, h)
    rule = next(r for r in m.rules if r.id == "linear_fc1")
    # TP=1: [gate; up]
    g1, u1 = rule.apply([np.concatenate([gate, up])], "candidate", TransformParams())
    assert np.array_equal(g1, gate) and np.array_equal(u1, up)
    # TP=2 shards concatenated: [gate_0; up_0; gate_1; up_1]
    tp2 = np.concatenate([gate[:4], up[:4], gate[4:], up[4:]])
    g2, u2 = rule.apply([tp2], "candidate", TransformParams(tp=2))
    assert np.array_equal(g2, gate) and np.array_equal(u2, up)
    assert np.array_equal(rule.apply([g2, u2], "baseline", TransformParams(tp=2))[0], tp2)


def test_convert_round_trip_and_unmapped(m: Mapping) -> None:
    rng = np.random.default_rng(1)
    nh, ng, hn, hidden, ffn = 4, 2, 8, 32, 48
    shapes = {"embedding.word_embeddings.weight": (50, hidden), "decoder.final_layernorm.weight": (hidden,),
              "output_layer.weight": (50, hidden)}
    for i in range(L):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "pre_mlp_layernorm.weight": (hidden,),
                       p + "self_attention.linear_qkv.weight": ((nh + 2 * ng) * hn, hidden),
                       p + "self_attention.linear_proj.weight": (hidden, nh * hn),
                       p + "mlp.linear_fc1.weight": (2 * ffn, hidden),
                       p + "mlp.linear_fc2.weight": (hidden, ffn)})
    sd = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params = TransformParams(num_heads=nh, num_query_groups=ng)
    ms_sd, res = m.convert(sd, "candidate", params)
    assert res.verdict == "pass" and sorted(ms_sd) == sorted(mindformers_names())
    back, res2 = m.convert(ms_sd, "baseline", params)
    assert res2.verdict == "pass" and sorted(back) == sorted(sd)
    assert all(np.array_equal(back[k], sd[k]) for k in sd)
    sd["decoder.layers.0.self_attention.q_layernorm.weight"] = np.ones(hn, np.float32)
    _, res3 = m.convert(sd, "candidate", params)
    assert res3.verdict == "fail"
    assert [f.component for f in res3.findings] == ["decoder.layers.0.self_attention.q_layernorm.weight"]


def test_custom_yaml_mapping_with_regex_and_transpose(tmp_path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("name: t\nrules:\n"
                 "  - {id: a, kind: mlp, baseline: ['re:blocks\\.(?P<layer>\\d+)\\.w'],"
                 " candidate: ['h.{layer}.w'],"
                 " transform: {op: transpose}}\n")
    m2 = Mapping.load(f)
    x = np.arange(6.0).reshape(2, 3)
    out, res = m2.convert({"blocks.3.w": x}, "candidate")
    assert res.verdict == "pass" and np.array_equal(out["h.3.w"], x.T)
    with pytest.raises(BadInput):
        Mapping.load(tmp_path / "nope.yaml")


def test_cli_show_and_check(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    mapping_verb.add_arguments(parser)
    assert mapping_verb.run(parser.parse_args(["show", "megatron_core_llama__mindformers_llama"])) == 0
    out = capsys.readouterr().out
    assert "linear_qkv" in out and "split_qkv" in out and "model.layers.{layer}.attention.wq.weight" in out
    (tmp_path / "b.txt").write_text("\n".join(megatron_names(ddp=True)))
    (tmp_path / "c.json").write_text(json.dumps(mindformers_names()[:-1]))
    rc = mapping_verb.run(parser.parse_args(["check", "--baseline", str(tmp_path / "b.txt"),
                                   "--candidate", str(tmp_path / "c.json"), "--json"]))
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["verdict"] == "fail"
    assert [f["component"] for f in report["findings"]] == ["output_layer.weight"]


def _experts(layer: int, scheme: str = "local", experts: range = range(4)) -> list[str]:
    p = f"decoder.layers.{layer}.mlp.experts."
    if scheme == "grouped":
        return [p + f"linear_fc{k}.weight{e}" for e in experts for k in (1, 2)]
    return [p + f"local_experts.{e}.linear_fc{k}.weight" for e in experts for k in (1, 2)]


@pytest.mark.parametrize("scheme", ["local", "grouped"])
def test_stacked_expert_pieces_pair_expert_by_expert(scheme: str) -> None:
    """A candidate that recorded its stacked experts per expert (``weight1[e]``) pairs one to one with the
    baseline's expert e, in either orientation; a stacked tensor alone stays one group, named as the group."""
    m = load_mapping("megatron_core__mindformers_mcore_moe")
    b = _experts(1, scheme)
    pieces = [f"decoder.layers.1.mlp.experts.weight{k}[{e}]" for e in range(4) for k in (1, 2)]
    pairs, unmapped, _ = m.pair(b, pieces)
    assert not unmapped["baseline"] and not unmapped["candidate"]
    got = sorted((gp.baseline_present[0], gp.candidate_present[0]) for gp in pairs)
    assert got == sorted(zip(b, pieces, strict=True)) and all(gp.complete and gp.label == gp.name for gp in pairs)
    if scheme == "local":   # a MindFormers baseline: the same pairs, swapped (swapped() keeps the default scheme)
        back, _, _ = m.oriented(pieces, b).pair(pieces, b)
        assert sorted((gp.candidate_present[0], gp.baseline_present[0]) for gp in back) == got
    same, _, _ = m.oriented(pieces, pieces).pair(pieces, pieces)
    assert sorted(gp.name for gp in same) == sorted(pieces) and all(gp.complete for gp in same)
    whole, _, _ = m.pair(b, ["decoder.layers.1.mlp.experts.weight1", "decoder.layers.1.mlp.experts.weight2"])
    star = "local_experts.*.linear_fc1.weight" if scheme == "local" else "linear_fc1.weight*"
    assert sorted(gp.label for gp in whole)[0] == f"decoder.layers.1.mlp.experts.{star} (experts 0-3)"
    assert mp.rules.expert_span([0, 2]) == "0, 2" and mp.rules.split_piece("a.weight1[12]") == ("a.weight1", 12)


def test_local_norms_name_the_perturbed_expert_by_global_index() -> None:
    """Numpy units: baseline experts against the candidate's pieces, expert 3 off by 2 %: the finding names
    expert 3 on both sides (tests/test_megatron_layouts.py: the same on an EP=2 store). Against a
    stacked norm only (MindFormers' own local_norm output) the group compares as a whole, named as the group."""
    from comparators.local_norms import ShardNorm, compare_norm_entries

    m = load_mapping("megatron_core__mindformers_mcore_moe")
    rng = np.random.default_rng(0)
    base = {n: float(v) for n, v in zip(_experts(0), rng.uniform(0.5, 2.0, 8), strict=True)}

    def entries(norms: dict[str, float], numel: int = 64) -> dict[str, ShardNorm]:
        return {k: ShardNorm(-1, 1, {0: v}, {0: numel}, {0}) for k, v in norms.items()}

    piece = {f"decoder.layers.0.mlp.experts.weight{n.split('linear_fc')[1][0]}[{n.split('.')[6]}]": v
             for n, v in base.items()}
    bad = dict(piece)
    bad["decoder.layers.0.mlp.experts.weight1[3]"] *= 1.02
    res = compare_norm_entries(entries(base), entries(bad), m)
    failing = [f for f in res.findings if f.verdict == "fail"]
    assert [f.component for f in failing] == ["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert "weight1[3]" in failing[0].message and res.details["compared"] == 8
    stacked = {f"decoder.layers.0.mlp.experts.weight{k}": math.sqrt(sum(
        v * v for n, v in base.items() if f"linear_fc{k}" in n)) for k in (1, 2)}
    stacked["decoder.layers.0.mlp.experts.weight1"] *= 1.02
    res = compare_norm_entries(entries(base), entries(stacked, 256), m)
    assert [f.component for f in res.findings if f.verdict == "fail"] == [
        "decoder.layers.0.mlp.experts.local_experts.*.linear_fc1.weight (experts 0-3)"]
    assert res.details["compared"] == 2 and all(r["numel_baseline"] == 256 for r in res.details["parameters"])


def test_experts_named_locally_on_an_ep_rank_get_their_global_index() -> None:
    from comparators.local_norms import global_expert_names

    local = _experts(0, experts=range(2)) + _experts(0, "grouped", range(2)) + ["decoder.layers.0.mlp.router.weight"]
    assert global_expert_names(local, 1) == (_experts(0, experts=range(2, 4)) + _experts(0, "grouped", range(2, 4))
                                             + ["decoder.layers.0.mlp.router.weight"])
    glob = _experts(0, experts=range(2, 4))          # MegatronDumper's names: global already, kept
    assert global_expert_names(glob, 1) == glob and global_expert_names(local, 0) == local


def test_stacked_experts_whole_beside_their_pieces_is_covered_by_them() -> None:
    """A candidate store holding a layer's stacked experts both in per-expert pieces (``weight2[e]``) and whole
    (the moe nan_param fault's NaN'd tensor: found by a seeded fault sweep, where norm_trajectories crashed on a
    group with no baseline name): the pieces pair one by one, the whole is ignored as covered, nothing crashes."""
    from comparators.local_norms import pair_norms
    from models import load_mapping

    m = load_mapping("megatron_core__mindformers_mcore_moe")
    base = [f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(4)]
    cand = [f"decoder.layers.1.mlp.experts.weight2[{e}]" for e in range(4)] + ["decoder.layers.1.mlp.experts.weight2"]
    _, unmapped, ignored = m.oriented(base, cand).pair(base, cand)
    assert ignored["candidate"] == ["decoder.layers.1.mlp.experts.weight2"] and not unmapped["candidate"]
    pairing = pair_norms(base, cand, m)
    assert [(p.name, p.candidate) for p in pairing.pairs] == [(b, [c]) for b, c in zip(base, cand[:4], strict=True)]
    assert not pairing.incomplete
