"""MindFormers layer tensors at TP / SP / CP / EP put back together (sources.layers.gather_layers).

MindFormers' semi-auto parallel does not run on CPU (``Invalid backend: CPU``), so each rank's store is written
by tests/helpers/mindformers_layouts.py through the MindSpore dumper's own recording path, every rank holding the
block MindSpore's own slicing (``mindspore.parallel._tensor._load_tensor`` / ``_get_tensor_slice_index``) cuts
from the whole tensor with the layout the dumper records as ``split`` (dumpers/mindformers_layer_split.py). The
gather must give back the one-process tensors bit for bit, and refuse or flag a store with a rank dropped or
written twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")

import sources.layers as layers  # noqa: E402
from models.mindformers_parallel import ParallelStrategy  # noqa: E402
from sources.gather_totals import GatherMismatch  # noqa: E402
from tests.helpers.mindformers_layouts import mindspore_part, model_rows, write_layer_stores  # noqa: E402


def _gathered(store: Path) -> tuple[layers.GatheredLayers, list[dict]]:
    src = layers.gather_layers(layers.layer_source(store))
    rows, _ = src.layer_rows(1)
    return src, rows


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One dense step (2 layers, forward and backward) at TP=1, TP=2, TP=4 + SP and CP=2 x TP=2 + SP."""
    root = tmp_path_factory.mktemp("mf_dense")
    rows = model_rows(seed=3)
    layouts = {"tp1": ParallelStrategy(), "tp2": ParallelStrategy(tp=2),
               "tp4sp": ParallelStrategy(tp=4, use_seq_parallel=True),
               "cp2tp2sp": ParallelStrategy(tp=2, cp=2, use_seq_parallel=True)}
    return {name: write_layer_stores(root / name, s, rows) for name, s in layouts.items()} | {"_rows": rows}


def test_rank_order_is_mindformers_own() -> None:
    """The dumper places a global rank as MindFormers does: the stage from get_current_rank_stage (the wheel's
    models/utils.py, run with its rank and world patched in), (dp, cp, tp) inside the stage row-major as the
    device matrix of parallel_core/training_graph/device_matrix.py (MindSpore's own _rank_to_coordinate)."""
    import mindformers.models.utils as mf_utils
    import mindspore as ms
    from mindspore.parallel._tensor import _rank_to_coordinate

    from dumpers.mindspore_dumper import rank_coordinates

    s = ParallelStrategy(dp=2, tp=2, cp=2, pp=2)
    per_stage = s.world // s.pp
    for rank in range(s.world):
        c = rank_coordinates(rank, strategy=s)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mf_utils, "get_rank", lambda rank=rank: rank)
            mp.setattr(mf_utils, "get_group_size", lambda: s.world)
            mp.setattr(ms, "get_auto_parallel_context", lambda key: s.pp)
            assert c["pp_rank"] == mf_utils.get_current_rank_stage(), rank
        dp, cp, tp = (int(x) for x in _rank_to_coordinate(rank % per_stage, [s.dp, s.cp, s.tp]))
        assert (c["dp_rank"], c["cp_rank"], c["tp_rank"]) == (dp, cp, tp), rank


@pytest.mark.parametrize("name", ["tp2", "tp4sp", "cp2tp2sp"])
def test_tp_and_cp_rows_gather_to_the_one_process_tensors_bit_equal(dense, name) -> None:
    """Every row of TP=2, TP=4 + SP and CP=2 x TP=2 + SP (column outputs on the last dim, SP hidden states and
    row-parallel outputs on the sequence, CP in contiguous blocks) joins into the TP=1 tensor, bit for bit; the
    rank files hold slices (what MindSpore cut), and the compare with the TP=1 store passes on every row."""
    from comparators.layer_tensors import compare_layer_tensors

    rows = dense["_rows"]
    src, got = _gathered(dense[name])
    assert src.notes[1] == [f"rows gathered from ranks {list(range(len(src.src.array_ranks(1))))} (DP rank 0)"]
    assert [(r["module"], r["kind"]) for r in got] == [(m, k) for m, k, _ in rows]
    for (_, _, whole), row in zip(rows, got, strict=True):
        np.testing.assert_array_equal(layers.load_ref(row["ref"]), whole)
        assert row["shape"] == "x".join(map(str, whole.shape))
    one, _ = layers.layer_source(dense[name]).layer_rows(1, 1)
    fc1 = next(r for r in one if r["module"].endswith("layers.0.mlp.linear_fc1"))
    whole = next(x for m, k, x in rows if (m, k) == (fc1["module"], fc1["kind"]))
    assert "tp:2" in fc1["split"].split(",") and fc1["numel"] < whole.size
    res = compare_layer_tensors(layers.gather_layers(layers.layer_source(dense["tp1"])), src, None, step=1)
    assert res.verdict == "pass" and res.details["compared"] == len(rows) and res.details["mode"] == "tensor"


def test_statistics_only_store_gathers_the_whole_statistics(tmp_path: Path) -> None:
    """A statistics-only TP=2 + SP store: each row's gathered statistics are the whole tensor's (the parts'
    maxima, minima, count-weighted means, root of the summed squares)."""
    rows = model_rows(seed=5, layers=1)
    _, got = _gathered(write_layer_stores(tmp_path / "s", ParallelStrategy(tp=2, use_seq_parallel=True), rows,
                                          full=False))
    for (_, _, whole), row in zip(rows, got, strict=True):
        x = whole.astype(np.float64)
        assert row["ref"] is None and row["numel"] == whole.size
        assert (row["max"], row["min"]) == (float(whole.max()), float(whole.min()))
        assert row["norm"] == pytest.approx(float(np.sqrt((x * x).sum())), rel=1e-12)
        assert row["mean"] == pytest.approx(float(x.mean()), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("baseline", [ParallelStrategy(), ParallelStrategy(tp=4, ep=4)], ids=["ep1", "ep4"])
def test_experts_pair_across_ep_sizes(tmp_path: Path, baseline: ParallelStrategy) -> None:
    """MindFormers' routed experts (FFNGroupedGEMM) return the MoE's tokens in token order, the batch cut over
    the stage's ranks: an EP=2 (TP=2) candidate's expert rows join into the same tokens as an EP=1 or EP=4
    (TP=4) baseline's and pair with them; no row is left unpaired for its EP size."""
    from comparators.layer_tensors import compare_layer_tensors

    rows = model_rows(seed=7, moe=True)
    cand = write_layer_stores(tmp_path / "ep2", ParallelStrategy(tp=2, ep=2), rows)
    base = write_layer_stores(tmp_path / "base", baseline, rows)
    one, _ = layers.layer_source(cand).layer_rows(1, 1)
    experts = [r for r in one if r["module"].endswith("mlp.experts")]
    assert experts and all(r["split"] == "tp:0" and r["shape"] == "2x8x16" for r in experts)
    _, got = _gathered(cand)
    assert not any("token_group" in r for r in got)
    res = compare_layer_tensors(layers.gather_layers(layers.layer_source(base)), layers.gather_layers(
        layers.layer_source(cand)), None, step=1)
    assert res.verdict == "pass" and res.details["compared"] == len(rows) and not res.details["unmatched_baseline"]


def test_a_dropped_rank_is_named_and_its_rows_left_out(dense, tmp_path: Path) -> None:
    """TP rank 1's step file lost: every row it held a part of is left out, the note names the rank; rows that
    are whole on every TP rank (no SP) are still read from TP rank 0."""
    store = tmp_path / "tp2"
    shutil.copytree(dense["tp2"], store)
    (store / "steps" / "step_00000001" / "rank_00001.h5").unlink()
    src, got = _gathered(store)
    assert src.notes[1][0] == "rows gathered from ranks [0] (DP rank 0)"
    assert src.notes[1][-1] == ("10 rows left out: parts of them missing (first: decoder.layers.0."
                                "self_attention.linear_qkv forward.output.0: TP rank 1 of 2 absent)")
    assert len(got) == len(dense["_rows"]) - 10 and all(r["split"] == "" for r in got)


@pytest.mark.parametrize("full", [True, False], ids=["tensors", "stats"])
def test_a_rank_written_twice_is_refused_naming_both(tmp_path: Path, full: bool) -> None:
    """Rank 1 recorded rank 0's part of every row (a copied rank file, or a whole tensor recorded as a slice):
    the parts' statistics are equal to the last bit, which distinct slices never are: refused in one line
    naming both ranks, in a statistics-only store too (nothing else could see it there)."""
    s = ParallelStrategy(tp=2)
    rows = model_rows(seed=9, layers=1)
    store = write_layer_stores(tmp_path / "dup", s, rows, full=full,
                               part=lambda m, k, r, x: mindspore_part(
                                   next(w for mm, kk, w in rows if (mm, kk) == (m, k)), m, s, 0))
    with pytest.raises(GatherMismatch) as err:
        _gathered(store)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{store}: decoder.layers.0.self_attention.linear_qkv "
                                              "forward.output.0: the parts of rank 0 and rank 1 record the same "
                                              "statistics"), msg


def test_two_ranks_at_one_position_are_refused(dense, tmp_path: Path) -> None:
    """Rank 1's rank file says TP rank 0 (a wrong coordinate): two parts at one position, refused naming both."""
    store = tmp_path / "tp2"
    shutil.copytree(dense["tp2"], store)
    f = store / "ranks" / "rank_00001.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "tp_rank": 0}))
    with pytest.raises(GatherMismatch, match=r": ranks 0 and 1 both hold TP rank 0, CP rank 0 of DP rank 0 "):
        _gathered(store)


def test_layer_stage_names_a_planted_fault_in_the_right_layer(dense, tmp_path: Path) -> None:
    """A TP=2 + SP candidate whose layer-1 fc1 output is 5% off on every rank, against the TP=1 store through
    `align report`: the layer stage fails and names decoder.layers.1.mlp.linear_fc1, and no other row."""
    from align.cli import main

    rows = dense["_rows"]
    bad = "decoder.layers.1.mlp.linear_fc1"
    cand = write_layer_stores(tmp_path / "cand", ParallelStrategy(tp=2, use_seq_parallel=True), rows,
                              part=lambda m, k, r, x: x * np.float32(1.05) if (m, k) == (bad, "forward.output.0")
                              else x)
    rc = main(["report", str(dense["tp1"]), str(cand), "--out", str(tmp_path / "rep")])
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    stage = summary["stages"]["layer_tensors"]
    assert rc == 1 and stage["verdict"] == "fail", stage
    fails = [f for f in summary["findings"] if f["stage"] == "layer_tensors" and f["verdict"] == "fail"]
    assert fails and all(f["component"].startswith(bad) for f in fails), fails


MODE = "pynative"   # "graph" (the in-graph capture) passes too: 46 s here at load 7, PYNATIVE 12 s


def test_real_model_rows_carry_their_split(tmp_path: Path) -> None:
    """MindFormers' real mcore dense model, its own cell names, captured by the dumper (the PYNATIVE hooks; the
    GRAPH capture's rows go through the same end_step): each row's split from the dumper's strategy, rank 0 of
    a TP=2 job: column outputs on the last dim, row-parallel outputs and hidden states whole (no SP), the rank
    file in MindFormers' coordinates. (One process: the numbers are the whole model's; the labels are checked.)"""
    pytest.importorskip("mindformers")
    mc = pytest.importorskip("demo.mindformers_mcore_cpu")
    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper
    from runstore import RunReader

    spec = mc.TinyModel()
    mc.set_mcore_context(MODE, seed=0)
    try:
        net = mc.build_mcore_model(spec, MODE, seed=0)
        cells = ("model.embedding", "model.decoder.layers.*.self_attention.linear_*",
                 "model.decoder.layers.*.mlp.linear_fc*", "model.decoder.layers.*.input_layernorm",
                 "model.output_layer")
        d = MindSporeDumper(net, tmp_path / "g", DumpConfig(tensors="stats", cells=cells, steps=[1]),
                            graph_capture=MODE == "graph", rank=0, world_size=2, framework="mindformers",
                            strategy=ParallelStrategy(tp=2))
        cell = mc.build_mcore_train_cell(net, learning_rate=1e-2)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, spec.vocab_size, size=(spec.micro_batch_size, spec.seq_length + 1))
        batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:],
                 "loss_mask": np.ones((spec.micro_batch_size, spec.seq_length), np.float32)}
        d.begin_step(1)
        out = cell(*mc.mcore_inputs(batch))
        d.end_step(loss=float(out[0].asnumpy().reshape(-1)[0]))
        d.close()
    finally:
        mc.reset_mindformers_context()
    r = RunReader(tmp_path / "g")
    t = r.step_arrays(1, 0).table("tensor_stats")
    split = {(m.removeprefix("model."), k): s for m, k, s in zip(t.module.astype(str), t.kind.astype(str),
                                                                  t.split.astype(str), strict=True)}
    assert split[("decoder.layers.0.self_attention.linear_qkv", "forward.output.0")] == "tp:2"
    assert split[("decoder.layers.0.mlp.linear_fc1", "backward.grad_output.0")] == "tp:2"
    assert split[("output_layer", "forward.output.0")] == "tp:2"
    for m in ("embedding", "decoder.layers.0.self_attention.linear_proj", "decoder.layers.1.mlp.linear_fc2",
              "decoder.layers.1.input_layernorm"):
        assert split[(m, "forward.output.0")] == "", m
    assert (r.rank_info(0)["tp"], r.rank_info(0)["tp_rank"], r.rank_info(0)["dp_rank"]) == (2, 0, 0)
    assert r.meta["parallel"]["tp"] == 2


class _MegatronExperts:
    """A Megatron MoE run's layer rows (statistics) at EP size ``ep`` over 4 DP ranks (TP=1), as its dispatcher
    lays them out: an expert's rows hold the tokens its EP group's DP ranks routed to it, in rank order (the
    all-gather dispatcher's stable sort by expert); expert names global (local_experts.<EP rank x 4/ep + e>)."""

    root = "megatron-ep"
    needs_readers = False
    experts, dp = 4, 4

    def __init__(self, ep: int, tokens: list[list[np.ndarray]], folder: Path) -> None:
        self.ep, self.tokens, self.folder = ep, tokens, folder    # tokens[dp rank][expert]: [n, h]
        folder.mkdir(parents=True, exist_ok=True)

    def array_steps(self) -> list[int]:
        return [1]

    def array_ranks(self, step: int) -> list[int]:
        return list(range(self.dp))

    def rank_info(self, rank: int) -> dict:
        return {"rank": rank, "dp_rank": rank, "dp": self.dp, "ep_rank": rank % self.ep, "ep": self.ep,
                "tp_rank": 0, "tp": 1}

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict], bool]:
        from dumpers.mindspore_dumper import array_stats

        group = range(rank - rank % self.ep, rank - rank % self.ep + self.ep)
        local = self.experts // self.ep
        rows = [("decoder.layers.0.mlp.router", self.tokens[rank][0][:1])]
        for e in range(local):
            g = (rank % self.ep) * local + e
            rows.append((f"decoder.layers.0.mlp.experts.local_experts.{g}",
                         np.concatenate([self.tokens[d][g] for d in group])))
        out = []
        for i, (m, x) in enumerate(rows):
            ref = self.folder / f"rank{rank}_{i}.npy"
            np.save(ref, x)
            out.append({"order": i, "module": m, "kind": "forward.output.0", "dtype": "float32", "numel": x.size,
                        "shape": "x".join(map(str, x.shape)), "split": "", "ref": str(ref), **array_stats(x)})
        return out, True


@pytest.mark.parametrize("base_ep, cand_ep", [(1, 2), (4, 2), (2, 4)])
def test_megatron_expert_rows_pair_across_ep_sizes_by_global_index(base_ep: int, cand_ep: int,
                                                                    tmp_path: Path) -> None:
    """Megatron's per-expert rows at another EP size hold other tokens (its EP group's); the side whose EP group
    is smaller has each expert's rows joined over the other's DP ranks, so expert g pairs with expert g: every
    row compared and passing (full tensors: the tokens in the dispatcher's order); a token changed in DP rank 1's
    expert 3 fails naming that expert, and only it."""
    from comparators.layer_tensors import compare_layer_tensors

    rng = np.random.default_rng(11)
    tokens = [[rng.standard_normal((int(rng.integers(1, 4)), 8)).astype(np.float32) for _ in range(4)]
              for _ in range(4)]
    base = layers.gather_layers(_MegatronExperts(base_ep, tokens, tmp_path / "a"))
    cand = layers.gather_layers(_MegatronExperts(cand_ep, tokens, tmp_path / "b"))
    res = compare_layer_tensors(base, cand, None, step=1)
    assert res.verdict == "pass" and res.details["compared"] == 5 and not res.details["unmatched_baseline"], res
    assert res.details["mode"] == "tensor"
    assert "expert rows of the" in res.details["experts_joined"]
    bad = [[x.copy() for x in row] for row in tokens]
    bad[1][3][0, 0] += 1.0
    res = compare_layer_tensors(base, layers.gather_layers(_MegatronExperts(cand_ep, bad, tmp_path / "c")), None,
                                step=1)
    fails = [r["module"] for r in res.details["rows"] if r["verdict"] != "pass"]
    assert fails == ["decoder.layers.0.mlp.experts.local_experts.3"], fails
