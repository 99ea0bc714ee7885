"""Replay onto another data-parallel layout (issue 37): the baseline step's global batch re-split by sample.

Run stores written as Megatron's dumper writes them (one file per rank, ``dp_rank`` in the rank file, a
``micro_batches`` attribute on the stacked batch), replayed by :class:`dumpers.mindformers_replay.ReplaySource`
at other DP sizes (8 -> 4 -> 1, 1 -> 2); the data stage's per-sample check passes on the faithful replay and
names the step and sample of each fault planted in it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindformers")

from align.checks.data import compare_batches  # noqa: E402
from core.errors import BadInput  # noqa: E402
from dumpers.mindformers_replay import ReplaySource, replayed_samples  # noqa: E402
from runstore import RunWriter  # noqa: E402
from runstore.batches import global_batch, sample_hashes, sampler_positions  # noqa: E402

SEQ, VOCAB, STEPS = 8, 50, (1, 2)
COLUMNS = ("input_ids", "labels", "loss_mask")


def global_batches(total: int, seed: int = 3) -> dict[int, dict[str, np.ndarray]]:
    """Each step's global batch in sampler order: shifted tokens / labels, a mask with a masked prefix."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in STEPS:
        seq = rng.integers(0, VOCAB, size=(total, SEQ + 1))
        mask = np.ones((total, SEQ), np.float32)
        mask[np.arange(total), rng.integers(0, SEQ, total)] = 0.0
        out[step] = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": mask}
    return out


def write_store(root: Path, batches: dict[int, dict[str, np.ndarray]], dp: int, micro: int,
                keys: tuple[str, ...] = ("tokens", "labels", "loss_mask")) -> Path:
    """A run store at ``dp`` ranks of ``micro`` micro-batches each, every rank holding its sampler share."""
    for rank in range(dp):
        with RunWriter(root, rank=rank, meta={"framework": "megatron-core", "parallel": {"dp": dp}},
                       rank_info={"dp_rank": rank, "tp_rank": 0, "pp_rank": 0}) as w:
            for step, whole in batches.items():
                index = sampler_positions(len(whole["tokens"]), dp, rank, micro)
                for k in keys:
                    w.put_array(step, f"batch/{k}", whole[k][index], {"micro_batches": micro})
                w.finish_step()
    return root


def replay(store: Path, dp: int, micro: int | None = None) -> list[dict[int, dict[str, np.ndarray]]]:
    """Every candidate DP rank's rows per step, as MegatronReplayDataset hands them to the network, with the
    replay's plan of each step (``replayed_samples``) beside them."""
    out = []
    for rank in range(dp):
        src = ReplaySource(store, data_parallel=dp, dp_rank=rank, micro_batches=micro, columns=COLUMNS)
        src.check_all()
        rows = {}
        for i, step in enumerate(src.steps, 1):
            rows[step] = {**src.batch(step), **replayed_samples(i)}
        out.append(rows)
    return out


def candidate_store(root: Path, replayed: list[dict[int, dict[str, np.ndarray]]]) -> Path:
    """What MindFormersDumperCallback records on each candidate rank: the columns, the plan, its own hashes."""
    for rank, steps in enumerate(replayed):
        with RunWriter(root, rank=rank, meta={"framework": "mindformers"}, rank_info={"dp_rank": rank}) as w:
            for step, b in steps.items():
                for k, v in b.items():
                    w.put_array(step, f"batch/{k}", v, {"micro_batches": 1})
                w.put_array(step, "batch/sample_hash", sample_hashes(b), {"micro_batches": 1})
                w.finish_step()
    return root


def test_sampler_positions_invert_global_batch_for_8_4_2_1() -> None:
    """Megatron's sampler split (micro-batch m of DP rank d = samples (m x DP + d) x mbs ..) and
    runstore.batches.global_batch are inverses for every layout of 16 samples."""
    whole = np.arange(16)
    for dp, micro in ((8, 2), (4, 4), (4, 1), (2, 2), (1, 16)):
        parts = [({"x": whole[sampler_positions(16, dp, d, micro)]}, micro) for d in range(dp)]
        np.testing.assert_array_equal(global_batch(parts)["x"], whole)
    assert sampler_positions(16, 4, 1, 2).tolist() == [2, 3, 10, 11]
    with pytest.raises(ValueError, match="does not split"):
        sampler_positions(16, 3, 0, 1)


def test_dp8_to_dp4_to_dp1_replays_every_sample_once_in_order(tmp_path: Path) -> None:
    whole = global_batches(16)
    dp8 = write_store(tmp_path / "dp8", whole, dp=8, micro=2)          # mbs 1, 2 micro-batches per rank
    at4 = replay(dp8, 4)                 # default micro-batches keep mbs 1: 4 per rank
    for rank, steps in enumerate(at4):
        for step, b in steps.items():
            index = sampler_positions(16, 4, rank, 4)
            np.testing.assert_array_equal(b["sample_index"], index)
            np.testing.assert_array_equal(b["input_ids"], whole[step]["tokens"][index])
            np.testing.assert_array_equal(b["loss_mask"], whole[step]["loss_mask"][index])
            np.testing.assert_array_equal(b["replay_hash"], sample_hashes(whole[step])[index])
            assert b["input_ids"].dtype == np.int32 and (b["sample_step"] == step).all()
    # the DP=4 candidate's store (as its dumper records it) replays in turn onto DP=1
    dp4 = candidate_store(tmp_path / "dp4", at4)
    assert compare_batches(dp8, dp4).findings[0].metric == "same_samples"
    (at1,) = replay(write_store(tmp_path / "dp4_as_megatron", whole, dp=4, micro=4), 1)
    for step, b in at1.items():
        np.testing.assert_array_equal(b["input_ids"], whole[step]["tokens"])        # the global batch, in order
        np.testing.assert_array_equal(b["labels"], whole[step]["labels"])
        np.testing.assert_array_equal(b["sample_index"], np.arange(16))
    res = compare_batches(dp8, candidate_store(tmp_path / "dp1", [at1]))
    assert res.verdict == "pass" and res.details["samples_compared"] == 32, res.findings
    assert res.details["dp_ranks"] == [8, 1]


def test_dp1_seed_layout_to_dp2_and_micro_batches(tmp_path: Path) -> None:
    """A seed layout (step_N/rank_R npy folders, one DP rank) onto DP=2: rank 0 samples 0-1, rank 1 samples 2-3;
    with 2 micro-batches a rank takes samples (m x 2 + d): the sampler order of that layout."""
    whole = global_batches(4)
    for step, b in whole.items():
        folder = tmp_path / "seed" / f"step_{step}" / "rank_0"
        folder.mkdir(parents=True)
        for k, v in b.items():
            np.save(folder / f"{k}.npy", v, allow_pickle=False)
    r0, r1 = replay(tmp_path / "seed", 2)
    np.testing.assert_array_equal(r0[1]["input_ids"], whole[1]["tokens"][:2])
    np.testing.assert_array_equal(r1[2]["labels"], whole[2]["labels"][2:])
    m0, m1 = replay(tmp_path / "seed", 2, micro=2)
    assert m0[1]["sample_index"].tolist() == [0, 2] and m1[1]["sample_index"].tolist() == [1, 3]
    np.testing.assert_array_equal(m1[1]["input_ids"], whole[1]["tokens"][[1, 3]])


def test_layouts_that_do_not_divide_or_lack_a_rank_are_refused_in_one_line(tmp_path: Path) -> None:
    store = write_store(tmp_path / "dp2", global_batches(4), dp=2, micro=1)
    with pytest.raises(BadInput, match=r"step_00000001: the global batch of 4 samples does not split into "
                                       r"data_parallel 3"):
        ReplaySource(store, data_parallel=3, dp_rank=0, columns=COLUMNS).check_all()
    with pytest.raises(BadInput, match="data-parallel rank 2 is not below data_parallel 2"):
        ReplaySource(store, data_parallel=2, dp_rank=2, columns=COLUMNS)
    with pytest.raises(BadInput, match="data_parallel='two'"):
        ReplaySource(store, data_parallel="two", columns=COLUMNS)
    (store / "steps" / "step_00000002" / "rank_00001.h5").unlink()
    with pytest.raises(BadInput, match=r"step_00000002: rank\(s\) \[1\] missing from step 2"):
        ReplaySource(store, data_parallel=1, dp_rank=0, columns=COLUMNS)


@pytest.mark.parametrize("fault, expect", [
    ("drop_rank", "sample(s) [2, 3] of baseline step 1's 4 never arrived"),
    ("twice", "sample 0 of baseline step 1 arrived twice (DP ranks 0 and 1)"),
    ("other_step", "step 1: the row DP rank 1 trained as sample 2 differs from the baseline's sample 2 of step 1 "
                   "(tokens)"),
    ("swap", "step 2: DP rank 0 of 2 trained samples [1, 0] of baseline step 2: not the order"),
    ("step_again", "step 2: the candidate trained baseline step 1's samples; the runs' steps are not aligned"),
])
def test_each_replay_fault_is_named_by_step_and_sample(fault: str, expect: str, tmp_path: Path) -> None:
    whole = global_batches(4)
    base = write_store(tmp_path / "base", whole, dp=1, micro=1)
    r0, r1 = replay(base, 2)
    if fault == "drop_rank":          # candidate DP rank 1's file of step 1 lost: ranks present 0 only
        r1 = {2: r1[2]}
    elif fault == "twice":
        r1[1] = {k: v.copy() for k, v in r0[1].items()}
    elif fault == "other_step":       # rank 1 trained step 2's rows at step 1 under step 1's plan
        r1[1] = {**r1[1], "input_ids": r1[2]["input_ids"], "labels": r1[2]["labels"],
                 "loss_mask": r1[2]["loss_mask"], "replay_hash": r1[1]["replay_hash"]}
    elif fault == "step_again":       # both ranks trained step 1's rows again at step 2, plan and all
        r0[2], r1[2] = r0[1], r1[1]
    elif fault == "swap":             # rank 0's two samples of step 2 in the other order, plan and all
        r0[2] = {k: v[::-1].copy() for k, v in r0[2].items()}
    res = compare_batches(base, candidate_store(tmp_path / "cand", [r0, r1]))
    (finding,) = [f for f in res.findings if f.verdict == "fail"]
    assert expect in finding.message and finding.metric == "sample_differs", finding.message


@pytest.mark.parametrize("dp, gbs, status", [(2, 4, "match"), (4, 4, "match"), (3, 4, "mismatch")])
def test_checklist_compares_the_global_batch_of_a_re_split_replay(dp: int, gbs: int, status: str,
                                                                  tmp_path: Path) -> None:
    """A DP=1 baseline of 4 samples a step replayed under msrun at another DP: the candidate's global batch is the
    store's 4 samples (re-split), not 4 per rank x DP; a DP that does not divide them is a mismatch."""
    import yaml

    from align.checks.config import compare_configs
    from demo.mindformers_cpu import trainer_config
    from sources.configs import read_mindformers

    store = write_store(tmp_path / "dp1", global_batches(4), dp=1, micro=1)
    cfg = trainer_config(str(store), steps=2, output_dir=str(tmp_path / "out"))
    cfg["use_parallel"] = True
    cfg["parallel_config"]["data_parallel"] = dp
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    megatron = {"global_batch_size": gbs, "micro_batch_size": 4, "seq_length": SEQ, "data_parallel_size": 1}
    rows, _ = compare_configs(megatron, read_mindformers(tmp_path / "train.yaml"))
    row = {r.key: r for r in rows}["global_batch_size"]
    assert row.status == status, row
    assert f"global batch of 4 samples (4 per rank x its data parallel 1) re-split by sample over data_parallel {dp}" \
        in row.note
    if status == "match":
        assert row.mindformers == 4
