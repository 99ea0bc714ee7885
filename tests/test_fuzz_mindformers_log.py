"""Fuzz (issue 24): the MindFormers log reader is never silently wrong. Seeded, bounded (a few seconds).

Material: real-format logs (MFLossMonitor step lines of 1.x and 2.x, sink mode, lm_loss / MoE / MTP fields,
``norm_size`` + ``local_norm`` blocks, TrainingStateMonitor ``local_norm/<name>`` lines; the format strings of
mindformers/core/callback/callback.py in the installed wheel) and a demo log that takes the bulk reader.
Corruptions: flipped bytes (to bytes that can not make another valid number: control bytes, letters, brackets),
control bytes put inside a value, lost newlines, truncation mid-line, huge numbers (1e400, 5000-digit steps and
values), and for msrun folders a missing worker, a garbled worker file and an empty one.

Each case asserts READ-RIGHT-OR-REFUSED against the reading of the uncorrupted file: every value the reader
returns is the value that step printed; every step whose line survived intact keeps all its values; a value
that is missing comes with a note; or the file is refused with BadInput. The bulk and the careful reader give
the same answer. The outcome counts are printed (``pytest -s``).
"""

from __future__ import annotations

import random
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import sources.mindformers_log as mfl
from core.errors import BadInput
from demo.example_logs import mindformers_log

SEED = 24
DEBUG = ""
DATA = Path(__file__).parent / "data"
MF2 = DATA / "mindformers_2x"
# bytes a flip turns a byte into: none of them can turn a number into another number (a digit, '.', 'e',
# '+', '-' could; a blank or ',' could end a number early; '\r' / '\n' start a new line)
FLIP_TO = [bytes([b]) for b in (*range(1, 9), 11, 12, *range(14, 32), 127)] + [b"x", b"#", b"\xff", b"[", b"]",
                                                                                b"/", b":", b"Q"]
CONTROL = [bytes([b]) for b in (1, 2, 7, 8, 11, 12, 27, 28, 29, 30, 31, 127)]
HUGE = [b"1e400", b"-1e400", b"9" * 5000, b"1" + b"0" * 400, b"1e99999"]
_VALUE = re.compile(rb"(?<=[:\[/ ])-?[0-9]+\.[0-9]+(?:e[-+][0-9]+)?")     # a printed float, for the corruptions
SEPARATORS = frozenset(b",:[]/")   # the bulk reader's column separators
_HEAD_NUM = re.compile(rb"step:\[ *([0-9]+)/")


def _materials(tmp: Path) -> dict[str, bytes]:
    demo = tmp / "demo.log"
    mindformers_log(demo, 40, seed=7)
    out = {"demo_bulk": demo.read_bytes(), "v1_local_norm": (DATA / "mindformers_train.log").read_bytes()}
    for name in ("dense", "moe_mtp", "sink", "no_lr", "v0"):
        out[name] = (MF2 / f"{name}.log").read_bytes()
    return out


def _corrupt(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    kind = rng.choice(["flip", "flip3", "control_in_value", "lost_newline", "lost_newlines", "truncate",
                       "huge_value", "huge_step"])
    b = bytearray(data)
    if kind.startswith("flip"):
        for _ in range(1 if kind == "flip" else 3):
            at = rng.randrange(len(b))
            while b[at] == 10:
                at = rng.randrange(len(b))
            to = rng.choice(FLIP_TO)
            if b[at] in SEPARATORS and to[0] in SEPARATORS and to[0] != b[at]:
                kind = "flip_separator"
            b[at: at + 1] = to
        return kind, bytes(b)
    if kind == "control_in_value":
        m = rng.choice(list(_VALUE.finditer(data)))
        at = rng.randrange(m.start() + 1, m.end())
        return kind, data[:at] + rng.choice(CONTROL) + data[at:]
    if kind.startswith("lost_newline"):
        nl = [i for i, c in enumerate(data[:-1]) if c == 10]
        for at in sorted(rng.sample(nl, 1 if kind == "lost_newline" else min(len(nl), 5)), reverse=True):
            del b[at]
        return kind, bytes(b)
    if kind == "truncate":
        at = rng.randrange(len(data) // 2, len(data))
        while data[at - 1] == 10:
            at -= 1
        return kind, data[:at]
    if kind == "huge_value":
        m = rng.choice(list(_VALUE.finditer(data)))
        return kind, data[: m.start()] + rng.choice(HUGE) + data[m.end():]
    m = rng.choice(list(_HEAD_NUM.finditer(data)))
    return kind, data[: m.start(1)] + rng.choice([b"9" * 5000, b"99999999999999", b"1.0"]) + data[m.end(1):]


def _read(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    """(bulk-or-careful run, careful-only run), or the BadInput each raised."""
    def one() -> object:
        try:
            return mfl.parse_mindformers_log(path)
        except BadInput as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            return exc
    first = one()
    with monkeypatch.context() as mp:
        mp.setattr(mfl, "_bulk", lambda raw: None)
        mp.setattr(mfl, "_regex_rows", lambda raw: None)
        careful = one()
    return first, careful


def _same(a: pd.Series, b: pd.Series) -> bool:
    return a.index.equals(b.index) and np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=True)


def _intact_steps(original: bytes, mutated: bytes) -> set[int]:
    """Steps whose MFLossMonitor line is in the mutated file unchanged and ended by its newline."""
    have = set(mutated.split(b"\n")[:-1])
    heads = Counter(int(x) for x in _HEAD_NUM.findall(mutated) if len(x) < 13)
    out = set()
    for ln in original.split(b"\n"):
        m = re.search(rb"step:\[ *([0-9]+)/ *[0-9]+\],", ln)
        if m and ln in have and heads[int(m.group(1))] == original.count(b"step:[%5d/" % int(m.group(1))):
            out.add(int(m.group(1)))
    return out


def check_case(label: str, ref, original: bytes, mutated: bytes, run, problems: list[str]) -> str:
    """READ-RIGHT-OR-REFUSED for one corrupted log; returns the outcome (read / noted / refused)."""
    if isinstance(run, BadInput):
        if _intact_steps(original, mutated):
            problems.append(f"{label}: refused with intact steps: {run}")
        return "refused"
    intact = _intact_steps(original, mutated)
    new_notes = [n for n in run.notes if n not in ref.notes]
    missing = False
    for key, s in run.scalars.items():
        want = ref.scalars.get(key)
        for step, v in s.items():
            if want is None or step not in want.index:
                if not new_notes:
                    problems.append(f"{label}: {key} at step {step} = {v} was never printed, no note")
            elif not (v == want[step] or np.isnan(v) and np.isnan(want[step])):
                problems.append(f"{label}: {key} at step {step} = {v}, printed {want[step]}")
    printed = {int(x) for x in _HEAD_NUM.findall(mutated) if len(x) < 13}   # (a truncated log ends early)
    for key, want in ref.scalars.items():
        got = run.scalars.get(key)
        for step in want.index:
            if (got is None or step not in got.index) and step in printed:
                missing = True
                if step in intact:
                    problems.append(f"{label}: intact step {step} lost {key}; notes {run.notes}")
    for step, table in ref.local_norms.items():
        got = run.local_norms.get(step)
        if (got is None or len(got) != len(table)) and step in printed:
            missing = True
        if got is None:
            continue
        named = table.name.iloc[0] != "#0"
        if named:
            want = dict(zip(table.name, table.norm, strict=True))
            for name, norm in zip(got.name, got.norm, strict=True):
                if want.get(name) != norm and not new_notes:
                    problems.append(f"{label}: local norm {name!r} at step {step} = {norm}, no note")
                elif name in want and want[name] != norm:
                    problems.append(f"{label}: local norm {name!r} at step {step} = {norm}, printed {want[name]}")
        elif not np.array_equal(got.norm.to_numpy(), table.norm.to_numpy()):
            problems.append(f"{label}: local_norm block at step {step} differs from the printed one")
    for step in run.local_norms:
        if step not in ref.local_norms:
            problems.append(f"{label}: local norms at step {step}, where none were printed")
    if missing and not new_notes:
        problems.append(f"{label}: values missing without a note")
    return "noted" if missing or new_notes else "read"


def test_fuzz_mindformers_log_read_right_or_refused(tmp_path, monkeypatch):
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    for name, original in _materials(tmp_path).items():
        src = tmp_path / f"{name}.log"
        src.write_bytes(original)
        ref = mfl.parse_mindformers_log(src)
        assert ref.scalars
        for round_ in range(40):
            kind, mutated = _corrupt(rng, original)
            label = f"{name} {kind}#{round_}"
            p = tmp_path / "case.log"
            p.write_bytes(mutated)
            run, careful = _read(p, monkeypatch)
            if isinstance(run, BadInput) != isinstance(careful, BadInput):
                problems.append(f"{label}: bulk and careful readers disagree on refusing")
            elif not isinstance(run, BadInput) and kind != "flip_separator":
                # (one separator turned into another, ':' into '/': the bulk reader's columns, and so its
                # values, are those of the printed line; the careful reader notes the field instead)
                if sorted(run.scalars) != sorted(careful.scalars) or run.notes != careful.notes or not all(
                        _same(s, careful.scalars[k]) for k, s in run.scalars.items()):
                    problems.append(f"{label}: bulk and careful readers disagree")
            check_case(label + " (careful)", ref, original, mutated, careful, problems)
            outcome = check_case(label, ref, original, mutated, run, problems)
            if DEBUG and DEBUG in label:
                Path("/tmp/mflog/case.log").write_bytes(mutated)
            outcomes[outcome] += 1
            outcomes[f"{kind}: {outcome}"] += 1
    print(f"\nfuzz mindformers_log: {sum(v for k, v in outcomes.items() if ':' not in k)} cases, "
          f"outcomes {dict(sorted(outcomes.items()))}")
    assert not problems, "\n".join(problems[:20])


def test_fuzz_msrun_folders(tmp_path):
    """A folder of worker_N.log files with one worker missing, garbled or empty: the other workers are read
    exactly as alone, what is lost is noted, the world size is never claimed from a gap."""
    rng = random.Random(SEED + 1)
    workers = [(MF2 / "msrun_log" / f"worker_{r}.log").read_bytes() for r in (0, 1)]
    alone = {}
    for r, text in enumerate(workers * 2):
        p = tmp_path / f"alone_{r}.log"
        p.write_bytes(text)
        alone[r] = mfl.parse_mindformers_log(p)
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    for round_ in range(24):
        root = tmp_path / f"case{round_}" / "output" / "msrun_log"
        root.mkdir(parents=True)
        for r in range(4):
            (root / f"worker_{r}.log").write_bytes(workers[r % 2])
        kind = ["missing", "garbled", "empty", "binary", "flipped", "extra_name"][round_ % 6]
        # (the highest rank missing looks like a smaller world: the file names can not tell, so not asked)
        victim = rng.randrange(3 if kind == "missing" else 4)
        f = root / f"worker_{victim}.log"
        if kind == "missing":
            f.unlink()
        elif kind == "garbled":
            f.write_bytes(bytes(rng.randrange(256) for _ in range(3000)))
        elif kind == "empty":
            f.write_bytes(b"")
        elif kind == "binary":
            f.write_bytes(b"\x00" * 5000)
        elif kind == "flipped":
            _, mutated = _corrupt(rng, workers[victim % 2])
            f.write_bytes(mutated)
        else:
            shutil.copy(f, root / f"worker_0{victim}.log")      # a second name for a rank
        label = f"msrun {kind}#{round_} (worker_{victim})"
        try:
            run = mfl.parse_mindformers_dir(root.parent.parent / "output")
        except BadInput as exc:
            outcomes["refused"] += 1
            problems.append(f"{label}: refused with 3 good workers: {exc}")
            continue
        for r in range(4):
            if r == victim and kind != "extra_name":
                continue
            for k, s in alone[r].scalars.items():
                if not _same(run.rank_scalars[r][k], s):
                    problems.append(f"{label}: rank {r} {k} differs from the worker read alone")
        ok_ranks = sorted(run.rank_scalars)
        world = run.meta.get("parallel", {}).get("world_size")
        if world is not None and world != 4:
            problems.append(f"{label}: world size {world} claimed")
        if kind == "missing" and world is not None:
            problems.append(f"{label}: world size claimed with rank {victim} missing")
        if kind in ("missing", "garbled", "empty", "binary") and victim in ok_ranks and run.rank_scalars[victim]:
            problems.append(f"{label}: rank {victim} has scalars from a file it does not have")
        if kind in ("missing", "garbled", "empty", "binary", "extra_name") and not any(
                f"worker_{victim}" in n or f"rank(s) {victim}" in n or f"worker_0{victim}" in n for n in run.notes):
            problems.append(f"{label}: no note names worker {victim}: {run.notes}")
        if kind == "flipped":
            check = mfl.Run(str(f), "mindformers_log", {}, run.rank_scalars.get(victim, {}), {},
                            [n.split(": ", 1)[1] for n in run.notes if n.startswith(f"worker_{victim}.log: ")])
            ref = mfl.Run("ref", "mindformers_log", {}, alone[victim].scalars, {}, alone[victim].notes)
            check_case(label, ref, workers[victim % 2], f.read_bytes(), check, problems)
        outcomes["noted" if len(run.notes) > 1 else "read"] += 1
    print(f"\nfuzz msrun folders: outcomes {dict(outcomes)}")
    assert not problems, "\n".join(problems[:20])


# --- printed parallel configs in msrun worker logs (issue 38) -----------------------------------------------------
# MindFormers pprints its config before training; the worker logs' parallel layout is read from it. Hostile
# values (wrong types, sizes no run has, MindFormers' string forms) must leave the losses exactly as printed and
# either give the layout the config states or a note that it was not read; never an exception other than
# BadInput, never an allocation sized from the value (10**12 layers, "([1]*999999999999)").

HOSTILE = [[1], "x", "abc", 10**12, -1, 0, 2.0, None, True, "False", {"a": 1}, "([1]*999999999999)",
           [[1] * 3] * 2, [10**12, -10**12], 10**30, "1", 1e308, [], [[]]]
CONFIG_KEYS = ["parallel_config.data_parallel", "parallel_config.model_parallel", "parallel_config.pipeline_stage",
               "parallel_config.micro_batch_num", "parallel_config.expert_parallel",
               "parallel_config.context_parallel", "parallel_config.use_seq_parallel", "parallel.parallel_mode",
               "parallel.enable_parallel_optimizer", "parallel.gradients_mean", "model.model_config.num_layers",
               "model.model_config.offset", "model.model_config.num_hidden_layers", "parallel_config",
               "parallel", "model.model_config", "model"]


def test_fuzz_printed_parallel_configs(tmp_path):
    import pprint

    from models.mindformers_parallel import strategy_from_yaml

    rng = random.Random(SEED + 38)
    steps = (DATA / "mindformers_train.log").read_text()
    ref = mfl.parse_mindformers_log(DATA / "mindformers_train.log")
    outcomes: Counter[str] = Counter()
    for case in range(40):
        cfg = {"parallel_config": {"data_parallel": 1, "model_parallel": 2, "pipeline_stage": 2},
               "parallel": {"parallel_mode": 1}, "model": {"model_config": {"num_layers": 4, "offset": 0}}}
        changed = []
        for _ in range(rng.choice([1, 1, 2])):
            key, value = rng.choice(CONFIG_KEYS), rng.choice(HOSTILE)
            *blocks, name = key.split(".")
            d = cfg
            for part in blocks:
                d = d.setdefault(part, {}) if isinstance(d.get(part, {}), dict) else {}
            d[name] = value
            changed.append(f"{key}={value!r:.30}")
        root = tmp_path / f"c{case}" / "msrun_log"
        root.mkdir(parents=True)
        for rank in range(2):
            (root / f"worker_{rank}.log").write_text(pprint.pformat(cfg, width=100) + "\n" + steps)
        try:
            want = strategy_from_yaml(cfg)
            layout = want.meta()
        except BadInput:
            want = layout = None
        run = mfl.parse_mindformers_dir(root)      # anything but a Run (or BadInput) fails the test
        for k, s in ref.scalars.items():
            assert _same(run.series(k), s), (changed, k)
        par = run.meta["parallel"]
        if layout is None:
            assert par == {"world_size": 2}, (changed, par)
            if cfg.get("parallel_config") is None:     # no layout printed: none claimed
                outcomes["no layout printed"] += 1
                continue
            assert any("parallel_config in the printed config not read" in n for n in run.notes), (changed, run.notes)
            outcomes["layout not read, noted"] += 1
        else:
            assert par == {**layout, "world_size": 2}, (changed, par)
            outcomes["layout read"] += 1
    print(f"\nfuzz printed parallel configs: {dict(outcomes)}")
    assert outcomes["layout not read, noted"] > 10
