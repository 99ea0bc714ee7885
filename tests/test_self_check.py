"""The evidence self-check (comparators.evidence_totals, stage evidence_totals): each run's named norms,
recombined as the comparators recombine them, give back the run's own global grad norm; a dropped rank table, a
TP-duplicated parameter counted twice or an expert renamed onto another index fails, naming the cause.

Real megatron-core stores (one 2-process launch of tests/megatron_layouts_worker.py, the layouts the layout
tests build: DP with the distributed optimizer, TP, PP, VPP, EP (DP=2), SP, CP) and MindFormers rank
stores written through the real dumper path for the layouts MindSpore cannot run on CPU (DP, TP, PP, EP,
optimizer parallel: tests/helpers/mindformers_layouts.rank_norms, MindSpore's own slicing)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from comparators.evidence_totals import U32, check_side, tolerance
from runstore import open_store

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "megatron_layouts_worker.py"
TWO = ("distopt", "tp2", "pp2", "vpp", "ep2", "sp", "cp2")
NORM = "decoder.layers.0.input_layernorm.weight"


def _launch(out: Path, scenarios: tuple[str, ...], nproc: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = [str(WORKER), "--out", str(out), "--scenarios", ",".join(scenarios)]
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("self_check")
    _launch(out, TWO, 2)     # one launch: the one-process layouts add nothing the self-check reads differently
    return out


def _edit_tables(store: Path, rank: int, fn) -> None:
    """Rewrite ``rank``'s local_norm table in every step file (``fn(records) -> records``, None: drop it)."""
    for f in sorted(store.glob(f"steps/step_*/rank_{rank:05d}.h5")):
        with h5py.File(f, "r+") as h5:
            attrs, rec = dict(h5["local_norm"].attrs), h5["local_norm"][...]
            del h5["local_norm"]
            rec = fn(rec)
            if rec is not None:
                ds = h5.create_dataset("local_norm", data=rec)
                for k, v in attrs.items():
                    ds.attrs[k] = v


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _mark_sliced(name: str):
    def fn(rec):
        rec["tp_partition_dim"][rec["name"] == name.encode()] = 0
        return rec
    return fn


def _rename(old: str, new: str):
    def fn(rec):
        names = [new.encode() if n == old.encode() else n for n in rec["name"]]
        rec["name"] = np.array(names, dtype=rec.dtype["name"])
        return rec
    return fn


def _check(path: Path):
    run = open_store(path)
    from comparators.trajectories import read_trajectory
    return check_side(run, "candidate", trajectory=read_trajectory(run, "local_norm"))


def test_tolerance_is_float32_summation_noise() -> None:
    assert tolerance(2 ** 17, 30) == pytest.approx((34 + 30) * U32)
    assert tolerance(2 ** 17, 30, printed=True) == pytest.approx((34 + 30 + 2) * U32)
    assert 1e-6 < tolerance(7 * 10 ** 9, 3000) < 3e-4          # a 7B model's 3000 rows: still sharp


@pytest.mark.parametrize("name", TWO)
def test_megatron_layouts_recombine_to_the_optimizers_grad_norm(megatron: Path, name: str) -> None:
    chk = _check(megatron / name)
    assert chk.status == "pass", (name, chk.why, [c.to_json() for c in chk.failed])
    assert chk.steps == [1, 2] and chk.source.startswith("Megatron's optimizer"), name
    assert chk.worst.rel <= 2e-7 < chk.worst.tolerance, name        # measured <= 6.1e-8, line ~3e-6
    assert "world size 2" in chk.layout


@pytest.mark.parametrize("name", ["tp2", "pp2", "vpp", "distopt", "sp", "ep2"])
def test_megatron_rank_table_dropped_fails_naming_the_rank(megatron: Path, tmp_path: Path, name: str) -> None:
    store = _copy(megatron / name, tmp_path / name)
    _edit_tables(store, 1, lambda rec: None)
    chk = _check(store)
    assert chk.status == "fail" and chk.failed_steps == {1, 2}, name
    first = chk.failed[0]
    assert first.recombined < first.recorded and first.rel > 100 * first.tolerance, name
    assert first.causes[0].startswith("rank 1 absent"), (name, first.causes)
    if name in ("tp2", "sp"):
        assert any(c.startswith("TP shards 1 missing") for c in first.causes), first.causes
    if name == "distopt":
        assert any("distributed-optimizer parts of DP ranks 1" in c for c in first.causes), first.causes


def test_megatron_cp_replica_dropped_changes_nothing(megatron: Path, tmp_path: Path) -> None:
    """CP ranks hold replicas of every gradient: rank 1's table adds nothing, so without it the total still
    agrees (no false fail); the layout names the CP=2 run."""
    store = _copy(megatron / "cp2", tmp_path / "cp2")
    _edit_tables(store, 1, lambda rec: None)
    chk = _check(store)
    assert chk.status == "pass" and "cp=2" in chk.layout


@pytest.mark.parametrize("name", ["tp2", "sp"])
def test_megatron_tp_duplicate_counted_twice_is_named(megatron: Path, tmp_path: Path, name: str) -> None:
    """The norm weight (whole on every TP rank) recorded as TP-sliced: summed over TP it is counted twice; the
    total moves by 3.7e-5 relative, 10x the line, and the cause names it."""
    store = _copy(megatron / name, tmp_path / name)
    for rank in (0, 1):
        _edit_tables(store, rank, _mark_sliced(NORM))
    chk = _check(store)
    assert chk.status == "fail" and chk.failed[0].recombined > chk.failed[0].recorded
    assert any(c.startswith(f"a duplicated TP parameter counted 2 times: {NORM}") for c in chk.failed[0].causes), \
        chk.failed[0].causes


@pytest.mark.parametrize("name, rank", [("ep2", 1)])
def test_megatron_expert_renamed_onto_another_index_is_named(megatron: Path, tmp_path: Path, name: str,
                                                             rank: int) -> None:
    """Expert 3's gradient recorded under expert 2's name (on the EP rank holding both): the recombination keeps
    one as a replica of the other and the total drops; the cause names the collision."""
    fc1 = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    store = _copy(megatron / name, tmp_path / name)
    _edit_tables(store, rank, _rename(fc1.format(3), fc1.format(2)))
    chk = _check(store)
    assert chk.status == "fail" and chk.failed[0].recombined < chk.failed[0].recorded, name
    assert any(f"two different gradients recorded as {fc1.format(2)}" in c and "expert renamed" in c
               for c in chk.failed[0].causes), chk.failed[0].causes


def test_report_skips_judging_named_norms_on_a_failed_self_check(megatron: Path, tmp_path: Path) -> None:
    """`align report`: the self-check fails first in the diagnosis; step-1 local norms are not judged (no false
    pass, no false fail) and say why; the other stages run as before."""
    from align.cli import main

    store = _copy(megatron / "tp2", tmp_path / "bad")
    for rank in (0, 1):
        _edit_tables(store, rank, _mark_sliced(NORM))
    # the DP=2 distributed-optimizer store as the baseline (no layer tensors: the layer stage has nothing to read)
    rc = main(["report", "-q", str(megatron / "distopt"), str(store), "--out", str(tmp_path / "r")])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert rc == 1 and s["stages"]["evidence_totals"]["verdict"] == "fail"
    assert s["stages"]["evidence_totals"]["baseline"]["status"] == "pass"
    assert s["diagnosis"][0]["stage"] == "evidence_totals" and s["diagnosis"][0]["component"] == "candidate"
    norms = s["stages"]["step1_local_norm"]
    assert norms["verdict"] == "skipped" and norms["reason"].startswith("not judged: the candidate's named norms")
    assert s["stages"]["step1_loss"]["verdict"] == "pass"
    # the clean pair: the self-check passes on both sides and the named norms are judged
    rc = main(["report", "-q", str(megatron / "distopt"), str(megatron / "tp2"), "--out", str(tmp_path / "ok")])
    s = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert rc == 0 and s["stages"]["evidence_totals"]["verdict"] == "pass"
    assert s["stages"]["step1_local_norm"]["verdict"] == "pass"


# -- MindFormers layouts MindSpore cannot run on CPU: rank stores through the real dumper path -----------------

def _mcore_grads(experts: int = 0) -> dict[str, np.ndarray]:
    """Gradients of a 2-layer mcore model by MindFormers name (random: only their norms and slices matter)."""
    rng = np.random.default_rng(0)
    h, f, v = 8, 16, 32
    shapes = {"embedding.word_embeddings.weight": (v, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (v, h)}
    for layer in range(2):
        p = f"decoder.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (3 * h, h),
                       p + "self_attention.linear_proj.weight": (h, h), p + "pre_mlp_layernorm.weight": (h,)})
        if experts:
            shapes.update({p + "mlp.router.weight": (experts, h), p + "mlp.experts.weight1": (experts * h, 2 * f),
                           p + "mlp.experts.weight2": (experts * f, h)})
        else:
            shapes.update({p + "mlp.linear_fc1.weight": (2 * f, h), p + "mlp.linear_fc2.weight": (h, f)})
    return {n: rng.standard_normal(s).astype(np.float32) * rng.uniform(0.01, 1) for n, s in shapes.items()}


def _mindformers_store(root: Path, strategy, grads: dict[str, np.ndarray]) -> Path:
    """Every rank's store as MindFormersDumperCallback writes it, with the training cell's global norm."""
    from dumpers.mindformers import record_mindformers_norms
    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper
    from tests.helpers.mindformers_layouts import rank_norms

    norms = {n: float(np.sqrt(np.sum(g.astype(np.float64) ** 2))) for n, g in grads.items()}
    total = math.sqrt(sum(v * v for v in norms.values()))
    for rank in range(strategy.world):
        d = MindSporeDumper(None, root, DumpConfig(steps=[1, 2]), rank=rank, world_size=strategy.world,
                            framework="mindformers", name_scheme="mindformers_mcore")
        named, sizes = rank_norms(strategy, rank, norms, grads)
        for step in (1, 2):
            d.begin_step(step)
            record_mindformers_norms(d, named, sizes, strategy=strategy, global_norm=float(np.float32(total)),
                                     shapes={n: g.shape for n, g in grads.items()})
            d.end_step(loss=2.0)
        d.close()
    return root


def _mf_layouts():
    from models.mindformers_parallel import ParallelStrategy
    return {"dp2": (ParallelStrategy(dp=2, num_layers=2), 0), "tp2": (ParallelStrategy(tp=2, num_layers=2), 0),
            "pp2": (ParallelStrategy(pp=2, num_layers=2, micro_batch_num=2), 0),
            "dp2_tp2_optpar": (ParallelStrategy(dp=2, tp=2, optimizer_parallel=True, num_layers=2), 0),
            "ep2": (ParallelStrategy(dp=2, ep=2, num_layers=2), 4)}


def test_mindformers_layouts_recombine_to_the_training_cells_norm(tmp_path: Path) -> None:
    """Every layout's readers (the step-1 comparison's and the whole-run trajectory reader) give the training
    cell's norm back. PP=2: each rank writes a zero row for every parameter of the other stage; both readers
    drop them (parallel.layer_stages: the trajectory reader kept them until the self-check showed it)."""
    pytest.importorskip("mindspore")
    for label, (strategy, experts) in _mf_layouts().items():
        store = _mindformers_store(tmp_path / label, strategy, _mcore_grads(experts))
        chk = _check(store)
        assert chk.source.startswith("MindFormers' training cell") and chk.steps == [1, 2], label
        assert chk.status == "pass" and chk.worst.rel < 1e-6, (label, [c.to_json() for c in chk.failed])


@pytest.mark.parametrize("label, rank", [("tp2", 1), ("pp2", 1), ("dp2_tp2_optpar", 3), ("ep2", 1)])
def test_mindformers_rank_table_dropped_fails_naming_the_rank(tmp_path: Path, label: str, rank: int) -> None:
    pytest.importorskip("mindspore")
    strategy, experts = _mf_layouts()[label]
    store = _mindformers_store(tmp_path / label, strategy, _mcore_grads(experts))
    _edit_tables(store, rank, lambda rec: None)
    chk = _check(store)
    assert chk.status == "fail", label
    assert chk.failed[0].causes[0].startswith(f"rank {rank} absent"), (label, chk.failed[0].causes)


def test_mindformers_tp_duplicate_counted_twice_is_named(tmp_path: Path) -> None:
    pytest.importorskip("mindspore")
    strategy, _ = _mf_layouts()["tp2"]
    store = _mindformers_store(tmp_path / "tp2", strategy, _mcore_grads())

    def sliced(rank: int):    # the norm weight (whole on each TP rank: slice 0 of 1) recorded as slice r of 2
        def fn(rec):
            hit = rec["name"] == NORM.encode()
            rec["tp_partition_dim"][hit], rec["tp_rank"][hit], rec["tp_size"][hit] = 0, rank, 2
            return rec
        return fn
    for rank in (0, 1):
        _edit_tables(store, rank, sliced(rank))
    chk = _check(store)
    assert chk.status == "fail" and chk.failed[0].recombined > chk.failed[0].recorded
    assert any(c.startswith(f"a duplicated TP parameter counted 2 times: {NORM}") for c in chk.failed[0].causes), \
        chk.failed[0].causes


def test_unchecked_when_the_total_is_not_independent(tmp_path: Path) -> None:
    """A store whose global norm the dumper computed from the same named norms checks nothing: unchecked, said
    why, and the stages judge the named norms as before."""
    pytest.importorskip("mindspore")
    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper

    d = MindSporeDumper(None, tmp_path / "s", DumpConfig(steps=[1]), rank=0, world_size=1, framework="mindformers")
    d.begin_step(1)
    d.record_local_norms(["a.weight", "b.weight"], np.array([3.0, 4.0]), [4, 4])
    d.end_step(loss=1.0)
    d.close()
    chk = check_side(open_store(tmp_path / "s"), "candidate")
    assert chk.status == "unchecked" and "computed by the dumper from these same named norms" in chk.why
    assert chk.trusted(1)


def test_batch_rows_against_the_recorded_global_batch(megatron: Path, tmp_path: Path) -> None:
    """The samples a store recorded per step (DP ranks' batches, PP stages joined, CP chunks once) against the
    global batch size of its Megatron arguments: DP=2, PP=2 and CP=2 hold all 4; DP rank 1's batches dropped, the
    stage fails naming that DP rank."""
    from align.stages import Evidence, Inputs, run_stages

    def stage(name: str, drop: bool = False) -> dict:
        store = _copy(megatron / name, tmp_path / f"{name}{int(drop)}")
        meta = json.loads((store / "meta.json").read_text())
        meta["config"]["values"]["global_batch_size"] = 4
        (store / "meta.json").write_text(json.dumps(meta))
        if drop:
            for f in store.glob("steps/step_*/rank_00001.h5"):
                with h5py.File(f, "r+") as h5:
                    del h5["batch"]
        res = run_stages(Evidence.load(Inputs(str(megatron / "tp2"), str(store))), only=["evidence_totals"])
        return res["evidence_totals"]

    for name in ("distopt", "pp2", "cp2"):
        st = stage(name)
        assert st.details["batches"]["candidate"]["status"] == "pass", (name, st.details["batches"])
        assert st.details["batches"]["candidate"]["steps_checked"] == 2
    st = stage("distopt", drop=True)
    bad = [f for f in st.findings if f.metric == "batch_rows_vs_global_batch" and f.verdict == "fail"]
    assert [(f.component, f.value, f.threshold) for f in bad] == [("candidate", 2, 4)]
    assert "DP rank(s) 1 of 2 hold no batch" in bad[0].message
    assert st.details["batches"]["baseline"]["why"] == "no global batch size in the run's config"


def _mindformers_log(path: Path, drop: str | None = None) -> Path:
    """A MindFormers log with TrainingStateMonitor's named norms and MFLossMonitor's global_norm, 3 steps."""
    from tests.helpers.mindformers_layouts import PREFIX

    rng = np.random.default_rng(0)
    names = ["embedding.word_embeddings.weight", NORM, "decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"]
    lines = []
    for step in (1, 2, 3):
        norms = {n: float(np.float32(rng.uniform(0.1, 2))) for n in names}
        total = math.sqrt(sum(v * v for v in norms.values()))
        lines += [PREFIX.format(line=1496) + f"Epoch:[  1/  1], step:[    {step}/    3] local_norm/{n}: {np.float32(v)}"
                  for n, v in norms.items() if n != drop]
        lines.append(PREFIX.format(line=747) + f"{{ Epoch:[  1/  1], step:[    {step}/    3], "
                     "loss:[2.000000/2.000000], per_step_time: 886ms, lr: 0.0001, overflow cond: False, "
                     f"loss_scale: 1.0, global_norm: [{np.float32(total)}], train_throughput_per_npu: 2.257T")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mindformers_log_named_norms_against_its_global_norm(tmp_path: Path) -> None:
    """A log's named norms (printed float32) against the same log's global_norm: within the printed line; a
    parameter's lines missing, the deficit is named as the size of one parameter without a row."""
    from comparators.trajectories import read_trajectory
    from sources import load_run

    run = load_run(_mindformers_log(tmp_path / "ok.log"))
    chk = check_side(run, "candidate", trajectory=read_trajectory(run, "local_norm"))
    assert chk.status == "pass" and chk.steps == [1, 2, 3] and chk.source.startswith("the log's global grad norm")
    assert chk.worst.rel < 1e-7 < chk.worst.tolerance
    run = load_run(_mindformers_log(tmp_path / "bad.log", drop=NORM))
    chk = check_side(run, "candidate", trajectory=read_trajectory(run, "local_norm"))
    assert chk.status == "fail" and chk.failed_steps == {1, 2, 3}
    assert "holds less than the recorded total" in chk.failed[0].causes[-1]
