"""Every Megatron-core <-> MindFormers mcore preset maps every parameter of its real models both ways.

Real state dicts on both sides: megatron-core GPTModels (dense with q/k layernorm, MoE with sequential
experts and a shared expert, MLA + MoE) built on CPU, and MindFormers 2.1.0's TrainingQwen3ForCausalLM,
TrainingQwen3MoeForCausalLM and TrainingDeepseekV3ForCausalLM built (not run) from the same TinyModel.
Checked: nothing unmapped, every group complete, converted shapes equal the other model's, the round trip
is bit-identical, and local norms of grouped parameters (stacked experts) compare through the mapping.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from comparators.local_norms import ShardNorm, compare_norm_entries  # noqa: E402
from demo import megatron_cpu as mg  # noqa: E402
from demo import mindformers_mcore_cpu as mc  # noqa: E402
from mapping import TransformParams  # noqa: E402
from models import load_mapping  # noqa: E402

_MLA = mc.TinyModel(kind="mla", shared_expert_size=16, first_k_dense=0)
SPECS = {"dense": mc.TinyModel(kind="dense"),
         "moe": mc.TinyModel(kind="moe"),
         "mla": _MLA,
         # DeepSeek-V3 as shipped (pretrain_deepseek3_671b.yaml): one MTP layer (num_nextn_predict_layers: 1)
         "mla_mtp": _MLA,
         # MindFormers' dataclass default mla_qkv_concat True: fused linear_qkv / linear_qb / linear_kvb (+ MTP)
         "mla_qkv_concat": _MLA}
PRESET = {k: f"megatron_core__mindformers_mcore_{k}" for k in SPECS}
PRESET["mla_mtp"] = PRESET["mla"]
# Per case: MindFormers config overrides, Megatron TransformerConfig extras
MF_OVERRIDES = {"mla_mtp": {"num_nextn_predict_layers": 1},
                "mla_qkv_concat": {"mla_qkv_concat": True, "num_nextn_predict_layers": 1}}
MEG_EXTRA = {"mla_mtp": {"mtp_num_layers": 1}, "mla_qkv_concat": {"mtp_num_layers": 1}}


def _params(spec: mc.TinyModel) -> TransformParams:
    ng = spec.num_attention_heads if spec.kind == "mla" else spec.num_query_groups
    # the fused MLA down projection (mla_qkv_concat) splits back into q (q_lora_rank rows) and kv
    # (kv_lora_rank + rope head dim rows)
    sizes = {"q_down": spec.q_lora_rank, "kv_down": spec.kv_lora_rank + spec.qk_pos_emb_head_dim}
    return TransformParams(num_heads=spec.num_attention_heads, num_query_groups=ng, num_experts=spec.num_experts,
                           sizes=sizes if spec.kind == "mla" else {})


def megatron_kwargs(case: str) -> dict:
    kw = mc.megatron_config_kwargs(SPECS[case])
    kw["extra"].update(MEG_EXTRA.get(case, {}))
    return kw


@pytest.fixture(scope="module")
def megatron_states() -> dict[str, dict[str, np.ndarray]]:
    mg.init_megatron_cpu(tp=1)
    out = {}
    for case in SPECS:
        model = mg.build_tiny_llama(mg.TinyLlamaConfig(**megatron_kwargs(case)), seed=3)
        out[case] = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                     if isinstance(v, torch.Tensor)}
    return out


@pytest.fixture(scope="module")
def mindformers_states() -> dict[str, dict[str, np.ndarray]]:
    mc.set_mcore_context("pynative", seed=0)
    try:
        return {case: mc.parameter_arrays(mc.build_mcore_model(spec, "pynative", standins=False,
                                                               **MF_OVERRIDES.get(case, {})))
                for case, spec in SPECS.items()}
    finally:
        mc.reset_mindformers_context()


@pytest.mark.parametrize("kind", list(SPECS))
def test_preset_maps_every_parameter_both_ways(kind, megatron_states, mindformers_states) -> None:
    if kind in ("mla_mtp", "mla_qkv_concat"):   # the MTP layer is really there on both sides
        assert sum(k.startswith("mtp.layers.0.") for k in megatron_states[kind]) > 20
        assert sum(k.startswith("mtp.layers.0.") for k in mindformers_states[kind]) > 15
    if kind == "mla_qkv_concat":   # MindFormers really built the fused attention
        attn = [k for k in mindformers_states[kind] if ".self_attention." in k]
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in attn
        assert "mtp.layers.0.transformer_layer.self_attention.linear_kvb.weight" in attn
        assert not [k for k in attn if "down_proj" in k or "up_proj" in k]
    m = load_mapping(PRESET[kind])
    meg, mf = megatron_states[kind], mindformers_states[kind]
    check = m.check(meg, mf)
    assert check.verdict == "pass", [f.message for f in check.findings][:5]
    assert not check.details["unmapped_baseline"] and not check.details["unmapped_candidate"]

    params = _params(SPECS[kind])
    weights = {k: v for k, v in meg.items() if not m.ignored(k, "baseline")}
    to_mf, res = m.convert(weights, "candidate", params)
    assert res.verdict == "pass", [f.message for f in res.findings][:5]
    mf_weights = {k: v for k, v in mf.items() if not m.ignored(k, "candidate")}
    assert sorted(to_mf) == sorted(mf_weights)
    for name, arr in to_mf.items():
        assert arr.shape == mf_weights[name].shape, name

    back, res = m.convert(to_mf, "baseline", params)                 # round trip: bit-identical
    assert res.verdict == "pass" and sorted(back) == sorted(weights)
    for name, arr in back.items():
        assert arr.dtype == weights[name].dtype and np.array_equal(arr, weights[name]), name

    from_mf, res = m.convert(mf_weights, "baseline", params)        # MindFormers' own tensors -> Megatron
    assert res.verdict == "pass"
    for name, arr in from_mf.items():
        assert arr.shape == weights[name].shape, name


def test_stacked_experts_layout_matches_mindformers_ffn(megatron_states) -> None:
    """weight1 reshaped [E, H, 2F] as MindFormers' FFN does gives expert e's fc1 transposed ([gate; up])."""
    spec = SPECS["moe"]
    meg = megatron_states["moe"]
    to_mf, _ = load_mapping(PRESET["moe"]).convert(
        {k: v for k, v in meg.items() if "layers.0.mlp.experts" in k}, "candidate", _params(spec))
    w1 = to_mf["decoder.layers.0.mlp.experts.weight1"].reshape(spec.num_experts, spec.hidden_size, -1)
    w2 = to_mf["decoder.layers.0.mlp.experts.weight2"].reshape(spec.num_experts, spec.moe_ffn_hidden_size, -1)
    for e in range(spec.num_experts):
        p = f"decoder.layers.0.mlp.experts.local_experts.{e}"
        np.testing.assert_array_equal(w1[e], meg[f"{p}.linear_fc1.weight"].T)
        np.testing.assert_array_equal(w2[e], meg[f"{p}.linear_fc2.weight"].T)


def test_fc1_interleave_matches_mindformers_own_converter(megatron_states) -> None:
    """MindFormers' concat_ffn_weight_megatron (its HF loader) builds the interleaved fc1 the preset writes."""
    from mindformers.parallel_core.utils.model_mixin import TrainModelMixin

    meg = megatron_states["dense"]
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    f = fc1.shape[0] // 2
    ms_dict = {"l.gating.weight": fc1[:f].copy(), "l.hidden.weight": fc1[f:].copy()}
    TrainModelMixin.concat_ffn_weight_megatron(None, ["l.gating.weight"], [], {}, None, ms_dict, f)
    to_mf, _ = load_mapping(PRESET["dense"]).convert({"decoder.layers.0.mlp.linear_fc1.weight": fc1}, "candidate",
                                                     _params(SPECS["dense"]))
    np.testing.assert_array_equal(to_mf["decoder.layers.0.mlp.linear_fc1.weight"], ms_dict["l.linear_fc1.weight"])


def test_mtp_rules_cover_mindformers_mtp_names() -> None:
    """DeepSeek-V3's MTP parameters (built by MindFormers with one MTP layer) all match a rule of the preset
    and map to Megatron's names (mtp.layers.{k}.{enorm, hnorm, eh_proj, transformer_layer.*, final_layernorm})."""
    mc.set_mcore_context("pynative", seed=0)
    try:
        net = mc.build_mcore_model(SPECS["mla"], "pynative", standins=False, num_nextn_predict_layers=1)
    finally:
        mc.reset_mindformers_context()
    m = load_mapping(PRESET["mla"])
    mtp = [p.name for p in net.get_parameters() if p.name.startswith("mtp.")]
    assert len(mtp) > 10
    for name in mtp:
        assert m.match(name, "candidate") is not None or m.ignored(name, "candidate"), name
    assert m.map_name("mtp.layers.0.transformer_layer.mlp.experts.local_experts.2.linear_fc1.weight") == [
        "mtp.layers.0.transformer_layer.mlp.experts.weight1"]


def test_local_norms_of_stacked_experts_compare_through_the_mapping(megatron_states) -> None:
    """Per-expert Megatron norms vs MindFormers' one stacked norm: equal sums of squares pass, one expert off
    by 20 % fails naming the layer's expert group; against the stacked tensors split per expert (what the
    candidate's dumper records) it fails naming that expert."""
    m = load_mapping(PRESET["moe"])
    meg = {k: v for k, v in megatron_states["moe"].items() if not m.ignored(k, "baseline")}
    mf, _ = m.convert(meg, "candidate", _params(SPECS["moe"]))

    def entries(arrays):
        return {k: ShardNorm(-1, 1, {0: float(np.linalg.norm(v))}, {0: v.size}, {0}) for k, v in arrays.items()}

    res = compare_norm_entries(entries(meg), entries(mf), m)
    assert res.verdict == "pass", [f.message for f in res.findings][:3]
    bad = dict(meg)
    e2 = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    bad[e2] = bad[e2] * 1.2
    res = compare_norm_entries(entries(bad), entries(mf), m)
    failing = [f for f in res.findings if f.metric == "local_norm_rel_diff"]
    assert [f.component for f in failing] == ["decoder.layers.1.mlp.experts.local_experts.*.linear_fc2.weight "
                                              "(experts 0-3)"]   # the group, never expert 0's name
    assert "experts.weight2" in failing[0].message and math.isfinite(failing[0].value)
    # the candidate's dumper splits a stacked tensor by rows (expert e: rows [e*R, (e+1)*R), NAME[e]): on the
    # real stacked layout each piece is the baseline's expert e, and the perturbed expert is named alone
    pieces = {}
    for name, arr in mf.items():
        if name.endswith((".experts.weight1", ".experts.weight2")):
            pieces.update({f"{name}[{e}]": part for e, part in enumerate(np.split(arr, 4, axis=0))})
        else:
            pieces[name] = arr
    res = compare_norm_entries(entries(meg), entries(pieces), m)
    assert res.verdict == "pass" and res.details["compared"] == len(pieces)
    res = compare_norm_entries(entries(bad), entries(pieces), m)
    failing = [f for f in res.findings if f.metric == "local_norm_rel_diff"]
    assert [f.component for f in failing] == [e2] and "experts.weight2[2]" in failing[0].message


def _cli(*argv: str) -> int:
    import argparse

    from align.cli import convert_weights as convert_verb

    p = argparse.ArgumentParser()
    convert_verb.add_arguments(p)
    return convert_verb.run(p.parse_args(list(argv)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_weights_round_trip_through_safetensors(dtype, megatron_states, tmp_path) -> None:
    """Megatron MoE state_dict -> MindFormers safetensors (stacked experts) -> Megatron: bit-identical,
    bfloat16 included (stored as BF16, read back exactly)."""
    from checkpoints.mindformers import read_safetensors

    spec = SPECS["moe"]
    sd = {k: torch.from_numpy(v) for k, v in megatron_states["moe"].items()}
    if dtype == "bfloat16":
        sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    torch.save(sd, tmp_path / "moe.pt")
    args = ["--mapping", PRESET["moe"], "--num-heads", str(spec.num_attention_heads),
            "--num-query-groups", str(spec.num_query_groups), "--num-experts", str(spec.num_experts)]
    out = tmp_path / "moe.safetensors"
    assert _cli(str(tmp_path / "moe.pt"), "--to", "mindformers", "--out", str(out), *args) == 0
    arrays, dtypes = read_safetensors(out)
    assert arrays["decoder.layers.1.mlp.experts.weight1"].shape == (spec.num_experts * spec.hidden_size,
                                                                      2 * spec.moe_ffn_hidden_size)
    assert set(dtypes.values()) == {dtype}
    assert _cli(str(out), "--to", "megatron", "--out", str(tmp_path / "back.pt"), *args) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back) == sorted(sd)
    for k, v in back.items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k


def test_truncated_safetensors_is_bad_input(megatron_states, tmp_path) -> None:
    from core.errors import BadInput

    spec = SPECS["dense"]
    torch.save({k: torch.from_numpy(v) for k, v in megatron_states["dense"].items()}, tmp_path / "d.pt")
    heads = ["--num-heads", str(spec.num_attention_heads), "--num-query-groups", str(spec.num_query_groups)]
    out = tmp_path / "d.safetensors"
    assert _cli(str(tmp_path / "d.pt"), "--to", "mindformers", "--out", str(out), *heads) == 0
    out.write_bytes(out.read_bytes()[:-100])
    with pytest.raises(BadInput, match="d.safetensors: tensor .* outside the file"):
        _cli(str(out), "--to", "megatron", "--out", str(tmp_path / "x.pt"), *heads)
    assert not (tmp_path / "x.pt").exists()


def test_layout_transforms_round_trip_and_match_their_definitions() -> None:
    """qkv_contiguous = [q; k; v] of Megatron's per-group layout (MindFormers'
    use_contiguous_weight_layout_attention); concat splits back by named sizes (MLA's fused q/kv down
    projections); interleave with TP=2 interleaves each shard's [gate; up] halves as a whole."""
    from mapping import Rule, merge_qkv, split_qkv

    rng = np.random.default_rng(0)
    p = TransformParams(num_heads=4, num_query_groups=2, tp=2, sizes={"q": 3, "kv": 5})
    qkv = rng.standard_normal(((4 + 2 * 2) * 8, 6)).astype(np.float32)
    rule = Rule("qkv", "attention", [], [], {"op": "qkv_contiguous"})
    (contig,) = rule.apply([qkv], "candidate", p)
    q, k, v = split_qkv(qkv, p)
    np.testing.assert_array_equal(contig, np.concatenate([q, k, v]))
    np.testing.assert_array_equal(rule.apply([contig], "baseline", p)[0], qkv)
    np.testing.assert_array_equal(merge_qkv([q, k, v], p), qkv)

    cat = Rule("cat", "attention", [], [], {"op": "concat", "dim": 0, "sizes": ["q", "kv"]})
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    (joined,) = cat.apply([a, b], "candidate", p)
    back = cat.apply([joined], "baseline", p)
    assert np.array_equal(back[0], a) and np.array_equal(back[1], b)

    fc1 = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)      # 2 TP shards, each [gate(2); up(2)]
    il = Rule("fc1", "mlp", [], [], {"op": "interleave", "per_tp_shard": True})
    (mixed,) = il.apply([fc1], "candidate", p)
    gate = np.concatenate([fc1[0:2], fc1[4:6]])
    up = np.concatenate([fc1[2:4], fc1[6:8]])
    np.testing.assert_array_equal(mixed[0::2], gate)
    np.testing.assert_array_equal(mixed[1::2], up)
    np.testing.assert_array_equal(il.apply([mixed], "baseline", p)[0], fc1)


def test_qkv_concat_preset_splits_what_mindformers_splits(megatron_states) -> None:
    """linear_qkv (mla_qkv_concat True) is [q_down; kv_down]: MindFormers' MLASelfAttentionConcatenated splits
    its output as [q_lora_rank | kv_lora_rank | qk_pos_emb_head_dim], the kv part in Megatron's own order
    [kv_compressed | k_pos_emb]. Back to Megatron needs only q_down (kv_down is the remainder); a wrong size is
    bad input, not a silent mis-split."""
    from core.errors import BadInput

    spec, meg = SPECS["mla_qkv_concat"], megatron_states["mla_qkv_concat"]
    att = "decoder.layers.1.self_attention."
    pair = {att + "linear_q_down_proj.weight": meg[att + "linear_q_down_proj.weight"],
            att + "linear_kv_down_proj.weight": meg[att + "linear_kv_down_proj.weight"]}
    m = load_mapping(PRESET["mla_qkv_concat"])
    to_mf, _ = m.convert(pair, "candidate", _params(spec))
    qkv = to_mf[att + "linear_qkv.weight"]
    q_a, kv, k_pe = np.split(qkv, [spec.q_lora_rank, spec.q_lora_rank + spec.kv_lora_rank])
    np.testing.assert_array_equal(q_a, pair[att + "linear_q_down_proj.weight"])
    np.testing.assert_array_equal(np.concatenate([kv, k_pe]), pair[att + "linear_kv_down_proj.weight"])
    back, res = m.convert(to_mf, "baseline", TransformParams(sizes={"q_down": spec.q_lora_rank}))
    assert res.verdict == "pass" and all(np.array_equal(back[k], v) for k, v in pair.items())
    with pytest.raises(BadInput, match="linear_qkv_down: splitting needs sizes q_down, kv_down"):
        m.convert(to_mf, "baseline", TransformParams())
    with pytest.raises(BadInput, match="do not split"):
        m.convert(to_mf, "baseline", TransformParams(sizes={"q_down": 24, "kv_down": 3}))


def test_qkv_concat_weights_round_trip_through_safetensors_cli(megatron_states, tmp_path) -> None:
    """DeepSeek-V3 with MTP -> MindFormers safetensors (mla_qkv_concat: fused linear_qkv) -> Megatron with
    ``--size q_down=Q_LORA_RANK``: bit-identical; without --size the way back is bad input (exit 2 in the CLI)."""
    from core.errors import BadInput

    spec = SPECS["mla_qkv_concat"]
    sd = {k: torch.from_numpy(v) for k, v in megatron_states["mla_qkv_concat"].items()
          if not load_mapping(PRESET["mla_qkv_concat"]).ignored(k, "baseline")}
    torch.save(sd, tmp_path / "ds.pt")
    args = ["--mapping", PRESET["mla_qkv_concat"], "--num-heads", str(spec.num_attention_heads),
            "--num-experts", str(spec.num_experts)]
    out = tmp_path / "ds.safetensors"
    assert _cli(str(tmp_path / "ds.pt"), "--to", "mindformers", "--out", str(out), *args) == 0
    with pytest.raises(BadInput, match="splitting needs sizes"):
        _cli(str(out), "--to", "megatron", "--out", str(tmp_path / "x.pt"), *args)
    with pytest.raises(BadInput, match="--size 'q_down'"):
        _cli(str(out), "--to", "megatron", "--out", str(tmp_path / "x.pt"), *args, "--size", "q_down")
    assert _cli(str(out), "--to", "megatron", "--out", str(tmp_path / "back.pt"), *args,
                "--size", f"q_down={spec.q_lora_rank}") == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back) == sorted(sd)
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("case", ["mla_mtp", "mla_qkv_concat"])
def test_mtp_modules_pair_for_layer_tensors(case, megatron_states, mindformers_states) -> None:
    """Layer tensors of the MTP layer compare too: every Megatron MTP module that holds parameters (enorm, hnorm,
    eh_proj, transformer_layer and its attention / mlp, final_layernorm) maps to a MindFormers cell that does."""
    m = load_mapping(PRESET[case])

    def modules(names):
        return {n.rsplit(".", 1)[0] for n in names} | {n.split(".transformer_layer.")[0] + ".transformer_layer"
                                                        for n in names if ".transformer_layer." in n}

    meg = {n for n in modules(megatron_states[case]) if n.startswith("mtp.")}
    mf = modules(mindformers_states[case])
    wanted = {"mtp.layers.0", "mtp.layers.0.enorm", "mtp.layers.0.hnorm", "mtp.layers.0.eh_proj",
              "mtp.layers.0.final_layernorm", "mtp.layers.0.transformer_layer",
              "mtp.layers.0.transformer_layer.self_attention", "mtp.layers.0.transformer_layer.mlp"}
    prefixes = {p for n in meg for p in (n, *(n.rsplit(".", k)[0] for k in range(1, n.count("."))))}
    for name in wanted:
        assert name in prefixes, name
        other = m.map_module(name)
        assert other is not None and any(x == other or x.startswith(other + ".") for x in mf), (name, other)
        assert m.map_module(other, "candidate") == name


def _save_stacked_torch_dist(state: dict[str, np.ndarray], folder) -> None:
    """A torch_dist folder as megatron-core's dist_checkpointing lays it out: every per-layer parameter stacked
    on a leading layer axis (``decoder.layers.X``), sequential experts on the next (``...experts.experts.Y``)."""
    import re
    import warnings

    import torch.distributed.checkpoint as dcp

    stacks: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
    flat = {}
    for k, v in state.items():
        m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", k)
        if not m:
            flat[k] = torch.from_numpy(v.copy())
            continue
        e = re.match(r"^(.*\.experts)\.local_experts\.(\d+)\.(.*)$", m.group(2))
        key, idx = (f"decoder.layers.{e.group(1)}.experts.{e.group(3)}", (int(m.group(1)), int(e.group(2)))) if e \
            else (f"decoder.layers.{m.group(2)}", (int(m.group(1)),))
        stacks.setdefault(key, {})[idx] = v
    for key, parts in stacks.items():
        shape = tuple(max(i[d] for i in parts) + 1 for d in range(len(next(iter(parts)))))
        arr = np.empty(shape + next(iter(parts.values())).shape, np.float32)
        for idx, v in parts.items():
            arr[idx] = v
        flat[key] = torch.from_numpy(arr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def test_compare_weights_moe_conversion_exact_and_swapped_expert_named(megatron_states, tmp_path, capsys) -> None:
    """The real megatron-core MoE model saved as torch_dist (layers and experts stacked as Megatron stores them),
    converted by `align convert-weights` to MindFormers' stacked experts: compare-weights finds it bit-identical
    (the MoE preset chosen from the names); the same file with experts 1 and 2 of layer 1 swapped in
    ``experts.weight1`` fails on exactly those two experts, each named as holding the other's weights."""
    import json

    from align.cli import main
    from checkpoints.mindformers import read_safetensors, write_safetensors

    spec = SPECS["moe"]
    m = load_mapping(PRESET["moe"])
    sd = {k: v for k, v in megatron_states["moe"].items() if not m.ignored(k, "baseline")}
    _save_stacked_torch_dist(sd, tmp_path / "dist")
    mf = tmp_path / "moe.safetensors"
    assert main(["convert-weights", str(tmp_path / "dist"), "--to", "mindformers", "--out", str(mf), "--mapping",
                 PRESET["moe"], "--num-heads", str(spec.num_attention_heads), "--num-query-groups",
                 str(spec.num_query_groups)]) == 0
    assert main(["compare-weights", str(tmp_path / "dist"), str(mf), "--out", str(tmp_path / "ok")]) == 0
    st = json.loads((tmp_path / "ok" / "summary.json").read_text())["stages"]["weights"]
    assert st["mapping"] == PRESET["moe"] and st["max_rel_l2"] == 0.0 and st["compared"] == len(sd)
    assert st["failed"] == st["unmapped_baseline"] == st["unmapped_candidate"] == 0

    arrays, _ = read_safetensors(mf)
    w1 = arrays["decoder.layers.1.mlp.experts.weight1"].copy()      # [E * H, 2F]: expert e is rows e*H..
    h = spec.hidden_size
    w1[h:2 * h], w1[2 * h:3 * h] = arrays["decoder.layers.1.mlp.experts.weight1"][2 * h:3 * h], \
        arrays["decoder.layers.1.mlp.experts.weight1"][h:2 * h]
    arrays["decoder.layers.1.mlp.experts.weight1"] = w1
    write_safetensors(arrays, tmp_path / "swapped.safetensors")
    capsys.readouterr()
    assert main(["compare-weights", str(tmp_path / "dist"), str(tmp_path / "swapped.safetensors"), "--out",
                 str(tmp_path / "bad")]) == 1
    text = capsys.readouterr().out
    data = json.loads((tmp_path / "bad" / "summary.json").read_text())
    failing = {f["component"]: f["message"] for f in data["findings"] if f["verdict"] == "fail"}
    e = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert sorted(failing) == [e.format(1), e.format(2)], failing
    assert f"holds the baseline's {e.format(2)}" in failing[e.format(1)]
    assert f"holds the baseline's {e.format(1)}" in failing[e.format(2)]
    assert f"FAIL {e.format(1)}" in text

    # one expert absent from a baseline .pt: named, the layer's other experts still compared (and equal)
    gone = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    torch.save({k: torch.from_numpy(v) for k, v in sd.items() if k != gone}, tmp_path / "three.pt")
    assert main(["compare-weights", str(tmp_path / "three.pt"), str(mf), "--out", str(tmp_path / "gone")]) == 1
    data = json.loads((tmp_path / "gone" / "summary.json").read_text())
    assert [f["component"] for f in data["findings"] if f["verdict"] == "fail"] == [gone]
    st = data["stages"]["weights"]
    assert st["compared"] == len(sd) - 1 and st["max_rel_l2"] == 0.0 and st["missing"] == 1


@pytest.mark.parametrize("kind", list(SPECS))
def test_preset_is_chosen_from_the_tensor_names(kind, megatron_states, mindformers_states) -> None:
    """Issue 37: the preset comes from a checkpoint's names, whatever the MindFormers file's suffix: Megatron's
    names (a router and experts: MoE; linear_q_down_proj / linear_kv_down_proj: MLA) and MindFormers' own
    (linear_qb / linear_kvb: MLA with mla_qkv_concat)."""
    from models import preset_for_checkpoint

    meg = list(megatron_states[kind])
    # Megatron's MLA names are the same for both MLA presets: the main one (mla_qkv_concat False, as shipped)
    want = PRESET["mla"] if kind.startswith("mla") else PRESET[kind]
    for suffix in (".safetensors", ".ckpt"):
        assert preset_for_checkpoint(meg, "baseline", f"w{suffix}", "w") == want, suffix
    assert preset_for_checkpoint(list(mindformers_states[kind]), "candidate", "w.safetensors", "w") == PRESET[kind]


def _real_megatron_moe_checkpoint(folder) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The real megatron-core MoE GPTModel (local spec, sequential experts) saved by its own dist_checkpointing
    (torch_dist), as pretrain_gpt.py --ckpt-format torch_dist saves it: returns the model's state_dict and
    what checkpoints.megatron reads back from ``folder``."""
    from megatron.core import dist_checkpointing

    from checkpoints.megatron import read_megatron_checkpoint

    model = mg.build_tiny_llama(mg.TinyLlamaConfig(**megatron_kwargs("moe")), seed=7)
    (folder / "iter_0000001").mkdir(parents=True)
    with mg.cpu_device_redirect():
        dist_checkpointing.save(model.sharded_state_dict(), str(folder / "iter_0000001"))
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return state, read_megatron_checkpoint(folder)[0]


def test_local_spec_moe_checkpoint_converts_and_compares_without_mapping(megatron_states, mindformers_states,
                                                                           tmp_path, capsys) -> None:
    """Issue 37: Megatron-LM's LOCAL spec saves a MoE layer's norms under sharded_state_dict_keys_map's names
    (gpt_layer_specs.get_gpt_layer_local_spec: input_layernorm. -> self_attention.linear_qkv.layer_norm_,
    pre_mlp_layernorm. -> mlp.linear_fc1.layer_norm_). Such a checkpoint, saved by megatron-core itself,
    converts without --mapping (the MoE preset, from the names) into exactly the tensors MindFormers' MoE model
    has, each norm where it belongs, and compare-weights pairs every tensor bit-identical, without --mapping,
    in both orders."""
    import json

    from align.cli import main

    _ = megatron_states   # Megatron initialised on CPU
    state, saved = _real_megatron_moe_checkpoint(tmp_path / "ckpt")
    for layer in range(SPECS["moe"].num_layers):     # the keys map's names, not the module's
        p = f"decoder.layers.{layer}"
        assert f"{p}.mlp.linear_fc1.layer_norm_weight" in saved and f"{p}.pre_mlp_layernorm.weight" not in saved
        assert f"{p}.self_attention.linear_qkv.layer_norm_weight" in saved
        np.testing.assert_array_equal(saved[f"{p}.mlp.linear_fc1.layer_norm_weight"],
                                      state[f"{p}.pre_mlp_layernorm.weight"])
    spec = SPECS["moe"]
    heads = ["--num-heads", str(spec.num_attention_heads), "--num-query-groups", str(spec.num_query_groups)]
    mf = tmp_path / "mf.safetensors"
    capsys.readouterr()
    assert main(["convert-weights", str(tmp_path / "ckpt"), "--to", "mindformers", "--out", str(mf), *heads]) == 0
    assert f"(preset {PRESET['moe']})" in capsys.readouterr().out
    from checkpoints.mindformers import read_safetensors

    arrays, _ = read_safetensors(mf)
    m = load_mapping(PRESET["moe"])
    real = {k: v for k, v in mindformers_states["moe"].items() if not m.ignored(k, "candidate")}
    assert sorted(arrays) == sorted(real)      # every parameter of MindFormers' MoE model, nothing else
    for name, arr in arrays.items():
        assert arr.shape == real[name].shape, name
    for layer in range(spec.num_layers):
        p = f"decoder.layers.{layer}"
        np.testing.assert_array_equal(arrays[f"{p}.pre_mlp_layernorm.weight"], state[f"{p}.pre_mlp_layernorm.weight"])
        np.testing.assert_array_equal(arrays[f"{p}.input_layernorm.weight"], state[f"{p}.input_layernorm.weight"])
    units = len([k for k in saved if not m.ignored(k, "baseline")])     # the baseline's tensors, each compared
    for order, out, n in (([tmp_path / "ckpt", mf], tmp_path / "cmp", units),
                          ([mf, tmp_path / "ckpt"], tmp_path / "swapped", len(arrays))):
        assert main(["compare-weights", *map(str, order), "--out", str(out)]) == 0, capsys.readouterr()
        st = json.loads((out / "summary.json").read_text())["stages"]["weights"]
        assert st["mapping"].startswith(PRESET["moe"]) and st["max_rel_l2"] == 0.0, st
        assert st["failed"] == st["unmapped_baseline"] == st["unmapped_candidate"] == 0
        assert st["compared"] == n


@pytest.mark.parametrize("kind", ["mla", "mla_qkv_concat"])
def test_mla_presets_pair_the_fused_pre_mlp_norm_name(kind, megatron_states, mindformers_states) -> None:
    """Issue 37: the MLA presets take a MoE layer's pre-MLP norm under the checkpoint name Megatron's local spec
    gives it (mlp.linear_fc1.layer_norm_weight) as MindFormers' pre_mlp_layernorm: every group pairs and
    the conversion equals that of the model's own names."""
    m = load_mapping(PRESET[kind])
    meg = {k: v for k, v in megatron_states[kind].items() if not m.ignored(k, "baseline")}
    fused = {k.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"): v for k, v in meg.items()}
    assert sum(k.endswith("mlp.linear_fc1.layer_norm_weight") for k in fused) >= SPECS[kind].num_layers
    check = m.check(fused, mindformers_states[kind])
    assert check.verdict == "pass", [f.message for f in check.findings][:5]
    want, _ = m.convert(meg, "candidate", _params(SPECS[kind]))
    got, res = m.convert(fused, "candidate", _params(SPECS[kind]))
    assert res.verdict == "pass" and sorted(got) == sorted(want)
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, want[name])
