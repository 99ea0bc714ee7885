"""Before any compare: are these two different runs, in the usual roles?

Traps a user falls into that every later stage would accept: the same log passed twice (or a byte copy of it,
or a run store imported from it), where every comparison "passes" because nothing was compared; and the
roles swapped (the MindFormers run given as the baseline, the Megatron run as the candidate), where the
band, the mapping's direction and every message read the wrong way round. Each is a warning that names the
inputs, never a plain pass; with nothing to say, the stage passes and says what it checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from align.stages import Stage
from align.stages.evidence import Evidence
from core.findings import Finding, StageResult
from runstore.run import Run

STAGE_NAME = "input_sanity"
COMPONENT = "inputs"
#: Fewest common steps whose losses, equal bit for bit, make a pair suspicious: one or two steps of a
#: well-aligned deterministic pair may agree to the last bit; a whole run does not.
MIN_IDENTICAL_STEPS = 3
#: The same where a run's losses were read from a log (about 7 significant digits): a pair that agrees to
#: 1e-7 prints the same digits for a while, so only a long stretch of equal values is suspicious.
MIN_IDENTICAL_PRINTED = 50
#: Source kinds whose values are printed digits, not the numbers the run computed.
PRINTED_KINDS = ("megatron_log", "mindformers_log", "tensorboard", "golden_values")
_CHUNK = 8 << 20

# a run's side, from its source kind or recorded framework
_PYTORCH = ("megatron", "torch", "pytorch", "golden_values")
_MINDSPORE = ("mindformers", "mindspore")


def side(run: Run) -> str | None:
    """``"megatron"`` for a Megatron-LM / PyTorch run, ``"mindformers"`` for a MindFormers / MindSpore one,
    None when the run does not say (a TensorBoard folder)."""
    for text in (str(run.meta.get("framework") or ""), run.kind, str(run.meta.get("name_scheme") or "")):
        t = text.lower()
        if t.startswith(_PYTORCH):
            return "megatron"
        if t.startswith(_MINDSPORE):
            return "mindformers"
    return None


def same_path(a: str, b: str) -> bool:
    """The same file or folder (a symlink, a hard link or another spelling of the path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def same_bytes(a: str, b: str) -> bool:
    """Two regular files with the same content: sizes first, then chunk by chunk (stops at the first
    difference, so two different logs cost one read of their first chunk)."""
    pa, pb = Path(a), Path(b)
    try:
        if not (pa.is_file() and pb.is_file()) or pa.stat().st_size != pb.stat().st_size:
            return False
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            while True:
                x, y = fa.read(_CHUNK), fb.read(_CHUNK)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:     # unreadable: the readers have already said so, or will
        return False


def identical_scalars(a: Run, b: Run) -> tuple[int, list[str]]:
    """(common loss steps, scalar keys whose values over their common steps are equal bit for bit: NaN with
    the same bits counts as equal). Loss first when it is one of them."""
    equal, n_loss = [], 0
    for key in sorted(set(a.scalars) & set(b.scalars), key=lambda k: (k != "loss", k)):
        x, y = a.series(key), b.series(key)
        common = x.index.intersection(y.index)
        if key == "loss":
            n_loss = len(common)
        if len(common) == 0:
            continue
        vx = np.ascontiguousarray(x.loc[common].to_numpy(dtype=np.float64))
        vy = np.ascontiguousarray(y.loc[common].to_numpy(dtype=np.float64))
        if np.array_equal(vx.view(np.int64), vy.view(np.int64)):
            equal.append(key)
    return n_loss, equal


def printed(run: Run) -> bool:
    """Whether a run's scalars were read from printed digits (a log, or a store imported from one)."""
    source = run.meta.get("source")
    kind = source.get("kind") if isinstance(source, dict) else None
    return run.kind in PRINTED_KINDS or kind in PRINTED_KINDS


def _pair(res: StageResult, roles: tuple[str, str], paths: tuple[str, str], runs: tuple[Run, Run],
          compare_values: bool = True) -> str:
    """Warn when the pair is one input twice, a byte copy, or losses equal bit for bit; else what was checked."""
    (ra, rb), (pa, pb) = roles, paths
    if same_path(pa, pb):
        res.add(Finding(STAGE_NAME, "warn", COMPONENT, "same_input", pa, None,
                        f"the {ra} and the {rb} are the same {'folder' if Path(pa).is_dir() else 'file'} ({pa}"
                        + (f" and {pb}" if pa != pb else "") + "): every comparison below compares a run with "
                        f"itself and proves nothing; pass the {rb} run as the second argument"))
        return ""
    if same_bytes(pa, pb):
        res.add(Finding(STAGE_NAME, "warn", COMPONENT, "identical_content", pb, pa,
                        f"the {ra} {pa} and the {rb} {pb} are byte-for-byte copies of one file: every comparison "
                        "below compares a run with itself and proves nothing; was the other run's file meant?"))
        return ""
    if not compare_values:
        return f"{ra} and {rb} are different inputs"
    n, equal = identical_scalars(*runs)
    least = MIN_IDENTICAL_PRINTED if any(printed(r) for r in runs) else MIN_IDENTICAL_STEPS
    if "loss" in equal and n >= least:
        also = " (the grad norm too)" if "grad_norm" in equal else ""
        res.add(Finding(STAGE_NAME, "warn", COMPONENT, "identical_losses", n, least,
                        f"suspicious: the {rb}'s loss ({pb}) equals the {ra}'s ({pa}) bit for bit at all {n} "
                        f"common steps{also}; runs in two frameworks differ at least in the last bits, so this "
                        "looks like one run given twice (a log and the store imported from it, a copy of a "
                        "folder); unless the pair is a deterministic re-run of one setup, check the inputs"))
        return ""
    if "loss" in equal:
        return f"{ra} and {rb} are different inputs (their losses agree bit for bit at only {n} common steps)"
    return f"{ra} and {rb} are different inputs" + (f" (losses differ over {n} common steps)" if n else "")


def run(ev: Evidence) -> StageResult:
    res = StageResult(STAGE_NAME)
    inp = ev.inputs
    checked = [_pair(res, ("baseline", "candidate"), (inp.baseline, inp.candidate), (ev.baseline, ev.candidate))]
    if ev.lr0 is not None and inp.lr0 is not None:
        # at lr = 0 the weights never move: a good pair's losses may print the same digits at every step,
        # so only the same input twice (or a byte copy) is said
        checked.append(_pair(res, ("lr=0 baseline", "lr=0 candidate"), inp.lr0, ev.lr0, compare_values=False))
    sb, sc = side(ev.baseline), side(ev.candidate)
    if sb == "mindformers" and sc == "megatron":
        res.add(Finding(STAGE_NAME, "warn", COMPONENT, "roles_swapped", f"baseline {sb}, candidate {sc}",
                        "baseline megatron, candidate mindformers",
                        f"roles look swapped: the baseline {inp.baseline} is a MindFormers/MindSpore run "
                        f"({ev.baseline.kind}) and the candidate {inp.candidate} a Megatron/PyTorch one "
                        f"({ev.candidate.kind}); the baseline is the reference (Megatron-LM): swap them, "
                        f"`align report {inp.candidate} {inp.baseline} ...`"))
    else:
        roles = (f"roles: baseline {sb or ev.baseline.kind}, candidate {sc or ev.candidate.kind}")
        checked.append(roles)
    if ev.lr0 is not None and inp.lr0 is not None and (side(ev.lr0[0]), side(ev.lr0[1])) == ("mindformers",
                                                                                            "megatron"):
        res.add(Finding(STAGE_NAME, "warn", COMPONENT, "lr0_roles_swapped", "baseline mindformers, candidate megatron",
                        "baseline megatron, candidate mindformers",
                        f"the lr=0 pair looks swapped: --lr0 takes the baseline's (Megatron) run first; got the "
                        f"MindFormers/MindSpore run {inp.lr0[0]} first and the Megatron/PyTorch run {inp.lr0[1]} "
                        f"second: swap them, `--lr0 {inp.lr0[1]} {inp.lr0[0]}`"))
    if not res.findings:
        res.add(Finding(STAGE_NAME, "pass", COMPONENT, "inputs_checked", None, None,
                        "; ".join(c for c in checked if c) + " (checked: same path, byte copies, losses equal "
                        "bit for bit, swapped roles)"))
    res.details = {"baseline": inp.baseline, "candidate": inp.candidate,
                   "sides": {"baseline": sb, "candidate": sc}}
    return res


STAGE = Stage(
    name=STAGE_NAME, order=5, title="Inputs: two different runs, in the usual roles",
    needs="the baseline and the candidate (always there)",
    capture="nothing to capture: pass the Megatron-LM run as the baseline (first) and the MindFormers run as "
            "the candidate (second), two different runs",
    run=run, part="inputs",
    why="a pair that is one run twice compares nothing (every stage passes); swapped roles read every "
        "delta and the band the wrong way round",
    next="check the two paths: `align report MEGATRON_RUN MINDFORMERS_RUN --out DIR`")
