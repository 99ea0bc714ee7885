"""check-data on batches built by Megatron-core's own mask code (megatron/core/datasets/gpt_dataset.py):
pad id == eos id masks every EOD; a cached loss mask mutated in place (the `.clone()` dropped) shrinks."""

from __future__ import annotations

import argparse
import json
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


def _cli(path: Path, *extra: str) -> tuple[int, dict]:
    p = argparse.ArgumentParser()
    check_data.add_arguments(p)
    out = path.parent / "data.json"
    rc = check_data.run(p.parse_args([str(path), "--vocab-size", str(VOCAB), "--eos-id", str(EOS), *extra,
                              "--json", str(out)]))
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
