"""Fuzz family for `align convert-weights` (issue 24): READ-RIGHT-OR-REFUSED.

Seeded and bounded (~200 cases, a few seconds). A tiny real state_dict is written as a torch_dist folder
(two .distcp shards), a legacy Megatron TP=2 folder (mp_rank_*/model_optim_rng.pt), a plain .pt and a
MindFormers safetensors file; each is corrupted (truncated, flipped bits, a missing shard, header garbage,
nested JSON / pickle, huge declared sizes, a bad latest_checkpointed_iteration.txt) and converted through the
CLI. Every case must either convert exactly (equal to the clean conversion) or fail/refuse (exit 1 or 2) with
one line and write nothing; never a pass with wrong or missing tensors, never a traceback.

One class is reported apart: bits flipped inside safetensors tensor data. The format has no checksum, so
such a file is indistinguishable from a file holding those values; the case must then convert with every
name, shape and dtype intact and at most as many changed values as flipped bits ("values changed, no
checksum"). torch's archives do carry a CRC-32 per record, which the readers check, so a flip there is refused.

`pytest -s` prints the Counter of outcomes.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import random
import shutil
import struct
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from align.cli import main  # noqa: E402
from checkpoints.mindformers import read_safetensors  # noqa: E402
from tests.helpers.tiny_checkpoints import HEADS, save_legacy, save_pt, save_torch_dist, tiny_state  # noqa: E402

SEED = 24
TRIALS = 20         # random trials per (format, corruption)


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []

    def run(self, label: str, src: Path, to: str, case: Path, names: list[str],
            expect: Callable[[Path], str]) -> None:
        """Convert ``src`` into ``case/out.*``; ``expect(out)`` -> "exact" or a problem description."""
        out = case / ("out.pt" if to == "megatron" else "out.safetensors")
        before = {p.name for p in case.iterdir()}
        so, se = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                rc = main(["convert-weights", str(src), "--to", to, "--out", str(out), *HEADS])
        except BaseException:  # noqa: BLE001 - a traceback is what this test hunts
            self.outcomes[f"{label}: traceback"] += 1
            self.problems.append(f"{label}: traceback\n{traceback.format_exc(limit=-4)}")
            return
        lines = (so.getvalue() + se.getvalue()).strip().splitlines()
        if rc == 0:
            verdict = expect(out)
            self.outcomes[f"{label}: {verdict if verdict.startswith(('exact', 'values changed')) else 'WRONG'}"] += 1
            if not verdict.startswith(("exact", "values changed")):
                self.problems.append(f"{label}: passed with {verdict}")
            return
        self.outcomes[f"{label}: refused exit {rc}"] += 1
        written = {p.name for p in case.iterdir()} - before
        if rc not in (1, 2):
            self.problems.append(f"{label}: exit {rc}")
        if written:
            self.problems.append(f"{label}: exit {rc} but wrote {sorted(written)}")
        if len(lines) != 1 or not any(n in lines[0] for n in names):
            self.problems.append(f"{label}: exit {rc} without one line naming the input: {lines[:3]}")


def _compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> str:
    if sorted(got) != sorted(want):
        return f"names differing: {sorted(set(got) ^ set(want))[:3]}"
    for k, v in want.items():
        if got[k].shape != v.shape or got[k].dtype != v.dtype or not np.array_equal(got[k], v):
            return f"tensor {k} different"
    return "exact"


def _flip(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> tuple[bytes, int]:
    b = bytearray(data)
    hi = len(b) if hi is None else hi
    n = rng.randint(1, 6)
    for _ in range(n):
        i = rng.randrange(lo, hi)
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b), n


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_ckpt_clean")
    state = tiny_state(seed=SEED)
    pt = save_pt(state, root / "m.pt")
    ref_st = root / "ref.safetensors"
    assert main(["convert-weights", str(pt), "--to", "mindformers", "--out", str(ref_st), *HEADS]) == 0
    ref, _ = read_safetensors(ref_st)
    return {"root": root, "state": state, "pt": pt, "ref_st": ref_st, "ref": ref,
            "dist": save_torch_dist(state, root / "dist"), "legacy": save_legacy(state, root / "legacy")}


def test_corrupted_checkpoints_read_right_or_refused(clean, tmp_path) -> None:
    rng = random.Random(SEED)
    tally = Tally()
    k = 0
    ref, state = clean["ref"], clean["state"]

    def fresh() -> Path:
        nonlocal k
        k += 1
        d = tmp_path / f"case{k:04d}"
        d.mkdir()
        return d

    def to_mf_exact(out: Path) -> str:
        return _compare(read_safetensors(out)[0], ref)

    def to_mg_exact(out: Path) -> str:
        back = torch.load(out, weights_only=True)
        return _compare({n: t.numpy() for n, t in back.items()}, state)

    # -- 1. torch_dist folders ----------------------------------------------------------------------------
    it_name = "iter_0000001"
    shards = sorted(p.name for p in (clean["dist"] / it_name).glob("*.distcp"))

    def dist_case(label: str, mutate: Callable[[Path], None]) -> None:
        case = fresh()
        root = case / "ck"
        shutil.copytree(clean["dist"], root)
        mutate(root / it_name)
        tally.run(f"torch_dist {label}", root, "mindformers", case, [str(root)], to_mf_exact)

    dist_case("clean", lambda it: None)
    for _ in range(TRIALS):
        name = rng.choice(shards)
        cut = rng.randrange(0, (clean["dist"] / it_name / name).stat().st_size)
        dist_case("truncated shard", lambda it, n=name, c=cut: (it / n).write_bytes((it / n).read_bytes()[:c]))
        flipped, _ = _flip((clean["dist"] / it_name / name).read_bytes(), rng)
        dist_case("flipped shard bytes", lambda it, n=name, f=flipped: (it / n).write_bytes(f))
        meta = (clean["dist"] / it_name / ".metadata").read_bytes()
        flipped_meta, _ = _flip(meta, rng)
        dist_case("flipped metadata bytes", lambda it, f=flipped_meta: (it / ".metadata").write_bytes(f))
        cut = rng.randrange(0, len(meta))
        dist_case("truncated metadata", lambda it, m=meta, c=cut: (it / ".metadata").write_bytes(m[:c]))
        garbage = rng.randbytes(rng.randint(1, 2048))
        dist_case("garbage metadata", lambda it, g=garbage: (it / ".metadata").write_bytes(g))
    for name in shards:
        dist_case("missing shard", lambda it, n=name: (it / n).unlink())
    deep = b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b"."      # a list in a list ... 100000 deep
    dist_case("nested pickle metadata", lambda it, d=deep: (it / ".metadata").write_bytes(d))

    def huge_size(it: Path, factor: int) -> None:
        from checkpoints.megatron import _MetadataUnpickler

        md = _MetadataUnpickler(io.BytesIO((it / ".metadata").read_bytes()), it).load()
        key = next(n for n in md.state_dict_metadata if "linear_fc1" in n)
        entry = md.state_dict_metadata[key]
        entry.size = torch.Size([entry.size[0] * factor, *entry.size[1:]])
        (it / ".metadata").write_bytes(pickle.dumps(md))

    for factor in (2, 10**6, 10**12):
        dist_case(f"declared size x{factor}", lambda it, f=factor: huge_size(it, f))
    for text in (b"abc", b"-1", b"\xff\x00\xfe", b"", b"99"):
        dist_case("bad latest_checkpointed_iteration.txt",
                  lambda it, t=text: (it.parent / "latest_checkpointed_iteration.txt").write_bytes(t))

    # -- 2. legacy mp_rank_* folders (TP=2) ---------------------------------------------------------------
    ranks = ["mp_rank_00", "mp_rank_01"]
    rel = {r: f"{it_name}/{r}/model_optim_rng.pt" for r in ranks}

    def legacy_case(label: str, mutate: Callable[[Path], None]) -> None:
        case = fresh()
        root = case / "ck"
        shutil.copytree(clean["legacy"], root)
        mutate(root)
        tally.run(f"legacy {label}", root, "mindformers", case, [str(root)], to_mf_exact)

    legacy_case("clean", lambda r: None)
    for _ in range(TRIALS):
        rank = rng.choice(ranks)
        blob = (clean["legacy"] / rel[rank]).read_bytes()
        cut = rng.randrange(0, len(blob))
        legacy_case("truncated rank file",
                    lambda r, f=rel[rank], c=cut: (r / f).write_bytes((r / f).read_bytes()[:c]))
        flipped, _ = _flip(blob, rng)
        legacy_case("flipped rank file bytes", lambda r, f=rel[rank], b=flipped: (r / f).write_bytes(b))
        garbage = rng.randbytes(rng.randint(1, 2048))
        legacy_case("garbage rank file", lambda r, f=rel[rank], g=garbage: (r / f).write_bytes(g))
    for rank in ranks:
        legacy_case("missing rank", lambda r, n=rank: shutil.rmtree(r / it_name / n))
    for text in (b"abc", b"-1", b"\xff\x00\xfe"):
        legacy_case("bad latest_checkpointed_iteration.txt",
                    lambda r, t=text: (r / "latest_checkpointed_iteration.txt").write_bytes(t))

    # -- 3. a plain torch .pt state_dict ------------------------------------------------------------------
    pt_blob = clean["pt"].read_bytes()
    for _ in range(TRIALS):
        cut = rng.randrange(0, len(pt_blob))
        for label, data in (("truncated", pt_blob[:cut]), ("flipped", _flip(pt_blob, rng)[0])):
            case = fresh()
            src = case / "m.pt"
            src.write_bytes(data)
            tally.run(f"pt {label}", src, "mindformers", case, [str(src)], to_mf_exact)

    # -- 4. MindFormers safetensors -----------------------------------------------------------------------
    st_blob = clean["ref_st"].read_bytes()
    (n_head,) = struct.unpack("<Q", st_blob[:8])
    head, data = st_blob[8:8 + n_head], st_blob[8 + n_head:]

    def st_case(label: str, blob: bytes, expect: Callable[[Path], str] = to_mg_exact) -> None:
        case = fresh()
        src = case / "mf.safetensors"
        src.write_bytes(blob)
        tally.run(f"safetensors {label}", src, "megatron", case, [str(src)], expect)

    st_case("clean", st_blob)
    for _ in range(TRIALS):
        st_case("truncated", st_blob[:rng.randrange(0, len(st_blob))])
        st_case("flipped header bytes", _flip(st_blob, rng, 0, 8 + n_head)[0])
        garbage = rng.randbytes(rng.randint(1, n_head))
        st_case("header garbage", struct.pack("<Q", len(garbage)) + garbage + data)
        flipped, nflips = _flip(st_blob, rng, 8 + n_head)

        def data_flip(out: Path, n: int = nflips) -> str:
            back = {k: t.numpy() for k, t in torch.load(out, weights_only=True).items()}
            if sorted(back) != sorted(state) or any(back[k].shape != v.shape or back[k].dtype != v.dtype
                                                    for k, v in state.items()):
                return "names/shapes/dtypes changed"
            changed = sum(int((back[k] != v).sum()) for k, v in state.items())
            return "exact" if changed == 0 else ("values changed, no checksum in safetensors" if changed <= n
                                                 else f"{changed} values changed by {n} flipped bits")

        st_case("flipped tensor-data bytes", flipped, data_flip)
    nested_head = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    st_case("nested JSON header", struct.pack("<Q", len(nested_head)) + nested_head + data)
    st_case("huge header length", struct.pack("<Q", 2**63) + st_blob[8:])
    big = head.replace(b'"shape":[', b'"shape":[999999999999,', 1)
    st_case("huge declared shape", struct.pack("<Q", len(big)) + big + data)
    off = head.replace(b'"data_offsets":[', b'"data_offsets":[1', 1)   # [0,...] -> [10,...]: overlaps
    st_case("shifted data offsets", struct.pack("<Q", len(off)) + off + data)
    st_case("trailing bytes", st_blob + b"\x00" * 8)
    st_case("empty file", b"")

    summary = "\n".join(f"  {n:4d}  {what}" for what, n in sorted(tally.outcomes.items()))
    print(f"\nconvert-weights fuzz (seed {SEED}, {sum(tally.outcomes.values())} cases):\n{summary}")
    print(Counter(o.split(": ", 1)[1] for o in tally.outcomes.elements()))
    assert not tally.problems, "\n".join(tally.problems[:10])
    for fmt in ("torch_dist", "legacy", "safetensors"):
        assert tally.outcomes[f"{fmt} clean: exact"] == 1, fmt


# -- 5. files that are not regular files (issue 38) --------------------------------------------------------------
# A FIFO named like a checkpoint blocked zipfile.is_zipfile / open forever; a .pt linked to /dev/zero read until
# MemoryError. Every verb that reads weights (convert-weights, compare-weights, capture-env --weights) must
# refuse each in one line, exit 2, naming the file, and write nothing.

def _special(path: Path, kind: str) -> None:
    import os

    if path.exists() or path.is_symlink():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


def test_special_files_are_refused_by_every_weights_verb(clean, tmp_path) -> None:
    it = "iter_0000001"
    shard = sorted(p.name for p in (clean["dist"] / it).glob("*.distcp"))[0]
    layouts: dict[str, tuple[Callable[[Path], Path], str]] = {   # label -> (build the input, file made special)
        "pt": (lambda d: d / "m.pt", "m.pt"),
        "safetensors": (lambda d: d / "mf.safetensors", "mf.safetensors"),
        "ckpt": (lambda d: d / "m.ckpt", "m.ckpt"),
        "safetensors folder": (lambda d: shutil.copy(clean["ref_st"], d / "a.safetensors") and d,
                               "b.safetensors"),
        "legacy rank file": (lambda d: shutil.copytree(clean["legacy"], d / "ck"),
                             f"ck/{it}/mp_rank_01/model_optim_rng.pt"),
        "torch_dist shard": (lambda d: shutil.copytree(clean["dist"], d / "ck"), f"ck/{it}/{shard}"),
        "torch_dist metadata": (lambda d: shutil.copytree(clean["dist"], d / "ck"), f"ck/{it}/.metadata"),
    }
    problems, k = [], 0
    for label, (build, special) in layouts.items():
        for kind in ("fifo", "dev_zero"):
            # (convert-weights and capture-env read no folder of .safetensors files)
            for verb in ("compare-weights",) if label == "safetensors folder" else \
                    ("convert-weights", "compare-weights", "capture-env"):
                k += 1
                case = tmp_path / f"s{k:03d}"
                case.mkdir()
                src = Path(build(case))
                _special(case / special, kind)
                out = case / "out"
                argv = {"convert-weights": ["convert-weights", str(src), "--to", "mindformers", "--out",
                                            str(out) + ".safetensors", *HEADS],
                        "compare-weights": ["compare-weights", str(clean["pt"]), str(src), "--out", str(out)],
                        "capture-env": ["capture-env", "--framework", "torch", "--weights", str(src), "--out",
                                        str(out) + ".json"]}[verb]
                so, se = io.StringIO(), io.StringIO()
                before = {p.name for p in case.iterdir()}
                with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                    rc = main(argv)
                lines = (so.getvalue() + se.getvalue()).strip().splitlines()
                written = {p.name for p in case.iterdir()} - before
                ok = rc == 2 and len(lines) == 1 and str(case / special) in lines[0] and not written
                if kind == "fifo":
                    ok = ok and "is a FIFO" in lines[0]
                if not ok:
                    problems.append(f"{label} {kind} {verb}: exit {rc}, wrote {sorted(written)}: {lines[:2]}")
    assert not problems, "\n".join(problems)


# -- 6. compare-weights over damaged checkpoints (issue 38) ------------------------------------------------------
# compare-weights reads through the lazy readers (checkpoints.weights.open_weights), not convert-weights' path.
# A damaged side is compared with the clean other side: refused in one line naming it (exit 2, nothing
# written), or compared; a comparison of a CRC-protected format (torch_dist, legacy, .pt) must then pass with
# every parameter equal; a safetensors file (no checksum) may differ at most in values, never in names.

def test_compare_weights_over_damaged_checkpoints(clean, tmp_path) -> None:
    import json

    rng = random.Random(SEED + 38)
    it = "iter_0000001"
    problems: list[str] = []
    outcomes: Counter[str] = Counter()
    for name in ("dist", "legacy", "ref_st"):     # the oracle's premise: each clean layout compares as a pass
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["compare-weights", str(clean["pt"]), str(clean[name]), "--out", str(tmp_path / name), *HEADS])
        assert rc == 0 and json.loads((tmp_path / name / "summary.json").read_text())["verdict"] == "pass", name
    for k in range(24):
        fmt = rng.choice(["pt", "torch_dist", "legacy", "safetensors"])
        case = tmp_path / f"c{k:03d}"
        case.mkdir()
        if fmt == "pt":
            victim = src = Path(shutil.copy(clean["pt"], case / "m.pt"))
        elif fmt == "safetensors":
            victim = src = Path(shutil.copy(clean["ref_st"], case / "mf.safetensors"))
        else:
            src = Path(shutil.copytree(clean["dist" if fmt == "torch_dist" else "legacy"], case / "ck"))
            victim = rng.choice([p for p in (src / it).rglob("*") if p.is_file()])
        data = victim.read_bytes()
        how = rng.choice(["truncate", "flip", "garbage"])
        victim.write_bytes(data[:rng.randrange(len(data))] if how == "truncate" else _flip(data, rng)[0]
                           if how == "flip" else rng.randbytes(rng.randint(1, 4096)))
        base, cand = clean["pt"], src
        out = case / "out"
        so, se = io.StringIO(), io.StringIO()
        label = f"{fmt} {how} ({victim.name})"
        try:
            with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                rc = main(["compare-weights", str(base), str(cand), "--out", str(out), *HEADS])
        except BaseException:  # noqa: BLE001 - a traceback is what this test hunts
            problems.append(f"{label}: traceback\n{traceback.format_exc(limit=-4)}")
            continue
        err = se.getvalue().strip().splitlines()
        if rc == 2:
            outcomes[f"{fmt}: refused"] += 1
            if len(err) != 1 or str(case) not in err[0] or out.exists():
                problems.append(f"{label}: exit 2 without one line naming it, or wrote {out}: {err[:2]}")
            continue
        if rc not in (0, 1):
            problems.append(f"{label}: exit {rc}: {err[:2]}")
            continue
        summary = json.loads((out / "summary.json").read_text())
        verdict = summary["verdict"]
        outcomes[f"{fmt}: compared, {verdict}"] += 1
        if fmt != "safetensors" and verdict != "pass":
            problems.append(f"{label}: a CRC-protected checkpoint compared with verdict {verdict}, not refused")
    print(f"\ncompare-weights over damaged checkpoints: {dict(sorted(outcomes.items()))}")
    assert not problems, "\n".join(problems[:10])
