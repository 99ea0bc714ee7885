"""Parameter trajectories and one-side spikes on run stores written here with the run-store writer
(framework-free, ~60 steps each): planted drifts and spikes are named at their step, clean pairs name nothing.

The candidate carries MindFormers' Llama names (q/k/v split where Megatron fuses them), so every comparison
goes through the mapping, as on real runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from align.cli import main
from align.stages import Evidence, Inputs, run_stages
from runstore import RunWriter

STEPS = 60
BASE = {  # Megatron-core name -> its gradient norm's scale
    "embedding.word_embeddings.weight": 1.0,
    "decoder.layers.0.input_layernorm.weight": 0.05,
    "decoder.layers.0.self_attention.linear_qkv.weight": 0.6,
    "decoder.layers.0.self_attention.linear_proj.weight": 0.4,
    "decoder.layers.0.mlp.linear_fc2.weight": 0.3,
    "decoder.final_layernorm.weight": 0.02,
    "output_layer.weight": 2.0,
}
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
MF = {"embedding.word_embeddings.weight": ["model.tok_embeddings.embedding_weight"],
      "decoder.layers.0.input_layernorm.weight": ["model.layers.0.attention_norm.weight"],
      QKV: [f"model.layers.0.attention.{p}.weight" for p in ("wq", "wk", "wv")],
      "decoder.layers.0.self_attention.linear_proj.weight": ["model.layers.0.attention.wo.weight"],
      "decoder.layers.0.mlp.linear_fc2.weight": ["model.layers.0.feed_forward.w2.weight"],
      "decoder.final_layernorm.weight": ["model.norm_out.weight"],
      "output_layer.weight": ["lm_head.weight"]}
QKV_PARTS = np.sqrt([0.5, 0.25, 0.25])      # the fused norm's parts: sqrt(sum of squares) gives it back


def truth(step: int) -> dict[str, float]:
    """The 'true' gradient norm of each parameter at a step (the same for every run)."""
    return {n: s * (1.0 + 0.3 * np.sin(step / 7 + i)) for i, (n, s) in enumerate(BASE.items())}


def batch(step: int) -> dict[str, np.ndarray]:
    t = np.random.default_rng(step).integers(2, 100, size=(2, 9))
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": np.ones((2, 8), dtype=np.float32)}


def make_store(path: Path, *, seed: int, noise: float = 1e-3, loss_noise: float = 1e-4, mindformers: bool = False,
               drift: tuple[str, int, float] | None = None, loss_spike: tuple[int, float] | None = None,
               grad_spike: tuple[int, float] | None = None, norm_jump: tuple[str, int, float] | None = None,
               other_batch_at: int | None = None, norms: bool = True, updates: bool = True,
               update_drift: tuple[str, int, float] | None = None) -> Path:
    """A run: loss, grad norm and named norms every step with relative noise ``noise`` (the run's own
    nondeterminism); ``drift`` = (name, step, factor) scales one norm from that step on; ``loss_spike`` /
    ``grad_spike`` = (step, add / factor) at one step; ``norm_jump`` one norm at one step;
    ``other_batch_at`` trains on a different batch at that step; ``updates`` also records per-parameter
    update norms (``update_drift`` as ``drift``)."""
    rng = np.random.default_rng(seed)
    meta = {"framework": "mindformers" if mindformers else "megatron-core"}
    with RunWriter(path, rank=0, meta=meta) as w:
        for s in range(1, STEPS + 1):
            b = batch(s)
            if s == other_batch_at:
                b["tokens"] = b["tokens"] + 1
            for k, v in b.items():
                w.put_array(s, f"batch/{k}", v)
            vals = {n: v * (1 + noise * rng.standard_normal()) for n, v in truth(s).items()}
            if drift and s >= drift[1]:
                vals[drift[0]] *= drift[2]
            if norm_jump and s == norm_jump[1]:
                vals[norm_jump[0]] *= norm_jump[2]
            upd = {n: 1e-3 * v * (1 + noise * rng.standard_normal()) for n, v in truth(s).items()}
            if update_drift and s >= update_drift[1]:
                upd[update_drift[0]] *= update_drift[2]
            for group, table in (("local_norm", vals), ("update_norm", upd)):
                names, values = [], []
                for n, v in table.items():
                    parts = MF[n] if mindformers else [n]
                    names += parts
                    values += list(v * QKV_PARTS) if len(parts) == 3 else [v]
                if norms and (group == "local_norm" or updates):
                    n = len(names)
                    w.put_table(s, group, {"name": np.array(names, dtype=object), "norm": np.array(values),
                                           "numel": np.full(n, 16), "tp_partition_dim": np.full(n, -1),
                                           "tp_rank": np.zeros(n, dtype=np.int64),
                                           "tp_size": np.ones(n, dtype=np.int64)})
            loss = 10.0 - 0.05 * s + loss_noise * rng.standard_normal()
            gn = 2.0 + 0.1 * np.sin(s) + 1e-4 * rng.standard_normal()
            if loss_spike and s == loss_spike[0]:
                loss += loss_spike[1]
            if grad_spike and s == grad_spike[0]:
                gn *= grad_spike[1]
            w.log_scalars(s, {"loss": loss, "grad_norm": gn, "lr": 1e-3})
            w.finish_step()
    return path


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The baseline and its repeat (another seed: the run's own noise), shared by the tests."""
    root = tmp_path_factory.mktemp("traj")
    return make_store(root / "baseline", seed=1), make_store(root / "repeat", seed=2, loss_noise=1e-3)


def stages(b: Path, c: Path, repeats: list[Path], only: list[str]) -> dict:
    ev = Evidence.load(Inputs(str(b), str(c), repeats=[str(r) for r in repeats]))
    return run_stages(ev, only=only)


def test_drifting_parameter_is_named_at_its_step(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    """One parameter's gradient norm 2% off from step 31 on (its band from the repeat is ~0.4%), another's
    update norm 5% off from step 45: the loss and the global grad norm see nothing, the trajectory stage fails
    naming each parameter at its step (the gradient one first), and the report draws both kinds."""
    b, rep = baseline
    c = make_store(tmp_path / "c", seed=3, mindformers=True,
                   drift=("decoder.layers.0.mlp.linear_fc2.weight", 31, 1.02),
                   update_drift=("decoder.final_layernorm.weight", 45, 1.05))
    code = main(["report", "-q", str(b), str(c), "--repeat", str(rep), "--out", str(tmp_path / "r")])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    st = s["stages"]["norm_trajectories"]
    assert code == 1 and st["verdict"] == "fail"
    assert s["stages"]["long_run"]["verdict"] == "pass" and s["stages"]["spikes"]["verdict"] == "pass"
    first = st["first_departure"]
    assert first["name"] == "decoder.layers.0.mlp.linear_fc2.weight" and first["departure_step"] == 31
    assert st["kinds"]["local_norm"]["departed"] == 1 and st["steps"] == STEPS
    assert st["parameters"] == len(BASE)       # the fused QKV compared as one, through the mapping
    assert first["norm_kind"] == "local_norm" and st["kinds"]["update_norm"]["departed"] == 1
    fails = [f for f in s["findings"] if f["stage"] == "norm_trajectories" and f["verdict"] == "fail"]
    assert [(f["metric"], f["component"], f["value"]) for f in fails] == [
        ("local_norm_departure_step", "decoder.layers.0.mlp.linear_fc2.weight", 31),
        ("update_norm_departure_step", "decoder.final_layernorm.weight", 45)]
    for kind in ("local_norm", "update_norm"):
        assert (tmp_path / "r" / "figures" / f"{kind}_trajectories.png").stat().st_size > 10_000
    assert "linear_fc2" in (tmp_path / "r" / "report.html").read_text()


def test_clean_pair_names_nothing(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    """The candidate's own noise is the repeat's: every parameter stays in its band, no spike."""
    b, rep = baseline
    c = make_store(tmp_path / "c", seed=4, mindformers=True)
    res = stages(b, c, [rep], ["norm_trajectories", "spikes"])
    st = res["norm_trajectories"]
    assert st.verdict == "pass", [f.message for f in st.findings]
    assert st.details["first_departure"] is None and st.details["kinds"]["local_norm"]["departed"] == 0
    assert st.details["kinds"]["local_norm"]["judged"] == st.details["kinds"]["update_norm"]["judged"] == len(BASE)
    assert res["spikes"].verdict == "pass" and res["spikes"].details["loss"]["spikes"] == 0
    # the baseline as its own repeat measures no noise: it is named by the band stage and used for no band
    # (issue 35), so the trajectories have none and say to pass a repeat
    res = stages(b, c, [b], ["band", "norm_trajectories"])
    st = res["norm_trajectories"]
    assert st.verdict == "skipped" and "--repeat" in st.details["reason"]
    assert res["band"].verdict == "warn" and "bit-identical" in res["band"].findings[0].message


def test_without_repeat_says_what_to_capture(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    b, _ = baseline
    c = make_store(tmp_path / "c", seed=4, mindformers=True)
    st = stages(b, c, [], ["norm_trajectories"])["norm_trajectories"]
    assert st.verdict == "skipped" and "--repeat" in st.details["reason"]
    assert "--repeat" in st.details["capture"] and st.details["needs"]
    no_norms = make_store(tmp_path / "rep", seed=2, norms=False)
    st = stages(b, c, [no_norms], ["norm_trajectories"])["norm_trajectories"]
    assert st.verdict == "skipped" and "hold no named" in st.details["reason"]


def test_one_side_loss_spike_reported_with_its_evidence(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    """The candidate's loss jumps at step 40 only, on a different batch, with one parameter's gradient norm
    x6 there; its grad norm jumps at step 20 on the same batch. Both are reported with their step's
    evidence; the long run (a lone spike is not a divergence) does not fail."""
    b, rep = baseline
    c = make_store(tmp_path / "c", seed=5, mindformers=True, loss_spike=(40, 0.5), other_batch_at=40,
                   norm_jump=("output_layer.weight", 40, 6.0), grad_spike=(20, 3.0))
    res = stages(b, c, [rep], ["spikes", "long_run", "norm_trajectories"])
    assert res["long_run"].details["divergence_step"] is None
    sp = res["spikes"]
    assert sp.verdict == "warn"
    loss = sp.details["loss"]["reported"]
    assert [x["peak_step"] for x in loss] == [40] and loss[0]["steps_outside"] == 1 and loss[0]["back_step"] == 41
    assert loss[0]["side"] == "candidate" and loss[0]["delta"] == pytest.approx(0.5, abs=0.01)
    assert loss[0]["batches"]["same_batch"] is False
    assert loss[0]["batches"]["baseline"]["tokens_sha1"] != loss[0]["batches"]["candidate"]["tokens_sha1"]
    jumps = loss[0]["norm_jumps"]
    assert jumps[0]["name"] == "output_layer.weight" and jumps[0]["candidate_ratio"] > 4
    assert jumps[0]["one_side_jump"] > 4 and all(j["one_side_jump"] < 1.2 for j in jumps[1:])
    assert jumps[0]["baseline_ratio"] == pytest.approx(1.0, abs=0.2)
    grad = sp.details["grad_norm"]["reported"]
    assert [x["peak_step"] for x in grad] == [20] and grad[0]["batches"]["same_batch"] is True
    msgs = [f.message for f in sp.findings]
    assert any("step 40" in m and "DIFFER" in m and "output_layer.weight" in m and "the candidate spiked" in m
               for m in msgs), msgs
    assert any("grad norm" in m and "step 20" in m and "same batch" in m and "moved alike" in m for m in msgs), msgs
    # a one-step jump of one norm is not a departure of its trajectory
    assert res["norm_trajectories"].details["first_departure"] is None


def test_spike_on_both_sides_is_not_one_side(tmp_path: Path) -> None:
    """A spike both runs (and the repeat) show at the same step, on the same batch, leaves the delta in the band."""
    b = make_store(tmp_path / "b", seed=1, loss_spike=(40, 0.5))
    rep = make_store(tmp_path / "rep", seed=2, loss_spike=(40, 0.5), loss_noise=1e-3)
    c = make_store(tmp_path / "c", seed=5, mindformers=True, loss_spike=(40, 0.5))
    sp = stages(b, c, [rep], ["spikes"])["spikes"]
    assert sp.verdict == "pass" and sp.details["loss"]["spikes"] == 0 and sp.details["loss"]["reported"] == []
    assert "no one-side spike" in sp.findings[0].message


def test_no_lone_spikes_in_a_run_outside_its_band(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    """A candidate whose loss is off at most steps fails the long run; its short departures are not spikes."""
    b, rep = baseline
    c = make_store(tmp_path / "c", seed=5, mindformers=True, loss_noise=3e-3)
    res = stages(b, c, [rep], ["spikes", "long_run"])
    assert res["long_run"].details["outside_band_fraction"] > 0.05
    assert res["spikes"].details["loss"]["spikes"] is None and "outside the band at" in res["spikes"].details[
        "loss"]["reason"]


def test_without_repeat_the_spike_side_is_unknown(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    b, _ = baseline
    c = make_store(tmp_path / "c", seed=5, mindformers=True, loss_spike=(40, 0.5))
    sp = stages(b, c, [], ["spikes"])["spikes"]
    (loss,) = sp.details["loss"]["reported"]
    assert loss["side"] == "unknown" and loss["batches"]["same_batch"] is True
    assert "needs a repeat of the baseline" in sp.findings[0].message


def _sharded_store(path: Path, steps: int, seed: int) -> Path:
    """Two TP ranks (a partitioned and a replicated parameter), the second also with distributed-optimizer
    parts over two DP ranks; from step 4 a new parameter appears (the table's layout changes)."""
    rng = np.random.default_rng(seed)
    for tp in (0, 1):
        with RunWriter(path, rank=tp, meta={"framework": "megatron-core"}, rank_info={"tp_rank": tp}) as w:
            for s in range(1, steps + 1):
                names = ["a.weight", "b.weight", "c.weight", "c.weight"]
                cols = {"norm": rng.random(4) + 0.5, "tp_partition_dim": [0, -1, 0, 0], "tp_rank": [tp] * 4,
                        "tp_size": [2] * 4, "numel": [8, 4, 4, 4], "dp_shard": [0, 0, 1, 1], "dp_rank": [0, 0, 0, 1],
                        "dp_size": [1, 1, 2, 2]}
                if s >= 4:
                    names.append("d.weight")
                    for k, v in (("norm", 0.7), ("tp_partition_dim", -1), ("tp_rank", tp), ("tp_size", 2),
                                 ("numel", 4), ("dp_shard", 0), ("dp_rank", 0), ("dp_size", 1)):
                        cols[k] = np.append(cols[k], v)
                w.put_table(s, "local_norm", {"name": np.array(names, dtype=object),
                                              **{k: np.asarray(v) for k, v in cols.items()}})
                w.finish_step()
    return path


def test_trajectory_reader_combines_ranks_as_the_step1_reader(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorised reader replays the step-1 comparator's combination (TP shards summed, replicas once,
    DP parts summed) on every step, through a change of the table's layout, in forked readers too, and reads
    the older table layout and a log's named norms."""
    import pandas as pd

    from comparators.local_norms import read_local_norms
    from comparators.trajectories import read_trajectory
    from core.errors import BadInput
    from runstore import Run, RunReader, open_store

    path = _sharded_store(tmp_path / "s", 6, seed=7)
    t = read_trajectory(open_store(path))
    assert t is not None and list(t.steps) == list(range(1, 7)) and t.files == 12
    assert t.names == ["a.weight", "b.weight", "c.weight", "d.weight"]
    for i, step in enumerate(t.steps):
        entries, _ = read_local_norms(RunReader(path), int(step))
        for name, e in entries.items():
            assert t.column(name)[i] == pytest.approx(e.full_norm(), rel=1e-6), (step, name)
    assert t.present is not None and not t.present[:3, 3].any() and t.present[3:, 3].all()
    assert list(read_trajectory(open_store(path), steps=[2, 5]).steps) == [2, 5]
    # forked readers (chunks of steps side by side) give the same trajectory, across the layout change
    from comparators import trajectories

    monkeypatch.setattr(trajectories, "FORK_MIN_STEPS", 1)
    forked = read_trajectory(open_store(path), jobs=3)
    assert forked.names == t.names and forked.files == t.files and list(forked.steps) == list(t.steps)
    assert np.array_equal(forked.values, t.values, equal_nan=True) and np.array_equal(forked.present, t.present)
    bad = sorted((path / "steps").glob("step_*"))[4] / "rank_00001.h5"
    bad.write_bytes(b"not hdf5")        # in the third chunk: its child fails, the parent says why
    with pytest.raises(BadInput, match="rank_00001.h5: not a readable HDF5 file"):
        read_trajectory(open_store(path), jobs=3)
    # the older layout: a group of one dataset per column
    with RunWriter(tmp_path / "old", rank=0, meta={"framework": "megatron-core"}) as w:
        for s in (1, 2):
            w.put_array(s, "local_norm/name", np.array(["a", "b"], dtype=object))
            w.put_array(s, "local_norm/norm", np.array([1.0, 2.0 * s]))
            w.finish_step()
    assert read_trajectory(open_store(tmp_path / "old")).values.tolist() == [[1.0, 2.0], [1.0, 4.0]]
    # a log's named norms (TrainingStateMonitor lines, one table per step; msrun ranks: the lowest wins)
    tables = {s: pd.DataFrame({"name": ["x", "y", "x"], "norm": [1.0 * s, 2.0, 9.0], "rank": [1, 0, 0]})
              for s in (1, 2)}
    log = read_trajectory(Run("log", "mindformers_log", local_norms=tables))
    assert [dict(zip(log.names, row, strict=True)) for row in log.values.tolist()] == [{"x": 9.0, "y": 2.0}] * 2


@pytest.mark.parametrize("what", ["norm_text", "name_int", "lengths", "norm_2d", "no_norm", "not_a_table",
                                  "truncated"])
def test_bad_norm_table_late_in_the_run_is_bad_input(what: str, baseline: tuple[Path, Path], tmp_path: Path
                                                      ) -> None:
    """A step file far from step 1 (only the whole-run stages read it) with a broken norm table: one line
    naming the file (BadInput: `align report` exits 2 with it)."""
    import shutil

    import h5py

    from core.errors import BadInput

    b, rep = baseline
    c = tmp_path / "c"
    shutil.copytree(b, c)
    f = next((c / "steps").glob("step_*30/rank_00000.h5"))
    text = h5py.string_dtype()
    cols = {"norm_text": {"name": np.array(["a", "b"], dtype=text), "norm": np.array(["x", "y"], dtype=text)},
            "name_int": {"name": np.array([1, 2]), "norm": np.array([1.0, 2.0])},
            "lengths": {"name": np.array(["a"], dtype=text), "norm": np.array([1.0, 2.0])},
            "norm_2d": {"name": np.array(["a", "b"], dtype=text), "norm": np.ones((2, 3))},
            "no_norm": {"name": np.array(["a", "b"], dtype=text)}}.get(what)
    if what == "truncated":
        f.write_bytes(f.read_bytes()[:1000])
    else:
        with h5py.File(f, "r+") as h5:
            del h5["local_norm"]
            if what == "not_a_table":
                h5["local_norm"] = np.ones(3)
            else:
                for k, v in cols.items():
                    h5[f"local_norm/{k}"] = v
    with pytest.raises(BadInput, match=r"step_0*30/rank_00000\.h5") as exc:
        stages(b, c, [rep], ["norm_trajectories"])
    assert "\n" not in str(exc.value)
