"""Issue 24 fuzz families for the readers of users' files: READ-RIGHT-OR-REFUSED.

Each case damages a real-shaped input (seeded, bounded) and checks: every value that survived intact is read
exactly; a value that did not survive is absent with a note, or the input is refused with a one-line
BadInput; never a wrong value, never a traceback. ``pytest -s`` prints the outcome counts per family.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
from test_tensorboard_import import _offsets  # event-record boundaries, one reader for both tests

from core.errors import BadInput
from sources import load_run
from sources.megatron_log import parse_megatron_log

DATA = Path(__file__).resolve().parent / "data" / "msprobe" / "statistics" / "pt"
CASES = 60


def _outcome(fn, counts: Counter):
    """Run a reader: the Run, or None when it refused with a one-line BadInput (any other error fails)."""
    try:
        run = fn()
    except BadInput as exc:
        assert "\n" not in str(exc)
        counts["refused"] += 1
        return None
    counts["noted" if run.notes else "read"] += 1
    return run


def _report(family: str, counts: Counter) -> None:
    print(f"\nfuzz {family}: {dict(sorted(counts.items()))}")


# --- Megatron log lines: control bytes and huge numbers ----------------------------------------------------------

REC = ("[2024-05-01 10:12:31] iteration {it:>8}/    1000 | consumed samples: {cs:>12} | elapsed time per iteration "
       "(ms): 824.3 | learning rate: 8.956362E-05 | global batch size:    16 | lm loss: {loss} | loss scale: "
       "4096.0 | grad norm: {gn} | num zeros: 430.0 | number of skipped iterations:   0 | number of nan "
       "iterations:   0 |")
CTL = [b"\x00", b"\x01", b"\x0b", b"\x0c", b"\x1b", b"\x1f", b"\x7f"]
HUGE = [b"1e400", b"-1E+999", b"9" * 400, b"9" * 5000, b"1_0", "\u0661".encode(), b"6.9.2"]


@pytest.mark.parametrize("n", [8, 200])   # field by field, and the bulk readers
def test_megatron_lines_with_control_bytes_and_huge_numbers(tmp_path, n):
    rng = random.Random(24 + n)
    counts: Counter = Counter()
    for case in range(CASES):
        truth = {i: float(f"{rng.uniform(1, 10):.6E}") for i in range(1, n + 1)}
        lines = [REC.format(it=i, cs=i * 16, loss=f"{truth[i]:.6E}", gn="1.479").encode() for i in truth]
        k = rng.randrange(1, n + 1)
        victim = lines[k - 1]
        field = rng.choice([b"iteration", b"lm loss: ", b"consumed samples: "])
        start = victim.index(field) + len(field)
        while victim[start:start + 1] == b" ":
            start += 1
        end = start
        while victim[end:end + 1] not in (b" ", b"/", b"|"):
            end += 1
        if rng.random() < 0.5:   # a control byte inserted in, before or after the number, or replacing a digit
            pos = rng.randint(start, end)
            ctl = rng.choice(CTL)
            # (a NUL that replaced a digit of a value is a known gap: NULs in values are dropped, as
            # test_a_few_nul_bytes_are_removed_and_noted requires; so NULs go into values inserted only)
            replace = rng.random() < 0.5 and pos < end and (ctl != b"\x00" or field == b"iteration")
            victim = victim[:pos] + ctl + victim[pos + replace:]
        else:
            victim = victim[:start] + rng.choice(HUGE) + victim[end:]
        lines[k - 1] = victim
        p = tmp_path / f"m{case}.log"
        p.write_bytes(b"\n".join(lines) + b"\n")
        run = _outcome(lambda p=p: parse_megatron_log(p), counts)
        if run is None:
            continue
        loss = run.series("loss").to_dict()
        for step, v in loss.items():   # every value read is the one written for that step
            assert step in truth and v == truth[step], (victim, step, v)
            if step == k and field == b"lm loss: " and v is not None and victim.count(b"\x00"):
                assert any("NUL" in x for x in run.notes), victim   # a NUL dropped from the loss is said
        cs = run.series("consumed_samples").to_dict()
        assert all(v == s * 16 for s, v in cs.items()), victim
        missing = set(truth) - set(loss)
        assert missing <= {k}, (victim, missing)
        if missing or (field == b"consumed samples: " and k not in cs):
            assert run.notes, victim       # what was not read is said
    _report(f"megatron_log[{n}]", counts)


# --- golden values JSON ----------------------------------------------------------------------------------------

GOLDEN_BAD_KEYS = ["1_0", "\u0661", "\uff11", "+1", "-1", " 1", "1.0", "1e3", "9" * 40, ""]
GOLDEN_BAD_VALUES = ["1e400", "-1E+999", "9" * 400, "9" * 5000, '"1_0"', '"1e400"', "true", "null", '"x"', "[1]"]


def test_golden_values(tmp_path):
    rng = random.Random(2400)
    counts: Counter = Counter()
    for case in range(CASES):
        truth = {s: round(rng.uniform(1, 10), 6) for s in range(1, 21)}
        items = [f'"{s}": {v!r}' for s, v in truth.items()]
        i = rng.randrange(len(items))
        kind = rng.choice(["key", "value", "nest", "cut", "other_entry", "nan"])
        if kind == "key":
            items[i] = json.dumps(rng.choice(GOLDEN_BAD_KEYS)) + ": 1.0"
        elif kind == "value":
            items[i] = f'"{i + 1}": {rng.choice(GOLDEN_BAD_VALUES)}'
        head = '{"lm loss": {"start_step": 1, "end_step": 20, "step_interval": 1, "values": {'
        text = head + ", ".join(items) + "}}}"
        if kind == "nest":
            depth = rng.choice([50, 5000, 200_000])
            text = text.replace('"values": {', '"values": {"x": ' + "[" * depth + "]" * depth + ", ", 1)
        elif kind == "cut":
            text = text[: rng.randrange(len(text))]
        elif kind == "other_entry":   # an inference entry (not a curve), nested: skipped (noted) or too deep
            depth = rng.choice([50, 200_000])
            text = '{"generated_text": {"x": ' + "[" * depth + "]" * depth + "}, " + text[1:]
        elif kind == "nan":
            truth[i + 1] = math.nan
            text = text.replace(items[i], f'"{i + 1}": "nan"')
        p = tmp_path / f"g{case}.json"
        p.write_text(text)
        run = _outcome(lambda p=p: load_run(p, "golden_values"), counts)
        if run is None:
            continue
        for step, v in run.series("loss").items():
            assert step in truth and (v == truth[step] or math.isnan(v) and math.isnan(truth[step])), (step, v)
    _report("golden_values", counts)


# --- TensorBoard event files -----------------------------------------------------------------------------------

def test_tensorboard_event_files(tmp_path):
    tb = pytest.importorskip("torch.utils.tensorboard")
    src = tmp_path / "src"
    w = tb.SummaryWriter(log_dir=str(src))
    truth = {s: 10.0 - s * 0.0625 for s in range(1, 41)}   # exact in float32
    for s, v in truth.items():
        w.add_scalar("lm loss", v, s)
    w.close()
    (f,) = src.glob("events.out.tfevents.*")
    clean = f.read_bytes()
    offs = _offsets(clean)
    rng = random.Random(2401)
    counts: Counter = Counter()
    for case in range(CASES):
        data = bytearray(clean)
        kind = rng.choice(["flip", "flips", "cut", "insert", "zero"])
        if kind in ("flip", "flips"):
            for _ in range(1 if kind == "flip" else rng.randint(2, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            del data[rng.randrange(1, len(data)):]
        elif kind == "insert":
            at = rng.choice(offs[1:])
            data[at:at] = rng.randbytes(rng.randint(1, 40))
        else:
            at = rng.randrange(len(data))
            data[at: at + rng.randint(1, 30)] = bytes(min(30, len(data) - at))
        d = tmp_path / f"tb{case}"
        d.mkdir()
        (d / f.name).write_bytes(bytes(data))
        run = _outcome(lambda d=d: load_run(d, "tensorboard"), counts)
        if run is None:
            continue
        loss = run.series("loss").to_dict() if "loss" in run.scalars else {}
        for s, v in loss.items():
            assert s in truth and v == truth[s], (kind, s, v)
        if len(loss) < len(truth) and bytes(data) != clean:
            assert run.notes, kind    # a lost step is said
    _report("tensorboard", counts)


# --- msprobe dump folders --------------------------------------------------------------------------------------

def test_msprobe_dump_folders(tmp_path):
    rng = random.Random(2402)
    counts: Counter = Counter()
    src = next(DATA.glob("step0/*"))
    dump_text = (src / "dump.json").read_text()
    for case in range(CASES):
        d = tmp_path / f"d{case}"
        shutil.copytree(DATA, d)
        folder = next(d.glob("step0/*"))
        target = folder / rng.choice(["dump.json", "dump.json", "construct.json"])
        text = target.read_text()
        kind = rng.choice(["cut", "flip", "nest", "huge", "empty_data"])
        if kind == "cut":
            text = text[: rng.randrange(len(text))]
        elif kind == "flip":
            b = bytearray(text.encode())
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(b))
            text = None
        elif kind == "nest":
            depth = rng.choice([100, 200_000])
            text = '{"data": ' + "[" * depth + "]" * depth + "}"
        elif kind == "huge":
            text = text.replace('"Max": ', '"Max": 1' + "0" * 5000 + " + 0 * ", 1).replace(" + 0 * ", ", \"x\": ", 1)
        else:
            text = '{"task": "statistics", "level": "L0", "data": {}}'
        if text is not None:
            target.write_text(text)
        run = _outcome(lambda d=d: load_run(d, "msprobe"), counts)
        if run is None:
            continue
        if target.name == "dump.json":   # read: the dump.json is a real one (its damage kept it valid JSON)
            from sources.jsontext import load_json
            doc = load_json(folder / "dump.json")
            assert isinstance(doc, dict) and isinstance(doc.get("data"), dict) and doc["data"], kind
        from sources.msprobe import open_msprobe
        try:
            rows, _ = open_msprobe(d).layer_rows(1)
        except BadInput as exc:
            assert "\n" not in str(exc)
            continue
        if target.name == "construct.json" or (folder / "dump.json").read_text() == dump_text:
            ref, _ = open_msprobe(DATA).layer_rows(1)
            assert [(r["module"], r["kind"], r["shape"]) for r in rows] == \
                [(r["module"], r["kind"], r["shape"]) for r in ref]
            for a, b in zip(rows, ref, strict=True):
                assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in ("max", "min", "norm"))
    _report("msprobe", counts)


# --- MindSpore dump folders (issue 38) ---------------------------------------------------------------------------
# The real dump in tests/data/mindspore_dump/base (MindSpore 2.10, CPU, GRAPH), damaged where damage can be told
# from data: the execution order (control bytes, flipped bits, a lost line), the .npy headers (flipped bits, a
# cut), statistic.csv (a BOM, control bytes, a non-digit flipped to a non-digit), and any file replaced by a FIFO,
# a device or a folder. Bits flipped in tensor data are left out: no checksum tells them from other values.
# READ-RIGHT-OR-REFUSED: both steps' rows equal the clean dump's, or a one-line BadInput.

MS_DUMP = Path(__file__).resolve().parent / "data" / "mindspore_dump" / "base"
MS_ITER0 = ("rank_0", "Net", "0", "0")
MS_ORDER = ("rank_0", "execution_order", "ms_execution_order_graph_0.csv")
_NON_DIGITS = [b for b in range(32, 127) if not chr(b).isdigit() and chr(b) not in ".-+eE"]


def _ms_rows(d: Path) -> list[tuple]:
    from sources.mindspore_dump import open_mindspore_dump

    dump = open_mindspore_dump(d)
    out = []
    for step in dump.array_steps():
        rows, _ = dump.layer_rows(step)
        out += [(step, r["module"], r["kind"], r["shape"], r["dtype"],
                 *(None if isinstance(r[k], float) and math.isnan(r[k]) else r[k]
                   for k in ("max", "min", "mean", "norm", "nan", "inf"))) for r in rows]
    return out


def _ms_statistic_dump(dst: Path) -> Path:
    """The base dump with iteration 0 as statistic.csv (MindSpore's documented layout) instead of .npy files."""
    import numpy as np

    shutil.copytree(MS_DUMP, dst)
    it = dst.joinpath(*MS_ITER0)
    lines = ["Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,Max Value,Min Value,"
             "Avg Value,L2Norm Value,NaN Count,Negative Inf Count,Positive Inf Count\n"]
    for f in sorted(it.glob("*.npy")):
        op_type, rest = f.name.split(".", 1)
        op, task, stream, ts, io, slot, _fmt, dtype = rest[:-4].rsplit(".", 7)
        a = np.load(f).astype(np.float64)
        lines.append(f'{op_type},{op},{task},{stream},{ts},{io},{slot},{a.nbytes},{dtype.lower()},'
                     f'"({",".join(map(str, a.shape))})",{a.max()!r},{a.min()!r},{a.mean()!r},'
                     f'{np.linalg.norm(a)!r},0,0,0,\n')
        f.unlink()
    (it / "statistic.csv").write_text("".join(lines))
    return dst


def _special_file(p: Path, rng: random.Random) -> str:
    import os

    kind = rng.choice(["fifo", "dev_zero", "folder"])
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev_zero":
        p.symlink_to("/dev/zero")
    else:
        p.mkdir()
    return kind


def test_mindspore_dump_folders(tmp_path):
    rng = random.Random(2403)
    counts: Counter = Counter()
    stat_clean = _ms_statistic_dump(tmp_path / "stat_clean")
    refs = {"npy": _ms_rows(MS_DUMP), "stat": _ms_rows(stat_clean)}
    for case in range(40):
        base = rng.choice(["npy", "stat"])
        d = tmp_path / f"ms{case}"
        shutil.copytree(MS_DUMP if base == "npy" else stat_clean, d)
        kinds = ["order_control", "order_flip", "order_lost_line", "special"] + (
            ["npy_header_flip", "npy_cut"] if base == "npy" else ["stat_bom", "stat_control", "stat_flip"])
        kind = rng.choice(kinds)
        it = d.joinpath(*MS_ITER0)
        order = d.joinpath(*MS_ORDER)
        if kind.startswith("order"):
            data = bytearray(order.read_bytes())
            starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10][:-1]
            if kind == "order_control":
                at = rng.randrange(starts[1], len(data))
                data[at:at] = rng.choice(CTL)
            elif kind == "order_flip":
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            else:
                k = rng.randrange(1, len(starts))
                end = starts[k + 1] if k + 1 < len(starts) else len(data)
                del data[starts[k]:end]
            order.write_bytes(bytes(data))
        elif kind.startswith("npy"):
            f = rng.choice(sorted(it.glob("*.output.0.*.npy")))     # mostly cell outputs: the files read
            data = bytearray(f.read_bytes())
            head = data.index(b"\n") + 1          # the .npy header ends with a newline
            if kind == "npy_header_flip":
                data[rng.randrange(head)] ^= 1 << rng.randrange(8)
            else:
                del data[rng.randrange(len(data)):]
            f.write_bytes(bytes(data))
        elif kind.startswith("stat"):
            f = it / "statistic.csv"
            data = bytearray(f.read_bytes())
            if kind == "stat_bom":
                data[0:0] = "\ufeff".encode()
            elif kind == "stat_control":
                at = rng.randrange(len(data))
                data[at:at] = rng.choice(CTL)
            else:   # a byte that is not part of a number turned into another such byte: never another number
                at = rng.choice([i for i, c in enumerate(data) if c in _NON_DIGITS])
                data[at] = rng.choice([c for c in _NON_DIGITS if c != data[at]])
            f.write_bytes(bytes(data))
        else:
            pool = sorted(it.iterdir()) + [order]
            kind += "_" + _special_file(rng.choice(pool), rng)
        try:
            rows = _ms_rows(d)
        except BadInput as exc:
            assert "\n" not in str(exc), kind
            counts[f"{kind}: refused"] += 1
            continue
        assert rows == refs[base], (kind, case)     # read right: every row as in the clean dump
        counts[f"{kind}: read right"] += 1
    _report("mindspore_dump", counts)
    assert sum(v for k, v in counts.items() if k.endswith("refused")) > 10   # the damage is seen


# --- check-config's inputs: hostile values, and every other kind of input in either place (issue 38) ------------
# The shipped MindFormers YAML and Megatron launch script (tests/data/configs) with a hostile value at a key the
# checklist sizes lists or does arithmetic from, and the other inputs the product reads put where a config
# belongs. Each run is the table (exit 0/1) or one line (exit 2); never an internal error, never a list sized
# from 10**12. A wrong kind is refused naming what it looks like.

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
MF_KEYS = ["parallel_config.data_parallel", "parallel_config.model_parallel", "parallel_config.pipeline_stage",
           "parallel_config.micro_batch_num", "parallel_config.expert_parallel", "model.model_config.num_layers",
           "model.model_config.offset", "model.model_config.pp_interleave_num", "runner_config.batch_size",
           "runner_config.gradient_accumulation_steps", "micro_batch_interleave_num", "lr_schedule.total_steps",
           "lr_schedule.warmup_ratio", "optimizer.betas", "model.model_config.moe_layer_freq",
           "model.model_config.first_k_dense_replace", "model.model_config.num_moe_experts", "parallel_config",
           "model.model_config", "parallel.pipeline_config"]
MG_FLAGS = ["--num-layers", "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
            "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers", "--micro-batch-size",
            "--global-batch-size", "--moe-layer-freq", "--num-experts", "--tensor-model-parallel-size"]
HOSTILE = [None, [1], "x", 10**12, -1, 0, 2.5, True, {"a": 1}, "([1]*999999999999)", [[0] * 4] * 3,
           [10**12, -10**12, 0, 0], 1e308, "nan"]


def _cli(argv: list[str]) -> tuple[int, list[str]]:
    import contextlib
    import io

    from align.cli import main

    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        rc = main(argv)
    return rc, se.getvalue().strip().splitlines()


def test_check_config_hostile_values_and_wrong_kinds(tmp_path):
    import yaml

    rng = random.Random(2404)
    counts: Counter = Counter()
    script, mf_text = CONFIGS / "megatron_qwen3_32b.sh", (CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text()
    for case in range(30):
        cfg = yaml.safe_load(mf_text)
        y, s = tmp_path / f"mf{case}.yaml", tmp_path / f"mg{case}.sh"
        value = rng.choice(HOSTILE)
        if rng.random() < 0.6:
            key = rng.choice(MF_KEYS)
            *blocks, name = key.split(".")
            d = cfg
            for part in blocks:
                d = d.setdefault(part, {}) if isinstance(d.get(part, {}), dict) else {}
            d[name] = value
            s.write_text(script.read_text())
            what = f"yaml {key}={value!r:.30}"
        else:
            flag = rng.choice(MG_FLAGS)
            text = value if not isinstance(value, (list, dict)) else json.dumps(value)[:200]
            s.write_text(script.read_text().replace("--bf16", f"--bf16 {flag} {text}", 1))
            what = f"megatron {flag} {text!s:.30}"
        y.write_text(yaml.safe_dump(cfg))
        rc, err = _cli(["check-config", str(s), str(y), "--json", str(tmp_path / f"o{case}.json")])
        assert rc in (0, 1, 2), (what, rc, err)
        if rc == 2:
            assert len(err) == 1 and (str(y) in err[0] or str(s) in err[0]), (what, err)
        counts[f"exit {rc}"] += 1
    # every other kind of input, in either place
    from align.cli import main

    capture = tmp_path / "env.json"
    assert main(["capture-env", "--framework", "torch", "--out", str(capture)]) == 0
    others = {capture: "an environment capture", DATA / "step0" / "rank0" / "dump.json": "an msprobe dump.json",
              Path(__file__).parent / "data" / "mindformers_train.log": "a MindFormers training log",
              Path(__file__).parent / "data" / "mindspore_dump" / "base": "a MindSpore dump folder"}
    good = {"megatron": script, "yaml": CONFIGS / "pretrain_qwen3_32b_4k.yaml"}
    for path, looks in others.items():
        for side in ("megatron", "yaml"):
            argv = [str(path), str(good["yaml"])] if side == "megatron" else [str(good["megatron"]), str(path)]
            rc, err = _cli(["check-config", *argv])
            assert rc == 2 and len(err) == 1 and looks in err[0] and str(path) in err[0], (path, side, err)
            counts["wrong kind refused by name"] += 1
    _report("check-config", counts)
