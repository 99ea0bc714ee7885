"""check-data on batches built by Megatron-core's own mask code (megatron/core/datasets/gpt_dataset.py):
pad id == eos id masks every EOD; a cached loss mask mutated in place (the `.clone()` dropped) shrinks."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from align.checks import data as cd
from align.cli import check_data
from runstore import RunWriter

VOCAB, EOS, SEQ, MBS = 100, 2, 32, 4


def documents(rng: np.random.Generator, n_tokens: int) -> np.ndarray:
    """A packed token stream: documents of random length, each ending in EOS."""
    out = []
    while sum(map(len, out)) < n_tokens:
        out.append(np.r_[rng.integers(3, VOCAB, rng.integers(5, 20)), EOS])
    return np.concatenate(out)[:n_tokens]


def megatron_batches(steps: int, pad_id: int, mutate_cache: bool, tail_pad: bool = False):
    """Per step: what GPTDataset.__getitem__ returns (same statements, numpy in, torch ops for the masks)."""
    torch = pytest.importorskip("torch")
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    rng = np.random.default_rng(0)
    cached = None
    for step in range(1, steps + 1):
        toks, labs, masks = [], [], []
        for _ in range(MBS):
            text = torch.from_numpy(documents(rng, SEQ + 1)).long()
            if tail_pad:     # padding between packed pieces, at a different place in every sample
                k = int(rng.integers(0, SEQ - 2))
                text[k:k + 2] = pad_id
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
            if cached is None:
                _, loss_mask, _ = gpt_dataset._get_ltor_masks_and_position_ids(
                    tokens, EOS, False, False, False, True)
                cached = loss_mask
            loss_mask = cached if mutate_cache else cached.clone()
            loss_mask[labels == pad_id] = 0.0
            tokens[tokens == pad_id] = 0
            labels[labels == pad_id] = 0
            toks.append(tokens.numpy().copy())
            labs.append(labels.numpy().copy())
            masks.append(loss_mask.numpy().copy())
        yield step, 0, {"tokens": np.stack(toks), "labels": np.stack(labs), "loss_mask": np.stack(masks)}


def _write_store(root: Path, batches) -> Path:
    with RunWriter(root, rank=0, meta={"framework": "megatron-core"}) as w:
        for step, _, b in batches:
            for k, v in b.items():
                w.put_array(step, f"batch/{k}", v)
    return root


def _cli(path: Path, *extra: str, ids: bool = True) -> tuple[int, dict]:
    """`align check-data PATH` with this file's --vocab-size / --eos-id (``ids``) and ``extra``."""
    p = argparse.ArgumentParser()
    check_data.add_arguments(p)
    out = path.parent / "data.json"
    given = ["--vocab-size", str(VOCAB), "--eos-id", str(EOS)] if ids else []
    rc = check_data.run(p.parse_args([str(path), *given, *extra, "--json", str(out)]))
    return rc, json.loads(out.read_text())


def test_clean_data_passes(tmp_path: Path) -> None:
    store = _write_store(tmp_path / "clean", megatron_batches(5, pad_id=1, mutate_cache=False, tail_pad=True))
    rc, rep = _cli(store, "--pad-id", "1")
    assert rc == 0 and rep["verdict"] == "pass", rep["findings"]
    assert rep["eod_trained"] > 0


def test_pad_equals_eos_masks_every_eod(tmp_path: Path) -> None:
    store = _write_store(tmp_path / "padeos", megatron_batches(3, pad_id=EOS, mutate_cache=False))
    rc, rep = _cli(store, "--pad-id", str(EOS))
    assert rc == 1
    assert [f["metric"] for f in rep["findings"]] == ["eod_never_trained"]


def test_shrinking_loss_mask_seed_layout(tmp_path: Path) -> None:
    root = tmp_path / "seed"
    with RunWriter(root, rank=0) as w:
        for step, _, b in megatron_batches(6, pad_id=1, mutate_cache=True, tail_pad=True):
            w.write_seed_batch(step, b)
    rc, rep = _cli(root, "--pad-id", "1")
    assert rc == 1
    metrics = [f["metric"] for f in rep["findings"]]
    assert metrics == ["loss_mask_shrinking"], rep["findings"]
    sums = [s["loss_mask_sum"] for s in rep["steps"]]
    assert sums == sorted(sums, reverse=True) and sums[-1] < sums[0]


def test_ids_labels_and_empty_samples(tmp_path: Path) -> None:
    b = next(megatron_batches(1, pad_id=1, mutate_cache=False))[2]
    b["tokens"][0, 3] = VOCAB + 5
    b["labels"][1] = np.roll(b["labels"][1], 1)        # shifted twice on one sample
    b["loss_mask"][2] = 0
    res = cd.check_batches([(1, 0, b)], vocab_size=VOCAB, eos_id=EOS, pad_id=1)
    got = {f.metric for f in res.findings}
    assert {"token_id_out_of_range", "labels_not_shifted_tokens", "all_masked_samples"} <= got


# --- issue 24: never silently wrong ----------------------------------------------------------------------
def _clean(step: int) -> dict:
    tokens = (np.arange(SEQ * 2).reshape(2, SEQ) + step) % (VOCAB - 3) + 3
    labels = np.roll(tokens, -1, axis=1)
    return {"tokens": tokens, "labels": labels, "loss_mask": np.ones_like(tokens, dtype=np.float32)}


def _seed_dump(root: Path, layout: dict[int, list[int]], edit=None) -> Path:
    for step, ranks in layout.items():
        for rank in ranks:
            d = root / f"step_{step}" / f"rank_{rank}"
            d.mkdir(parents=True)
            b = _clean(step)
            if edit:
                edit(step, rank, b)
            for k, v in b.items():
                np.save(d / f"{k}.npy", v)
    return root


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0])
@pytest.mark.parametrize("layout", ["seed", "store"])
def test_loss_mask_nan_inf_negative_fail(tmp_path: Path, bad: float, layout: str) -> None:
    def edit(step: int, rank: int, b: dict) -> None:
        if step == 2 and rank == 1:
            b["loss_mask"][1, 5] = bad
    if layout == "seed":
        root = _seed_dump(tmp_path / "d", {1: [0, 1], 2: [0, 1], 3: [0, 1]}, edit)
    else:
        root = tmp_path / "d"
        for rank in (0, 1):
            with RunWriter(root, rank=rank) as w:
                for step in (1, 2, 3):
                    b = _clean(step)
                    edit(step, rank, b)
                    for k, v in b.items():
                        w.put_array(step, f"batch/{k}", v)
    rc, rep = _cli(root)
    bad_rows = [f for f in rep["findings"] if f["metric"] == "loss_mask_invalid"]
    assert rc == 1 and len(bad_rows) == 1 and bad_rows[0]["verdict"] == "fail", rep["findings"]
    assert "step 2 rank 1" in bad_rows[0]["message"] and ("rank_1" in bad_rows[0]["message"]
                                                          or "rank_00001" in bad_rows[0]["message"])


def test_missing_rank_gap_and_rank_missing_at_one_step(tmp_path: Path) -> None:
    rc, rep = _cli(_seed_dump(tmp_path / "gap", {1: [0, 2], 2: [0, 2]}))
    missing = [f for f in rep["findings"] if f["metric"] == "missing_rank"]
    assert rc == 1 and [f["component"] for f in missing] == ["step 1", "step 2"]
    assert all("[1]" in f["message"] for f in missing)
    rc, rep = _cli(_seed_dump(tmp_path / "one", {1: [0, 1], 2: [0], 3: [0, 1]}))
    missing = [f for f in rep["findings"] if f["metric"] == "missing_rank"]
    assert rc == 1 and [(f["component"], f["value"]) for f in missing] == [("step 2", 1)]


def test_duplicate_steps_fail(tmp_path: Path) -> None:
    root = _seed_dump(tmp_path / "seed", {1: [0], 2: [0]})
    (root / "step_02").mkdir()
    (root / "step_2" / "rank_0").rename(root / "step_02" / "rank_0")
    (root / "step_2" / "rank_0").mkdir()
    for k, v in _clean(2).items():
        np.save(root / "step_2" / "rank_0" / f"{k}.npy", v)
    rc, rep = _cli(root)
    dup = [f for f in rep["findings"] if f["metric"] == "duplicate_step"]
    assert rc == 1 and dup and "step_02" in dup[0]["message"] and "step 2" in dup[0]["message"]
    # a run store: the same step as two folders, and the same step twice in a rank's scalar lines
    store = tmp_path / "store"
    with RunWriter(store, rank=0) as w:
        for step in (1, 2):
            for k, v in _clean(step).items():
                w.put_array(step, f"batch/{k}", v)
            w.log_scalars(step, {"loss": 1.0})
        w.log_scalars(2, {"loss": 2.0})
    rc, rep = _cli(store)
    dup = [f for f in rep["findings"] if f["metric"] == "duplicate_step"]
    assert rc == 1 and len(dup) == 1 and "rank_00000.jsonl:3" in dup[0]["message"]
    src = store / "steps" / "step_00000002"
    (store / "steps" / "step_2").mkdir()
    (src / "rank_00000.h5").rename(store / "steps" / "step_2" / "rank_00000.h5")
    shutil.copy(store / "steps" / "step_2" / "rank_00000.h5", src / "rank_00000.h5")
    rc, rep = _cli(store)
    msgs = [f["message"] for f in rep["findings"] if f["metric"] == "duplicate_step"]
    assert rc == 1 and any("step_00000002" in m and "step_2" in m for m in msgs), msgs


# --- issue 22: the vocabulary is the padded one the model has; the tokenizer's own ids are not padding -----

def mock_data_batches(vocab_size: int, steps: int = 2, seq: int = 64) -> list[tuple[int, int, dict]]:
    """Batches of the data `pretrain_gpt.py --mock-data` trains on: megatron-core's MockGPTDataset tokenized by
    its NullTokenizer (core 0.16: ids 0..vocab_size, the end-of-document id being vocab_size), samples as
    GPTDataset returns them, MBS per step."""
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    cfg = gpt.GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=None, split="1,0,0",
                               reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                               tokenizer=NullTokenizer(vocab_size), mid_level_dataset_surplus=0.005)
    ds = BlendedMegatronDatasetBuilder(gpt.MockGPTDataset, [steps * MBS, None, None], lambda: True, cfg).build()[0]
    out = []
    for step in range(1, steps + 1):
        samples = [ds[i] for i in range((step - 1) * MBS, step * MBS)]
        out.append((step, 0, {k: np.stack([s[k].numpy() for s in samples]) for k in ("tokens", "labels", "loss_mask")}))
    return out


# The tokenizer part of the arguments block a 0.16 pretrain_gpt.py --mock-data run prints (padded_vocab_size
# is still None when the block is printed: the tokenizer is built later).
NULL_ARGS = {"tokenizer_type": "NullTokenizer", "vocab_size": 127, "padded_vocab_size": None,
             "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1}


def test_mock_data_of_a_clean_run_is_in_the_padded_vocabulary() -> None:
    """The clean run of the issue: --vocab-size 127 with the NullTokenizer: id 127 (end of document, and
    MockGPTDataset's ids run 0..127) is in the model's 128 rows; reading 127 as the vocabulary failed it."""
    batches = mock_data_batches(127)
    assert max(int(b["tokens"].max()) for _, _, b in batches) == 127
    ids = cd.megatron_vocabulary(NULL_ARGS)
    assert (ids["vocab_size"], ids["special_ids"]) == (128, [127]) and "tokenizer_vocab_size" not in ids
    res = cd.check_batches(batches, **ids)
    assert res.verdict == "pass", [f.message for f in res.findings]
    old = cd.check_batches(batches, vocab_size=127)       # the arguments' vocab_size as the bound (before)
    assert old.verdict == "fail"


def test_ids_in_padding_rows_warn_beyond_the_padded_vocabulary_fail() -> None:
    """--vocab-size 100: the tokenizer's ids are 0..100, the embedding 128 rows; an id in 101..127 reaches a
    padding row (a warning, with the reason), 128 is outside the model (a failure)."""
    batches = mock_data_batches(100, steps=1)
    ids = cd.megatron_vocabulary({**NULL_ARGS, "vocab_size": 100})
    assert (ids["vocab_size"], ids["tokenizer_vocab_size"], ids["special_ids"]) == (128, 101, [100])
    assert cd.check_batches(batches, **ids).verdict == "pass"
    b = {k: v.copy() for k, v in batches[0][2].items()}

    def plant(batch: dict, pos: int, token: int) -> dict:
        batch["tokens"][0, pos] = batch["labels"][0, pos - 1] = token     # labels stay tokens shifted by one
        return batch
    res = cd.check_batches([(1, 0, plant(b, 5, 120))], **ids)
    warn = [f for f in res.findings if f.metric == "token_id_in_padding_rows"]
    assert res.verdict == "warn" and [f.metric for f in res.findings] == ["token_id_in_padding_rows",
                                                                         "label_id_in_padding_rows"]
    assert "[101, 128)" in warn[0].message and "NullTokenizer(100)" in warn[0].message
    assert "token_id_out_of_range" in {f.metric for f in cd.check_batches([(1, 0, plant(b, 6, 128))], **ids).findings}
    # core >= 0.18 prints null_tokenizer_eod_id: vocab_size ids, the eod id where it says
    new = cd.megatron_vocabulary({**NULL_ARGS, "vocab_size": 100, "null_tokenizer_eod_id": 120})
    assert (new["tokenizer_vocab_size"], new["special_ids"]) == (100, [120])
    b = {k: v % 100 if k != "loss_mask" else v for k, v in batches[0][2].items()}
    assert cd.check_batches([(1, 0, plant(b, 5, 120))], **new).verdict == "pass"    # the tokenizer's eod
    assert cd.check_batches([(1, 0, plant(b, 7, 110))], **new).verdict == "warn"


def _null_tokenizer_store(root: Path) -> Path:
    """A run store of the clean mock-data run: NullTokenizer arguments in its snapshot, its batches, a loss."""
    with RunWriter(root, rank=0, meta={"framework": "megatron-core",
                                       "config": {"kind": "megatron_args", "values": NULL_ARGS}}) as w:
        for step, _, b in mock_data_batches(127):
            for k, v in b.items():
                w.put_array(step, f"batch/{k}", v)
            w.log_scalars(step, {"loss": 4.8})
    return root


def test_report_data_checks_read_the_vocabulary_from_the_megatron_arguments(tmp_path: Path) -> None:
    """The data_checks stage of `align report` on a store whose snapshot holds the arguments of the run."""
    from align.stages.data_checks import data_ids
    from align.stages.data_checks import run as data_stage
    from align.stages.evidence import Evidence, Inputs

    root = _null_tokenizer_store(tmp_path / "run")
    ev = Evidence.load(Inputs(str(root), str(root)))
    assert data_ids(ev)["vocab_size"] == 128
    res = data_stage(ev)
    assert res.verdict == "pass", [f.message for f in res.findings]


def test_cli_on_a_store_reads_its_own_vocabulary(tmp_path: Path) -> None:
    """`align check-data STORE` without --vocab-size: the store's Megatron arguments (NullTokenizer
    --vocab-size 127, padded to 128) bound the ids, so the end-of-document id 127 passes; --vocab-size 127
    given by hand still bounds them at 127."""
    root = _null_tokenizer_store(tmp_path / "run")
    rc, payload = _cli(root, ids=False)
    assert rc == 0 and payload["verdict"] == "pass", payload["findings"]
    assert payload["vocabulary"]["vocab_size"] == 128 and payload["vocabulary"]["special_ids"] == [127]
    rc, payload = _cli(root, "--vocab-size", "127", ids=False)
    assert rc == 1 and payload["vocabulary"]["vocab_source"] == "--vocab-size"
