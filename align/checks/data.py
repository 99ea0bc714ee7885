"""`align check-data`: sanity of the batches a run trained on, step by step.

Why these checks: they are the data faults that silently break cross-framework alignment. Ids outside
[0, vocab) index garbage embeddings (or crash on one side only); labels that are not tokens shifted by one
mean the replay shifted twice; a loss_mask whose sum shrinks step after step is the signature of a cached
mask mutated in place; with pad id == eos id every EOD is masked out of the loss; an all-masked sample
divides by zero or contributes nothing. Works on a run store (``batch/*`` arrays in step files) or the seed
layout ``step_N/rank_R/{tokens,labels,loss_mask,attention_mask}.npy``; one step in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from core.findings import Finding, StageResult

STAGE = "data"


def check_batch(where: str | Path, batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """A batch's declared shape: integer ``tokens`` of at least one dimension; ``labels`` (integer) and
    ``loss_mask`` / ``attention_mask`` (numbers) with as many elements. One-line BadInput naming the file."""
    tokens = batch.get("tokens")
    if tokens is None:
        raise BadInput(f"{where}: no tokens array")
    for key, kinds in (("tokens", "iu"), ("labels", "iu"), ("loss_mask", "biuf"), ("attention_mask", "biuf")):
        arr = batch.get(key)
        if arr is None:
            continue
        arr = np.asarray(arr)
        if arr.dtype.kind not in kinds or arr.dtype.names is not None:
            raise BadInput(f"{where}: key '{key}': dtype {arr.dtype} is not "
                           f"{'an integer type' if kinds == 'iu' else 'a number type'}")
        if arr.ndim == 0:
            raise BadInput(f"{where}: key '{key}': a scalar, expected an array of token positions")
        if key in ("labels", "loss_mask") and arr.size != np.asarray(tokens).size:
            raise BadInput(f"{where}: key '{key}': {arr.size} elements but tokens has {np.asarray(tokens).size}")
    return batch


def _duplicates(base: Path, step_re: Any, rank_re: Any) -> list[Finding]:
    """Folders (or files) that name the same step (rank) twice, as ``step_1`` and ``step_00000001`` do: a
    reader keeps one of them, so the other step's data would be silently dropped."""
    out: list[Finding] = []
    if not base.is_dir():
        return out
    steps: dict[int, list[Path]] = {}
    for d in sorted(base.iterdir()):
        m = step_re.match(d.name)
        if m and d.is_dir():
            steps.setdefault(int(m.group(1)), []).append(d)
    for step, dirs in sorted(steps.items()):
        if len(dirs) > 1:
            out.append(Finding(STAGE, "fail", f"step {step}", "duplicate_step", len(dirs), 1,
                               f"step {step} is recorded {len(dirs)} times: {', '.join(str(d) for d in dirs)}"))
        ranks: dict[int, list[Path]] = {}
        for d in dirs:
            for f in sorted(d.iterdir()):
                m = rank_re.match(f.name)
                if m:
                    ranks.setdefault(int(m.group(1)), []).append(f)
        for rank, files in sorted(ranks.items()):
            if len(files) > 1 and len({f.parent for f in files}) == 1:
                out.append(Finding(STAGE, "fail", f"step {step} rank {rank}", "duplicate_rank", len(files), 1,
                                   f"step {step}, rank {rank} is recorded {len(files)} times: "
                                   f"{', '.join(str(f) for f in files)}"))
    return out


def _scalar_duplicates(reader: Any) -> list[Finding]:
    """The same step twice in one rank's scalar records: which line is the step's value is ambiguous."""
    out: list[Finding] = []
    for rank in reader.ranks:
        seen: dict[int, int] = {}
        for line, rec in enumerate(reader.scalar_records(rank), 1):
            step = rec.get("step")
            if step in seen:
                path = reader.root / "scalars" / f"rank_{rank:05d}.jsonl"
                out.append(Finding(STAGE, "fail", f"step {step} rank {rank}", "duplicate_step", 2, 1,
                                   f"{path}:{line}: step {step} recorded again (first at line {seen[step]})"))
                break
            seen[step] = line
    return out


def iter_batches(path: str | Path) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(step, rank, {tokens, labels, loss_mask, ...}) from a run store or the seed layout; each batch names
    its file under ``_file``. Structural faults (a step or rank recorded twice) come first, as
    ``(step, rank, {"_finding": Finding})``. In a run store ``rank`` is the DP rank and the batch is the one
    it trained on, joined from its TP / pipeline / context-parallel ranks (``runstore.batches``)."""
    import runstore
    from runstore.layout import _RANK_H5_RE, _SEED_RANK_RE, _STEP_RE
    from sources.input_kind import not_this, what_it_is

    p = Path(path)
    wanted = "a run store or a step_N/rank_R batch dump"
    looks = what_it_is(p)
    if looks in ("a run store folder", "a step_N/rank_R batch dump"):
        looks = None          # a damaged one of the kinds read here: the reader's own line says what is missing
    if not p.is_dir():
        raise BadInput(not_this(p, wanted, looks) if looks else f"{p}: not a directory ({wanted})")
    seed = runstore.seed_steps(p)
    faults = _duplicates(p / runstore.STEP_DIR, _STEP_RE, _RANK_H5_RE) + _duplicates(p, _STEP_RE, _SEED_RANK_RE)
    if (p / runstore.META).is_file() or (p / runstore.STEP_DIR).is_dir():
        reader = runstore.RunReader(p)
        faults += _scalar_duplicates(reader)
        for f in faults:
            yield -1, -1, {"_finding": f}
        faults = []
        found = False
        # one batch per DP rank: its TP copies, pipeline stages' parts and CP chunks joined (runstore.batches)
        groups = runstore.data_groups(reader, reader.ranks)
        for step in reader.array_steps():
            for dp, batch, files, notes, _ in runstore.dp_batches(reader, step, groups=groups):
                for note in notes:
                    yield step, dp, {"_finding": Finding(STAGE, "warn", f"step {step} rank {dp}",
                                                         "rank_copies_differ", None, None, note)}
                if batch:
                    found = True
                    where = ", ".join(str(f) for f in files)
                    yield step, dp, {**check_batch(where, batch), "_file": where}
        if found or not seed:
            if not found:
                raise BadInput(f"{p}: run store has no batch/* arrays")
            return
    if not seed:
        raise BadInput(not_this(p, wanted, looks) if looks else f"{p}: no step_N/rank_R folders and no run store")
    for f in faults:
        yield -1, -1, {"_finding": f}
    for step in sorted(seed):
        for rank in sorted(seed[step]):
            folder = seed[step][rank]
            keys = [k for k in runstore.SEED_BATCH_KEYS if (folder / f"{k}.npy").is_file()]
            batch = runstore.read_seed_batch(p, step, rank, keys) if folder == p / f"step_{step}" / f"rank_{rank}" \
                else {k: runstore.load_npy(folder / f"{k}.npy") for k in keys}
            yield step, rank, {**check_batch(folder, batch), "_file": str(folder)}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def megatron_vocabulary(args: Mapping[str, Any]) -> dict[str, Any]:
    """The vocabulary a Megatron-LM run's model has, from its arguments (a log's block or a dumper's snapshot).

    ``vocab_size``: the embedding rows (ids must lie below it): ``--padded-vocab-size``, else the tokenizer's
    vocabulary padded up to a multiple of make_vocab_size_divisible_by x TP as Megatron pads it;
    ``tokenizer_vocab_size``: the ids the tokenizer can produce (above it: padding rows no real text
    reaches); ``special_ids``: the tokenizer's own ids. The NullTokenizer (mock data) of core <= 0.17 has
    vocab_size + 1 ids, its end-of-document id being vocab_size; from core 0.18 (which prints
    ``null_tokenizer_eod_id``) it has vocab_size ids, eod ``--null-tokenizer-eod-id`` or vocab_size - 1.
    Other tokenizers read their vocabulary from files the arguments do not hold: ``--vocab-size`` is taken as
    theirs. {} when the arguments name no vocabulary size."""
    size, padded = _int(args.get("vocab_size")), _int(args.get("padded_vocab_size"))
    if size is None and padded is None:
        return {}
    tokenizer, special, source = size, [], "--vocab-size"
    if args.get("tokenizer_type") == "NullTokenizer" and size is not None:
        if "null_tokenizer_eod_id" in args:
            eod = _int(args.get("null_tokenizer_eod_id"))
            special = [size - 1 if eod is None else eod]
            pad = _int(args.get("null_tokenizer_pad_id"))
            if pad is not None and pad >= 0:
                special.append(pad)
            source = f"NullTokenizer({size}): {size} ids, end-of-document id {special[0]}"
        else:
            tokenizer, special = size + 1, [size]
            source = f"NullTokenizer({size}): ids 0..{size}, end-of-document id {size}"
    divisible, tp = _int(args.get("make_vocab_size_divisible_by")), _int(args.get("tensor_model_parallel_size")) or 1
    if padded is not None:
        source += f"; padded vocabulary {padded} (padded_vocab_size)"
    elif divisible and tokenizer is not None:      # only Megatron-LM's own arguments say how it pads
        multiple = divisible * tp
        padded = -(-tokenizer // multiple) * multiple
        source += f"; padded to {padded} (a multiple of make_vocab_size_divisible_by {divisible} x TP {tp})"
    else:
        padded = tokenizer
    out: dict[str, Any] = {"vocab_size": padded, "vocab_source": source}
    if tokenizer is not None and tokenizer < padded:
        out["tokenizer_vocab_size"] = tokenizer
    if special:
        out["special_ids"] = special
    return out


def _padding_rows(ids: np.ndarray, live: np.ndarray | None, tokenizer: int | None, vocab: int | None,
                  special: frozenset[int]) -> tuple[int, list[int]]:
    """Ids in [tokenizer vocabulary, padded vocabulary) that are not the tokenizer's special ids: (count, a
    few of them)."""
    if tokenizer is None or vocab is None or tokenizer >= vocab:
        return 0, []
    hit = (ids >= tokenizer) & (ids < vocab)
    if live is not None:
        hit &= live
    if not hit.any():
        return 0, []
    values = ids[hit]
    if special:
        values = values[~np.isin(values, list(special))]
    return int(values.size), sorted({int(v) for v in values[:1000]})[:5]


def check_batches(batches: Any, *, vocab_size: int | None = None, eos_id: int | None = None,
                  pad_id: int | None = None, ignore_index: int = -100, tokenizer_vocab_size: int | None = None,
                  special_ids: Iterable[int] = (), vocab_source: str | None = None) -> StageResult:
    """Run every check over ``batches`` (an iterable of (step, rank, batch dict)).

    ``vocab_size``: the model's (padded) vocabulary: an id at or above it fails. ``tokenizer_vocab_size``:
    the ids a tokenizer produces; one between it and ``vocab_size`` reaches an embedding row Megatron added
    as padding (never trained by real text): a warning, unless it is one of the tokenizer's ``special_ids``.
    ``vocab_source`` says where the sizes came from (the findings repeat it)."""
    res = StageResult(STAGE)
    special = frozenset(int(i) for i in special_ids)
    whence = f" (vocabulary: {vocab_source})" if vocab_source else ""
    per_step: dict[int, dict[str, Any]] = {}
    eod_total = eod_trained = 0
    n = 0
    seen: dict[tuple[int, int], str] = {}
    ranks_at: dict[int, set[int]] = {}
    for step, rank, b in batches:
        if "_finding" in b:
            res.add(b["_finding"])
            continue
        n += 1
        src = str(b.get("_file", f"step {step} rank {rank}"))
        if (step, rank) in seen:
            res.add(Finding(STAGE, "fail", f"step {step} rank {rank}", "duplicate_step", 2, 1,
                            f"step {step}, rank {rank} recorded twice ({seen[(step, rank)]} and {src})"))
            continue
        seen[(step, rank)] = src
        ranks_at.setdefault(step, set()).add(rank)
        tokens = np.asarray(b.get("tokens"))
        if tokens is None or tokens.ndim == 0:
            raise BadInput(f"step {step} rank {rank}: no tokens array")
        tokens = tokens.reshape(-1, tokens.shape[-1])
        labels = b.get("labels")
        mask = b.get("loss_mask")
        where = f"step {step} rank {rank}"
        rec = per_step.setdefault(step, {"step": step, "loss_mask_sum": 0.0, "samples": 0, "token_min": None,
                                         "token_max": None})
        rec["samples"] += tokens.shape[0]
        tmin, tmax = int(tokens.min()), int(tokens.max())
        rec["token_min"] = tmin if rec["token_min"] is None else min(rec["token_min"], tmin)
        rec["token_max"] = tmax if rec["token_max"] is None else max(rec["token_max"], tmax)
        if tmin < 0 or (vocab_size is not None and tmax >= vocab_size):
            bad = int(((tokens < 0) | ((tokens >= vocab_size) if vocab_size else False)).sum())
            res.add(Finding(STAGE, "fail", where, "token_id_out_of_range", tmax if tmin >= 0 else tmin,
                            vocab_size, f"{where}: {bad} token ids outside [0, {vocab_size}) "
                            f"(min {tmin}, max {tmax}){whence}"))
        n_pad, examples = _padding_rows(tokens, None, tokenizer_vocab_size, vocab_size, special)
        if n_pad:
            res.add(Finding(STAGE, "warn", where, "token_id_in_padding_rows", n_pad, tokenizer_vocab_size,
                            _padding_message(where, "token", n_pad, examples, tokenizer_vocab_size, vocab_size,
                                             whence)))
        if mask is not None:
            mask = np.asarray(mask, dtype=np.float64).reshape(tokens.shape)
            bad = ~np.isfinite(mask) | (mask < 0)
            if bad.any():
                kinds = [k for k, m in (("NaN", np.isnan(mask)), ("inf", np.isinf(mask)),
                                        ("negative", mask < 0)) if m.any()]
                res.add(Finding(STAGE, "fail", where, "loss_mask_invalid", int(bad.sum()), 0,
                                f"{where} ({src}): {int(bad.sum())} loss_mask values are {'/'.join(kinds)} "
                                f"(first at flat position {int(np.flatnonzero(bad)[0])}); a mask is finite, >= 0"))
                mask = np.where(bad, 0.0, mask)      # the finding stands; the sums below stay finite
            rec["loss_mask_sum"] += float(mask.sum())
            empty = np.flatnonzero(mask.sum(axis=1) == 0)
            if empty.size:
                res.add(Finding(STAGE, "warn", where, "all_masked_samples", int(empty.size), 0,
                                f"{where}: {empty.size} sample(s) have every position masked out of the loss "
                                f"(rows {empty[:5].tolist()})"))
        if labels is not None:
            labels = np.asarray(labels).reshape(tokens.shape)
            live = labels != ignore_index
            if mask is not None:
                live &= mask > 0
            if vocab_size is not None:
                out = live & ((labels < 0) | (labels >= vocab_size))
                if out.any():
                    res.add(Finding(STAGE, "fail", where, "label_id_out_of_range", int(out.sum()), vocab_size,
                                    f"{where}: {int(out.sum())} label ids outside [0, {vocab_size}){whence}"))
                n_pad, examples = _padding_rows(labels, live, tokenizer_vocab_size, vocab_size, special)
                if n_pad:
                    res.add(Finding(STAGE, "warn", where, "label_id_in_padding_rows", n_pad, tokenizer_vocab_size,
                                    _padding_message(where, "label", n_pad, examples, tokenizer_vocab_size,
                                                     vocab_size, whence)))
            if tokens.shape[1] > 1:
                shifted = labels[:, :-1] != tokens[:, 1:]
                frac = float(shifted.mean())
                if frac > 0:
                    res.add(Finding(STAGE, "fail" if frac > 0.01 else "warn", where, "labels_not_shifted_tokens",
                                    frac, 0.0, f"{where}: labels differ from tokens shifted by one at "
                                    f"{frac:.1%} of positions (shifted twice, or not at all?)"))
            if eos_id is not None and mask is not None:
                eod = labels == eos_id
                eod_total += int(eod.sum())
                eod_trained += int((eod & (mask > 0)).sum())
    if n == 0:
        raise BadInput("no batches found")
    _missing_ranks(res, ranks_at)
    steps = [per_step[s] for s in sorted(per_step)]
    _trend(res, steps)
    if eos_id is not None and eod_trained == 0:
        if same_ids(pad_id, eos_id):
            res.add(Finding(STAGE, "fail", "loss_mask", "eod_never_trained", 0, eod_total,
                            f"pad id == eos id ({eos_id}): no EOD target is ever in the loss (masking the "
                            "padding masks every EOD; Megatron also rewrites padded labels to 0)"))
        elif eod_total:
            res.add(Finding(STAGE, "warn", "loss_mask", "eod_all_masked", eod_total, eod_total,
                            f"every one of {eod_total} EOD targets (id {eos_id}) is masked out of the loss"))
    if not res.findings:
        res.add(Finding(STAGE, "pass", None, "batches_checked", n, None,
                        f"{n} batches over {len(steps)} steps: ids in range, labels shifted, masks steady"))
    res.details = {"batches": n, "steps": steps, "eod_targets": eod_total, "eod_trained": eod_trained}
    return res


def _padding_message(where: str, what: str, n: int, examples: list[int], tokenizer: int | None, vocab: int | None,
                     whence: str) -> str:
    return (f"{where}: {n} {what} ids in [{tokenizer}, {vocab}) (e.g. {examples}): the embedding rows Megatron "
            f"adds to pad the tokenizer's {tokenizer} ids, which no real text reaches and no special id of the "
            f"tokenizer names{whence}; were the data tokenized with another vocabulary?")


def _missing_ranks(res: StageResult, ranks_at: dict[int, set[int]]) -> None:
    """Every step should hold the same ranks 0..R-1: a rank missing at one step (or a gap, rank_0 and rank_2
    without rank_1) means a writer died or files were lost; that step's batch is incomplete."""
    every = set().union(*ranks_at.values()) if ranks_at else set()
    expected = set(range(max(every) + 1)) if every else set()
    shown = 0
    for step in sorted(ranks_at):
        missing = sorted(expected - ranks_at[step])
        if missing and shown < 20:
            shown += 1
            res.add(Finding(STAGE, "fail", f"step {step}", "missing_rank", missing[0], None,
                            f"step {step}: rank(s) {missing[:10]} missing (present: {sorted(ranks_at[step])[:10]})"))


def same_ids(a: int | None, b: int | None) -> bool:
    return a is not None and a == b


def _trend(res: StageResult, steps: list[dict[str, Any]]) -> None:
    """A loss_mask sum that never goes up, falls at >= 3 step transitions and by a real amount is a mutated
    cache. Plateaus are allowed: a new EOD can land where the cache is already 0, and a saturated cache stays
    flat for the rest of the run; a healthy loader's sum goes up as often as down."""
    sums = np.array([s["loss_mask_sum"] for s in steps], dtype=np.float64)
    if len(sums) < 3 or sums[0] <= 0:
        return
    diffs = np.diff(sums)
    down = np.count_nonzero(diffs < 0)
    if np.all(diffs <= 0) and down >= 3 and sums[-1] < 0.95 * sums[0]:
        res.add(Finding(STAGE, "fail", "loss_mask", "loss_mask_shrinking", float(sums[-1]), float(sums[0]),
                        f"loss_mask sum falls at {down} of {len(diffs)} step transitions, from {sums[0]:g} at "
                        f"step {steps[0]['step']} to {sums[-1]:g} at step {steps[-1]['step']}: a cached mask "
                        "is probably being modified in place"))






BATCH_KEYS = ("tokens", "labels", "loss_mask")


def batch_digest(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-step batch facts for a report: a short hash of the tokens, loss_mask sum and id range."""
    import hashlib

    tokens = np.ascontiguousarray(np.asarray(batch["tokens"]).astype(np.int64))
    out: dict[str, Any] = {"tokens_sha1": hashlib.sha1(tokens.tobytes()).hexdigest()[:12],
                           "token_min": int(tokens.min()), "token_max": int(tokens.max())}
    if "loss_mask" in batch:
        out["loss_mask_sum"] = float(np.asarray(batch["loss_mask"], dtype=np.float64).sum())
    return out


def _dp_ranks(path: str | Path) -> int | None:
    """How many DP ranks a run store's batches come from (None: not a run store)."""
    import runstore

    p = Path(path)
    if not ((p / runstore.META).is_file() or (p / runstore.STEP_DIR).is_dir()):
        return None
    reader = runstore.RunReader(p)
    return len(runstore.data_groups(reader, reader.ranks)) or None


def _first_difference(b: dict[str, Any], c: dict[str, Any]) -> tuple[str, str] | None:
    for key in BATCH_KEYS:
        if key not in b or key not in c:
            continue
        x, y = np.asarray(b[key]), np.asarray(c[key])
        if x.shape == y.shape and np.array_equal(x.astype(np.float64), y.astype(np.float64)):
            continue
        return key, (f"shape {x.shape} vs {y.shape}" if x.shape != y.shape else
                     f"{int(np.count_nonzero(x.astype(np.float64) != y.astype(np.float64)))} of {x.size} "
                     "values differ")
    return None


def _compare_global(baseline: Path, candidate: Path, dps: tuple[int, int], limit: int | None) -> StageResult:
    """Two run stores of different DP sizes: each step's global batch (every DP rank's micro-batches in
    Megatron's sampler order, runstore.batches.global_batch) compared."""
    import runstore

    res = StageResult(STAGE)
    readers = [runstore.RunReader(baseline), runstore.RunReader(candidate)]
    groups = [runstore.data_groups(r, r.ranks) for r in readers]
    steps = sorted(set(readers[0].array_steps()) & set(readers[1].array_steps()))
    compared, first_diff = 0, None
    for step in steps:
        try:
            gb = [runstore.global_batch([(b, m) for _, b, _, _, m in runstore.dp_batches(r, step, groups=g)])
                  for r, g in zip(readers, groups, strict=True)]
        except ValueError as exc:
            res.add(Finding(STAGE, "warn", "batch", "global_batch_unordered", step, None,
                            f"step {step}: the DP ranks' batches cannot be put in the sampler's order ({exc}); "
                            "batches of runs with different DP sizes not compared"))
            break
        if "tokens" not in gb[0] or "tokens" not in gb[1]:
            continue
        compared += 1
        diff = _first_difference(gb[0], gb[1])
        if diff is not None:
            first_diff = (step, *diff)
            break
        if limit is not None and compared >= limit:
            break
    res.details = {"steps_compared": compared, "global_batches": True, "dp_ranks": list(dps)}
    if first_diff is not None:
        step, key, what = first_diff
        res.details["first_different_step"] = step
        res.add(Finding(STAGE, "fail", key, "batch_differs", step, None,
                        f"step {step}: the candidate's global {key} (its {dps[1]} DP ranks' micro-batches in "
                        f"sampler order) differs from the baseline's ({dps[0]} DP ranks): {what}; the runs did "
                        "not train on the same data from this step"))
    elif compared:
        res.add(Finding(STAGE, "pass", "batch", "same_batches", compared, None,
                        f"tokens, labels and loss_mask of the global batch equal at all {compared} steps both runs "
                        f"recorded ({dps[0]} vs {dps[1]} DP ranks)"))
    elif not res.findings:
        res.add(Finding(STAGE, "warn", "batch", "no_common_batches", 0, None,
                        "the two runs recorded no batch of the same step: same data not shown"))
    return res


def _replayed_by_sample(path: str | Path) -> bool:
    """Whether a run store's batches carry a re-split replay's per-sample plan (``batch/sample_index``)."""
    import runstore

    p = Path(path)
    if not (p / runstore.STEP_DIR).is_dir():
        return False
    reader = runstore.RunReader(p)
    steps = reader.array_steps()
    return bool(steps) and reader.has_group(steps[0], "batch/sample_index")


def _global_hashes(reader: Any, groups: Any, step: int, cache: dict[int, Any]) -> tuple[np.ndarray, dict, str] | None:
    """(per-sample hashes, global batch, where the hashes come from) of a baseline step in sampler order; None when
    it has neither hashes nor tokens. The baseline's own record (``batch/sample_hash``, written by its dumper) is
    used where every DP rank has one: "recorded"; a store written before the dumpers recorded them gets hashes
    computed from its stored batch: "recomputed". A record that differs from its own stored batch raises
    ValueError naming the first sample (the batch the store holds is not the one its run hashed)."""
    import runstore
    from runstore.batches import sample_hashes

    if step not in cache:
        per = [(b, m) for _, b, _, _, m in runstore.dp_batches(reader, step, groups=groups)]
        whole = runstore.global_batch(per) if per else {}
        cache.clear()
        cache[step] = None
        if "sample_hash" in whole:
            own = np.asarray(whole["sample_hash"]).reshape(-1)
            if "tokens" in whole and "labels" in whole and "loss_mask" in whole:
                again = sample_hashes(whole)
                bad = np.flatnonzero(again != own) if again.shape == own.shape else np.arange(min(own.size, 1))
                if bad.size:
                    raise ValueError(f"baseline step {step}: sample {int(bad[0])}'s recorded hash (batch/sample_hash) "
                                     "differs from the hash of its stored tokens, labels and loss_mask")
            cache[step] = (own, whole, "recorded")
        elif "tokens" in whole:
            cache[step] = (sample_hashes(whole), whole, "recomputed")
    return cache[step]


def _sample_order(index: np.ndarray, total: int, dp: int, dp_rank: int) -> bool:
    """Whether one candidate DP rank's rows are, in order, the rows Megatron's sampler gives DP rank ``dp_rank``
    of ``dp`` for some micro-batch count."""
    from runstore.batches import sampler_positions

    if total % dp or index.size != total // dp:
        return False
    steps = np.flatnonzero(np.diff(index) != 1)
    mbs = int(steps[0]) + 1 if steps.size else index.size      # the first micro-batch: a run of consecutive samples
    return (total // dp) % mbs == 0 and np.array_equal(index, sampler_positions(total, dp, dp_rank, total // dp // mbs))


def _compare_by_sample(baseline: Path, candidate: Path, limit: int | None) -> StageResult:
    """A candidate that replayed the baseline re-split by sample (dumpers.mindformers_replay): at each of its
    steps every sample of the baseline step's global batch must arrive once, in the sampler's order for the
    candidate's layout, and hash alike on the three records: the baseline's, the replay's as read, the rows the
    candidate's network got. The first fault is named by step and sample."""
    import runstore
    from runstore.batches import sample_hashes

    res = StageResult(STAGE)
    base, cand = runstore.RunReader(baseline), runstore.RunReader(candidate)
    bgroups, cgroups = runstore.data_groups(base, base.ranks), runstore.data_groups(cand, cand.ranks)
    cache: dict[int, Any] = {}
    compared, samples, fault = 0, 0, None
    sources: dict[str, set[str]] = {"baseline": set(), "candidate": set()}
    dp = len(cgroups)
    for step in cand.array_steps():
        rows = [(d, b) for d, b, _, _, _ in runstore.dp_batches(cand, step, groups=cgroups) if "sample_index" in b]
        if not rows:
            continue
        where = f"step {step}"
        bsteps = {int(v) for _, b in rows for v in np.asarray(b.get("sample_step", [step])).reshape(-1)}
        if len(bsteps) != 1:
            fault = ("sample_step", step, None, f"{where}: the candidate's rows come from baseline steps "
                                                f"{sorted(bsteps)[:5]}: one training step replayed several")
            break
        bstep = bsteps.pop()
        if bstep != step:
            fault = ("sample_step", step, None, f"{where}: the candidate trained baseline step {bstep}'s samples; the "
                                                "runs' steps are not aligned (the replay's steps option?)")
            break
        try:
            got = _global_hashes(base, bgroups, bstep, cache) if bstep in base.array_steps() else None
        except ValueError as exc:
            fault = ("baseline_hash", step, None, f"{where}: {exc}")
            break
        if got is None:
            fault = ("sample_step", step, None, f"{where}: replays baseline step {bstep}, whose batch the baseline "
                                                "did not record")
            break
        want, whole, kind = got
        sources["baseline"].add(kind)
        total = len(want)
        seen: dict[int, int] = {}
        for d, b in rows:
            index = np.asarray(b["sample_index"]).reshape(-1).astype(np.int64)
            trained = np.asarray(b["sample_hash"]).reshape(-1) if "sample_hash" in b else (
                sample_hashes(b) if "tokens" in b else None)
            sources["candidate"].add("recorded" if "sample_hash" in b else "recomputed" if trained is not None
                                     else "none")
            read = np.asarray(b["replay_hash"]).reshape(-1) if "replay_hash" in b else None
            for j, i in enumerate(index.tolist()):
                if not 0 <= i < total:
                    fault = ("sample_index", step, i, f"{where}: DP rank {d} row {j} names sample {i} of a global "
                                                      f"batch of {total} (baseline step {bstep})")
                elif i in seen:
                    fault = ("sample_index", step, i, f"{where}: sample {i} of baseline step {bstep} arrived twice "
                                                      f"(DP ranks {seen[i]} and {d})")
                elif read is not None and read[j] != want[i]:
                    fault = ("replay_hash", step, i, f"{where}: sample {i} as the replay read it differs from the "
                                                     f"baseline's sample {i} of step {bstep} (hash)")
                elif trained is not None and trained[j] != want[i]:
                    key = _sample_difference(whole, b, i, j)
                    fault = (key, step, i, f"{where}: the row DP rank {d} trained as sample {i} differs from the "
                                           f"baseline's sample {i} of step {bstep} ({key})")
                if fault is not None:
                    break
                seen[i] = d
            if fault is None and not _sample_order(index, total, dp, d):
                fault = ("sample_order", step, int(index[0]) if index.size else None,
                         f"{where}: DP rank {d} of {dp} trained samples {index[:8].tolist()} of baseline step "
                         f"{bstep}: not the order Megatron's sampler gives that rank")
            if fault is not None:
                break
        if fault is None and len(seen) != total:
            lost = sorted(set(range(total)) - set(seen))
            fault = ("sample_index", step, lost[0], f"{where}: sample(s) {lost[:8]} of baseline step {bstep}'s "
                                                    f"{total} never arrived ({dp} candidate DP rank(s) recorded)")
        if fault is not None:
            break
        compared += 1
        samples += total
        if limit is not None and compared >= limit:
            break
    res.details = {"steps_compared": compared, "samples_compared": samples, "by_sample": True,
                   "dp_ranks": [len(bgroups), dp],
                   "hashes": {side: "+".join(sorted(kinds)) or None for side, kinds in sources.items()}}
    if fault is not None:
        key, step, sample, what = fault
        res.details.update(first_different_step=step, first_different_sample=sample)
        tail = ("; the data stage cannot vouch for the baseline's batch (edited or mixed up after the run?)"
                if key == "baseline_hash" else "; the runs did not train on the same data from this step")
        res.add(Finding(STAGE, "fail", key, "sample_differs", step, None, what + tail))
    elif compared:
        res.add(Finding(STAGE, "pass", "batch", "same_samples", samples, None,
                        f"every one of {samples} samples over {compared} steps arrived once, in the sampler's order, "
                        f"bit-equal (per-sample hashes of tokens, labels and loss_mask; {len(bgroups)} baseline vs "
                        f"{dp} candidate DP ranks; {_hash_origin(sources)})"))
    else:
        res.add(Finding(STAGE, "warn", "batch", "no_common_batches", 0, None,
                        "the candidate recorded no replayed sample: same data not shown"))
    return res


def _hash_origin(sources: dict[str, set[str]]) -> str:
    """Where the compared hashes came from, in words (each side's own record, or computed here)."""
    words = {"recorded": "its dumper's own record", "recomputed": "computed here from its stored batch",
             "none": "none"}
    parts = [f"{side}: {' and '.join(words[k] for k in sorted(kinds))}" for side, kinds in sources.items() if kinds]
    out = "hashes " + "; ".join(parts)
    if "recomputed" in sources["baseline"]:
        out += " (a baseline store written before its dumper recorded per-sample hashes: its batch is taken as trained)"
    return out


def _sample_difference(whole: dict[str, Any], row: dict[str, Any], i: int, j: int) -> str:
    """Which of tokens / labels / loss_mask makes the candidate's row ``j`` differ from baseline sample ``i``."""
    for key in BATCH_KEYS:
        if key in whole and key in row:
            a, b = np.asarray(whole[key])[i], np.asarray(row[key])[j]
            if a.shape != b.shape or not np.array_equal(a.astype(np.float64), b.astype(np.float64)):
                return key
    return "sample_hash"


def compare_batches(baseline: str | Path, candidate: str | Path, *, limit: int | None = None) -> StageResult:
    """Did both runs train on the same data? Step by step, rank by rank, tokens / labels / loss_mask equal.

    Megatron batches are already shifted, so the candidate replaying them must record the same arrays; the
    first step whose arrays differ is named (a second shift, a different sampler, a mutated mask). A rank of
    a run store is its DP rank (TP / pipeline / CP parts joined); two run stores of different DP sizes
    compare each step's global batch instead."""
    dps = (_dp_ranks(baseline), _dp_ranks(candidate))
    if dps[0] is not None and dps[1] is not None and _replayed_by_sample(candidate):
        return _compare_by_sample(Path(baseline), Path(candidate), limit)
    if dps[0] is not None and dps[1] is not None and dps[0] != dps[1]:
        return _compare_global(Path(baseline), Path(candidate), (dps[0], dps[1]), limit)
    res = StageResult(STAGE)
    cand_iter = iter_batches(candidate)
    cur = next(cand_iter, None)
    compared = 0
    first_diff = None
    for step, rank, b in iter_batches(baseline):      # both come in (step, rank) order: a merge join
        if "_finding" in b:
            continue
        while cur is not None and (cur[0], cur[1]) < (step, rank):
            cur = next(cand_iter, None)
        while cur is not None and "_finding" in cur[2]:
            cur = next(cand_iter, None)
        if cur is None:
            break
        if (cur[0], cur[1]) != (step, rank):
            continue
        c = cur[2]
        compared += 1
        diff = _first_difference(b, c)
        if diff is not None:
            first_diff = (step, rank, *diff)
        if first_diff is not None or (limit is not None and compared >= limit):
            break
    res.details = {"steps_compared": compared}
    if compared == 0:
        res.add(Finding(STAGE, "warn", "batch", "no_common_batches", 0, None,
                        "the two runs recorded no batch of the same step and rank: same data not shown"))
    elif first_diff is not None:
        step, rank, key, what = first_diff
        res.details["first_different_step"] = step
        res.add(Finding(STAGE, "fail", key, "batch_differs", step, None,
                        f"step {step}, rank {rank}: the candidate's {key} differs from the baseline's ({what}); "
                        "the runs did not train on the same data from this step"))
    else:
        res.add(Finding(STAGE, "pass", "batch", "same_batches", compared, None,
                        f"tokens, labels and loss_mask equal in all {compared} batches both runs recorded"))
    return res
