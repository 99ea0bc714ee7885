"""Fuzz (issue 14): every importer and every CLI verb on corrupted inputs, seeded and bounded.

Corruptions: flipped bytes, truncation at a line boundary and mid-line, binary garbage, empty files, a huge
line, NUL bytes, non-UTF-8 bytes, and for YAML / JSON a value of the wrong type at a random key. Every
command must end with exit 0 or 1 (notes allowed) or exit 2 with one line naming the file, never a
traceback; a log import must keep every step whose line survived intact (never dropped silently).
CLI verbs run in-process through ``align.cli.main`` (SystemExit caught) to stay fast. The outcome counts
are printed (``pytest -s``) for the issue note.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from align.cli import main
from core.errors import BadInput
from models import DEFAULT_PRESET, preset_path
from runstore import RunWriter
from sources.megatron_log import parse_megatron_log
from sources.mindformers_log import parse_mindformers_log

SEED = 14
DATA = Path(__file__).parent / "data"
REAL = ("[2024-05-01 10:12:31] iteration {it:>8}/    1000 | consumed samples: {cs:>12} | elapsed time per "
        "iteration (ms): 824.3 | learning rate: 8.956362E-05 | global batch size:    16 | lm loss: {loss:.6E} | "
        "loss scale: 4096.0 | grad norm: {g:.3f} | num zeros: 430.0 | number of skipped iterations:   0 | number "
        "of nan iterations:   0 |")
ARGS = """using world size: 2, data-parallel size: 1, context-parallel size: 1, tensor-model-parallel size: 2, \
pipeline-model-parallel size: 1
------------------------ arguments ------------------------
  adam_beta1 ...................................... 0.9
  adam_beta2 ...................................... 0.95
  hidden_size ..................................... 64
  lr .............................................. 0.0003
  num_attention_heads ............................. 4
  num_layers ...................................... 2
  seq_length ...................................... 32
  swiglu .......................................... True
  tensor_model_parallel_size ...................... 2
  weight_decay .................................... 0.1
-------------------- end of arguments ---------------------
"""
MF_YAML = {
    "seed": 1234, "runner_config": {"batch_size": 1, "gradient_accumulation_steps": 1},
    "optimizer": {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1},
    "lr_schedule": {"type": "CosineWithWarmUpLR", "learning_rate": 3.0e-4, "warmup_steps": 2, "total_steps": 40},
    "parallel_config": {"data_parallel": 1, "model_parallel": 2, "pipeline_stage": 1},
    "model": {"model_config": {"hidden_size": 64, "num_heads": 4, "num_layers": 2, "seq_length": 32,
                               "vocab_size": 128, "rms_norm_eps": 1.0e-5, "pad_token_id": 0, "eos_token_id": 2}},
}


def megatron_text(n: int = 40) -> str:
    rng = np.random.default_rng(0)
    lines = [REAL.format(it=i, cs=16 * i, loss=10 - i * 0.05 + rng.normal(0, 1e-3), g=1 + rng.random())
             for i in range(1, n + 1)]
    return (ARGS + "\n".join(lines[:20]) + "\n validation loss at iteration 20 | lm loss value: 9.0E+00 | "
            "lm loss PPL: 8.1E+03 | \n" + "\n".join(lines[20:]) + "\n")


# ------------------------------------------------------------------------------------------------------
# corruptions
# ------------------------------------------------------------------------------------------------------

def corrupt_bytes(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    lines = data.split(b"\n")
    cut = rng.randrange(1, max(2, len(lines)))
    pos = rng.randrange(0, max(1, len(data)))
    flipped = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        if flipped:
            i = rng.randrange(len(flipped))
            flipped[i] ^= 1 << rng.randrange(8)
    nul = bytearray(data)
    nul[pos:pos] = b"\x00" * rng.randint(1, 4)
    bad_utf8 = bytearray(data)
    bad_utf8[pos:pos] = b"\xff\xfe\xc3"
    huge = b"\n".join(lines[:cut] + [b"9" * 300_000 + b" | lm loss: " + b"x" * 300_000] + lines[cut:])
    digits = re.sub(rb"\d+", lambda m: b"9" * 40 if rng.random() < 0.02 else m.group(0), data)
    return [("flip", bytes(flipped)), ("truncate_line", b"\n".join(lines[:cut]) + b"\n"),
            ("truncate_byte", data[:pos]), ("garbage", rng.randbytes(rng.randint(1, 4096))), ("empty", b""),
            ("nul", bytes(nul)), ("non_utf8", bytes(bad_utf8)), ("huge_line", huge), ("huge_numbers", digits)]


WRONG = [None, "garbage", -1, 0, 2.5, [1, "x"], {"k": [1]}, True, "1e999", 10 ** 400]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def wrong_types(obj, rng: random.Random, n: int, dump) -> list[tuple[str, bytes]]:
    """``n`` copies of ``obj`` with one value (or the whole document) replaced by a value of another type."""
    out = []
    paths = list(_paths(obj))
    for _ in range(n):
        path = rng.choice(paths)
        value = rng.choice(WRONG if dump is json.dumps else WRONG[:-1])
        doc = json.loads(json.dumps(obj))
        if not path:
            doc = value
        else:
            cur = doc
            for k in path[:-1]:
                cur = cur[k]
            cur[path[-1]] = value
        out.append((f"type@{'.'.join(map(str, path)) or 'top'}", dump(doc).encode()))
    return out


def yaml_dump(obj) -> str:
    return yaml.safe_dump(obj, sort_keys=False)


# ------------------------------------------------------------------------------------------------------
# running a command
# ------------------------------------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []

    def cli(self, label: str, argv: list[str], names: list[str]) -> int | None:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # noqa: BLE001 - a traceback is exactly what this test hunts
            self.outcomes["traceback"] += 1
            self.problems.append(f"{label}: traceback\n{traceback.format_exc(limit=-3)}")
            return None
        self.outcomes[f"exit {rc}"] += 1
        if rc == 2:
            lines = err.getvalue().strip().splitlines()
            if len(lines) != 1 or not any(n in lines[0] for n in names):
                self.outcomes["exit 2 without a one-line reason naming the file"] += 1
                self.problems.append(f"{label}: exit 2 message {err.getvalue()[:300]!r}")
        elif rc not in (0, 1):
            self.problems.append(f"{label}: exit {rc}")
        return rc

    def call(self, label: str, fn, names: list[str]):
        try:
            got = fn()
        except BadInput as exc:
            self.outcomes["BadInput"] += 1
            msg = str(exc)
            if "\n" in msg or not any(n in msg for n in names):
                self.problems.append(f"{label}: BadInput not naming the file: {msg[:200]!r}")
            return None
        except BaseException:  # noqa: BLE001
            self.outcomes["traceback"] += 1
            self.problems.append(f"{label}: traceback\n{traceback.format_exc(limit=-3)}")
            return None
        self.outcomes["read"] += 1
        return got


def intact_megatron_steps(original: bytes, mutated: bytes) -> dict[int, float]:
    """Steps whose record line is still present, whole, in the mutated file (with its loss)."""
    have = set(mutated.split(b"\n"))
    ends_cut = not mutated.endswith(b"\n")
    last = mutated.rsplit(b"\n", 1)[-1]
    out = {}
    for ln in original.split(b"\n"):
        m = re.search(rb"iteration\s+(\d+)/.*lm loss: ([^ |]+)", ln)
        if m and ln in have and not (ends_cut and ln == last):
            out[int(m.group(1))] = float(m.group(2))
    return out


def check_megatron_import(tally: Tally, label: str, original: bytes, mutated: bytes, path: Path) -> None:
    run = tally.call(label, lambda: parse_megatron_log(path), [str(path)])
    want = intact_megatron_steps(original, mutated)
    if run is None:
        if want:
            tally.problems.append(f"{label}: refused a log with {len(want)} intact steps")
        return
    loss = run.series("loss")
    heads = Counter(int(m) for m in re.findall(rb"iteration\s*(\d+)\s*/", mutated))
    tally.outcomes["intact steps checked"] += len(want)
    for step, value in want.items():
        if step not in loss.index:
            tally.problems.append(f"{label}: intact step {step} dropped; notes {run.notes}")
        elif heads[step] == 1 and loss[step] != value:
            tally.problems.append(f"{label}: step {step} loss {loss[step]} != {value}")


def check_mindformers_import(tally: Tally, label: str, original: bytes, mutated: bytes, path: Path) -> None:
    run = tally.call(label, lambda: parse_mindformers_log(path), [str(path)])
    if run is None:
        return
    have = set(mutated.split(b"\n"))
    loss = run.series("loss")
    for ln in original.split(b"\n"):
        m = re.search(rb"step:\[\s*(\d+)/", ln)
        if not (m and ln in have and ln != mutated.rsplit(b"\n", 1)[-1]):
            continue
        tally.outcomes["intact steps checked"] += 1
        if int(m.group(1)) not in loss.index:
            tally.problems.append(f"{label}: intact step {int(m.group(1))} dropped; notes {run.notes}")


# ------------------------------------------------------------------------------------------------------
# the fuzz run
# ------------------------------------------------------------------------------------------------------

def make_store(root: Path) -> Path:
    with RunWriter(root, rank=0, meta={"framework": "megatron-core", "parallel": {"tp": 1, "pp": 1, "dp": 1,
                                                                                    "world_size": 1},
                                        "dtypes": {"params": "float32", "grads": "float32",
                                                   "compute": "float32"}}) as w:
        for s in range(1, 31):
            w.log_scalars(s, {"loss": 10 - s * 0.05, "grad_norm": 1.0})
        w.put_table(1, "local_norm", {"name": ["embedding.word_embeddings.weight", "output_layer.weight"],
                                      "norm": np.array([1.0, 2.0])})
        w.finish_step()
    return root


def make_batches(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for step in (1, 2):
        d = root / f"step_{step}" / "rank_0"
        d.mkdir(parents=True)
        tokens = rng.integers(0, 100, (2, 16))
        np.save(d / "tokens.npy", tokens)
        np.save(d / "labels.npy", np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1))
        np.save(d / "loss_mask.npy", np.ones((2, 16), dtype=np.float32))
    return root


def test_fuzz_importers_and_cli(tmp_path, capsys):
    rng = random.Random(SEED)
    tally = Tally()
    base = tmp_path / "seed"
    base.mkdir()
    mg = megatron_text().encode()
    mf = (DATA / "mindformers_train.log").read_bytes()
    (base / "mg.log").write_bytes(mg)
    (base / "mf.log").write_bytes(mf)
    preset = preset_path(DEFAULT_PRESET).read_text()
    spec = yaml.safe_load(preset)
    names = tmp_path / "names"
    names.mkdir()
    (names / "b.txt").write_text("embedding.word_embeddings.weight\ndecoder.final_layernorm.weight\n")
    (names / "c.txt").write_text("model.tok_embeddings.embedding_weight\nmodel.norm_out.weight\n")
    store = make_store(tmp_path / "store_seed")
    batches = make_batches(tmp_path / "batches_seed")
    k = 0

    def fresh(name: str, data: bytes) -> Path:
        nonlocal k
        k += 1
        d = tmp_path / f"case{k:04d}"
        d.mkdir()
        p = d / name
        p.write_bytes(data)
        return p

    # 1. log importers, and `align import` on the same bytes
    rng.seed(SEED * 100 + 1)   # per section: file bytes with timestamps must not shift later ones
    for round_ in range(6):
        for what, data in corrupt_bytes(mg, rng):
            p = fresh("train.log", data)
            check_megatron_import(tally, f"megatron {what}#{round_}", mg, data, p)
            tally.cli(f"import megatron {what}#{round_}", ["import", str(p), "--out", str(p.parent / "rs")],
                      [str(p)])
        for what, data in corrupt_bytes(mf, rng):
            p = fresh("mf.log", data)
            check_mindformers_import(tally, f"mindformers {what}#{round_}", mf, data, p)
            tally.cli(f"import mindformers {what}#{round_}", ["import", str(p), "--out", str(p.parent / "rs")],
                      [str(p)])

    # 2. align report: one corrupted side against the good other side (writes figures: kept few)
    rng.seed(SEED * 100 + 2)   # per section: file bytes with timestamps must not shift later ones
    for what, data in corrupt_bytes(mg, rng)[:6]:
        p = fresh("train.log", data)
        tally.cli(f"report megatron {what}", ["report", str(p), str(base / "mf.log"), "--out",
                                              str(p.parent / "rep"), "-q"], [str(p)])
    for what, data in corrupt_bytes(mf, rng)[:4]:
        p = fresh("mf.log", data)
        tally.cli(f"report mindformers {what}", ["report", str(base / "mg.log"), str(p), "--out",
                                                 str(p.parent / "rep"), "-q"], [str(p)])

    # 3. mapping files: bytes and wrong types
    rng.seed(SEED * 100 + 3)   # per section: file bytes with timestamps must not shift later ones
    for what, data in corrupt_bytes(preset.encode(), rng) + wrong_types(spec, rng, 40, yaml_dump):
        p = fresh("mapping.yaml", data)
        tally.cli(f"mapping show {what}", ["mapping", "show", str(p)], [str(p)])
        tally.cli(f"mapping check {what}", ["mapping", "check", str(p), "--baseline", str(names / "b.txt"),
                                            "--candidate", str(names / "c.txt")], [str(p)])
    for what, data in corrupt_bytes(b'["embedding.word_embeddings.weight"]', rng)[:4] + wrong_types(
            ["a", "b"], rng, 4, json.dumps):
        p = fresh("names.json", data)
        tally.cli(f"mapping names {what}", ["mapping", "check", DEFAULT_PRESET, "--baseline", str(p),
                                            "--candidate", str(names / "c.txt")], [str(p)])

    # 4. check-config: the Megatron side (log, JSON) and the MindFormers YAML
    rng.seed(SEED * 100 + 4)   # per section: file bytes with timestamps must not shift later ones
    args_json = {"args": {"hidden_size": 64, "num_attention_heads": 4, "num_layers": 2, "lr": 3e-4,
                          "tensor_model_parallel_size": 2, "swiglu": True, "adam_beta2": 0.95}}
    for what, data in corrupt_bytes(mg, rng)[:5] + wrong_types(args_json, rng, 20, json.dumps):
        p = fresh("args.json" if what.startswith("type") else "train.log", data)
        mfy = fresh("mf.yaml", yaml_dump(MF_YAML).encode())
        tally.cli(f"check-config megatron {what}", ["check-config", str(p), str(mfy)], [str(p)])
    for what, data in corrupt_bytes(yaml_dump(MF_YAML).encode(), rng) + wrong_types(MF_YAML, rng, 40, yaml_dump):
        p = fresh("mf.yaml", data)
        tally.cli(f"check-config yaml {what}", ["check-config", str(base / "mg.log"), str(p)], [str(p)])

    # 5. run stores: meta.json, scalar lines, the step file; then `align report` and `check-data` on them
    rng.seed(SEED * 100 + 5)   # per section: file bytes with timestamps must not shift later ones
    meta = json.loads((store / "meta.json").read_text())
    scal = (store / "scalars" / "rank_00000.jsonl").read_bytes()
    h5 = next((store / "steps").rglob("rank_00000.h5"))
    cases = [("meta.json", w, d) for w, d in corrupt_bytes(json.dumps(meta).encode(), rng)[:5]
             + wrong_types(meta, rng, 25, json.dumps)]
    cases += [("scalars/rank_00000.jsonl", w, d) for w, d in corrupt_bytes(scal, rng)]
    cases += [("scalars/rank_00000.jsonl", "type", json.dumps(v).encode() + b"\n")
              for v in ([1, 2], {"step": "1", "loss": 2}, {"step": -3}, {"step": 1, "loss": 10 ** 400}, "x")]
    cases += [(str(h5.relative_to(store)), w, d) for w, d in corrupt_bytes(h5.read_bytes(), rng)[:4]]
    for rel, what, data in cases:
        k += 1
        d = tmp_path / f"case{k:04d}"
        shutil.copytree(store, d / "store")
        (d / "store" / rel).write_bytes(data)
        target = str(d / "store")
        tally.cli(f"report store {rel} {what}", ["report", target, target, "--out", str(d / "rep"), "-q"],
                  [target])
        tally.cli(f"check-data store {rel} {what}", ["check-data", target], [target])

    # step files whose local_norm table has columns of the wrong type, shape or length
    import h5py
    text = h5py.string_dtype()
    tables = {"norm_text": {"name": np.array(["a", "b"], dtype=text), "norm": np.array(["x", "y"], dtype=text)},
              "name_int": {"name": np.array([1, 2]), "norm": np.array([1.0, 2.0])},
              "lengths": {"name": np.array(["a"], dtype=text), "norm": np.array([1.0, 2.0])},
              "norm_2d": {"name": np.array(["a", "b"], dtype=text), "norm": np.ones((2, 3))},
              "no_norm": {"name": np.array(["a", "b"], dtype=text)},
              "complex": {"name": np.array(["a", "b"], dtype=text), "norm": np.ones(2, np.complex64)}}
    # ... and every other table in runstore/tables.py, and the routing records, outside their contract (issue 38):
    # refused with exit 2 in one line naming the table, never read as evidence
    from runstore.routing import make_record, put_routing
    cases = {("local_norm", what): cols for what, cols in tables.items()}
    two = {"name": np.array(["a", "b"], dtype=text)}
    cases[("param_norm", "negative")] = {**two, "norm": np.array([1.0, -2.0])}
    cases[("update_norm", "text_tp_rank")] = {**two, "norm": np.ones(2), "tp_rank": np.array(["0", "1"], dtype=text)}
    cases[("local_norm", "tp_rank_beyond")] = {**two, "norm": np.ones(2), "tp_rank": np.array([0, 3]),
                                               "tp_size": np.array([2, 2])}
    cases[("tensor_stats", "negative_nan_count")] = {
        "order": np.arange(2), "module": np.array(["m", "n"], dtype=text), "kind": np.array(["o", "o"], dtype=text),
        "nan": np.array([0, -4])}
    cases[("tensor_stats", "no_order")] = {"module": np.array(["m", "n"], dtype=text),
                                           "kind": np.array(["o", "o"], dtype=text)}
    cases[("routing_counts", "negative_tokens")] = {"module": np.array(["r", "r"], dtype=text),
                                                    "expert": np.arange(2), "tokens": np.array([3, -1])}
    cases[("routing", "router_as_dataset")] = {}
    z = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    for (group, what), cols in cases.items():
        k += 1
        root = tmp_path / f"case{k:04d}" / "store"
        for store, noise in ((root, 0.0), (root.parent / "repeat", 1e-3)):   # a repeat: param/update norms read
            with RunWriter(store, meta={"framework": "megatron-core"}) as w:
                for s in range(1, 6):
                    w.log_scalars(s, {"loss": 2.0 - s * 0.1 + noise * (-1) ** s})
                for col, arr in cols.items():
                    w.put_array(1, f"{group}/{col}", arr)
                if group.startswith("routing"):
                    idx = np.argsort(-z, axis=1)[:, :2]
                    put_routing(w, 1, make_record("decoder.layers.0.mlp.router", z, idx, np.full(idx.shape, 0.5),
                                                  logits_dtype="float32", probs_dtype="float32"))
                    if group == "routing":
                        w.put_array(1, "routing/decoder.layers.1.mlp.router", np.array([np.nan, 1.0]))
                w.finish_step()
        rc = tally.cli(f"report table {group} {what}", ["report", str(root), str(root), "--repeat",
                                                         str(root.parent / "repeat"), "--out",
                                                         str(root.parent / "rep"), "-q"], [group])
        if rc != 2:
            tally.problems.append(f"report table {group} {what}: exit {rc}, expected a refusal naming {group}")

    # 6. check-data on the step_N/rank_R/*.npy layout
    rng.seed(SEED * 100 + 6)   # per section: file bytes with timestamps must not shift later ones
    tok = (batches / "step_1" / "rank_0" / "tokens.npy").read_bytes()
    odd = [("strings", np.array(["a", "b"])), ("complex", np.zeros((2, 16), np.complex64)), ("scalar", np.int64(3)),
           ("shape", np.zeros((3, 5), np.int64)), ("structured", np.zeros(3, dtype=[("a", "i4")]))]
    npy_cases = corrupt_bytes(tok, rng)
    for what, arr in odd:
        buf = io.BytesIO()
        np.save(buf, arr)
        npy_cases.append((f"dtype_{what}", buf.getvalue()))
    for what, data in npy_cases:
        k += 1
        d = tmp_path / f"case{k:04d}" / "batches"
        shutil.copytree(batches, d)
        (d / "step_1" / "rank_0" / "tokens.npy").write_bytes(data)
        tally.cli(f"check-data npy {what}", ["check-data", str(d), "--vocab-size", "100"], [str(d)])

    # 7. the step-1 npz the optimizer check reads
    rng.seed(SEED * 100 + 7)   # per section: file bytes with timestamps must not shift later ones
    from comparators.optimizer_check import read_step1_file, write_step1_file
    good = tmp_path / "step1.npz"
    write_step1_file(good, {"w": np.ones((2, 2), np.float32)}, {"w": np.zeros((2, 2), np.float32)},
                     {"w": np.zeros((2, 2), np.float32)})
    for what, data in corrupt_bytes(good.read_bytes(), rng):
        p = fresh("step1.npz", data)
        tally.call(f"step1 npz {what}", lambda p=p: read_step1_file(p), [str(p)])

    # 8. convert-weights on corrupted torch checkpoints
    rng.seed(SEED * 100 + 8)   # per section: file bytes with timestamps must not shift later ones
    torch = pytest.importorskip("torch")
    pt = tmp_path / "model.pt"
    torch.save({"embedding.word_embeddings.weight": torch.ones(8, 4)}, pt)
    for what, data in corrupt_bytes(pt.read_bytes(), rng):
        p = fresh("model.pt", data)
        tally.cli(f"convert-weights {what}", ["convert-weights", "--to", "mindformers", str(p), "--out",
                                              str(p.parent / "out.ckpt"), "--num-heads", "2"], [str(p)])

    # 9. TensorBoard event files (torch's SummaryWriter, Megatron's tag names)
    rng.seed(SEED * 100 + 9)   # per section: file bytes with timestamps must not shift later ones
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        SummaryWriter = None
    if SummaryWriter is not None:
        tb = tmp_path / "tb_seed"
        w = SummaryWriter(log_dir=str(tb))
        for s in range(1, 21):
            w.add_scalar("lm loss", 10 - s * 0.05, s)
            w.add_scalar("grad-norm", 1.0, s)
        w.close()
        ev = next(tb.glob("events.out.tfevents.*"))
        for what, data in corrupt_bytes(ev.read_bytes(), rng):
            k += 1
            d = tmp_path / f"case{k:04d}" / "tb"
            d.mkdir(parents=True)
            (d / ev.name).write_bytes(data)
            tally.cli(f"import tensorboard {what}", ["import", str(d), "--out", str(d.parent / "rs")], [str(d)])

    # 10. Megatron's golden-values JSON (both layouts) and an msprobe statistics dump.json
    rng.seed(SEED * 100 + 10)   # per section: file bytes with timestamps must not shift later ones
    golden = {"lm loss": {"start_step": 1, "end_step": 10, "step_interval": 1,
                          "values": {str(i): 10 - i * 0.1 for i in range(1, 11)}},
              "num-zeros": {"start_step": 0, "end_step": 10, "step_interval": 5, "values": [1.0, 2.0, "nan"]}}
    gv_good = fresh("golden_values_dev.json", json.dumps(golden).encode())
    for what, data in corrupt_bytes(json.dumps(golden).encode(), rng) + wrong_types(golden, rng, 25, json.dumps):
        p = fresh("golden_values_dev.json", data)
        tally.cli(f"import golden {what}", ["import", str(p), "--out", str(p.parent / "rs")], [str(p)])
        tally.cli(f"report golden {what}", ["report", str(p), str(gv_good), "--out", str(p.parent / "rep"), "-q"],
                  [str(p)])
    dump = {"task": "statistics", "level": "L0", "framework": "pytorch", "dump_data_dir": None, "data": {
        "Module.decoder.layers.0.mlp.MLP.forward.0": {
            "input_args": [{"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 4], "Max": 1.0,
                            "Min": -1.0, "Mean": 0.0, "Norm": 2.0, "requires_grad": False}],
            "output": [{"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 4], "Max": 2.0,
                        "Min": -2.0, "Mean": 0.1, "Norm": 3.0, "requires_grad": True}]}}}
    for what, data in corrupt_bytes(json.dumps(dump).encode(), rng)[:5] + wrong_types(dump, rng, 25, json.dumps):
        k += 1
        d = tmp_path / f"case{k:04d}" / "dump"
        (d / "step0" / "rank0").mkdir(parents=True)
        (d / "step0" / "rank0" / "dump.json").write_bytes(data)
        tally.cli(f"report msprobe {what}", ["report", str(d), str(d), "--out", str(d.parent / "rep"), "-q"],
                  [str(d)])

    # 11. what is not a regular file, and outputs that cannot be written
    rng.seed(SEED * 100 + 11)   # per section: file bytes with timestamps must not shift later ones
    import os
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    tally.cli("import fifo", ["import", str(fifo), "--out", str(tmp_path / "fifo_rs")], [str(fifo)])
    tally.cli("report fifo", ["report", str(fifo), str(base / "mf.log"), "--out", str(tmp_path / "f"), "-q"],
              [str(fifo)])
    tally.cli("import device", ["import", "/dev/zero", "--out", str(tmp_path / "dev_rs")], ["/dev/zero"])
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    mfy = fresh("mf.yaml", yaml_dump(MF_YAML).encode())
    for out in (tmp_path, dangling):   # --json naming a folder or a dangling link
        tally.cli(f"check-config --json {out.name}", ["check-config", str(base / "mg.log"), str(mfy), "--json",
                                                      str(out)], [str(out)])
        tally.cli(f"check-data --json {out.name}", ["check-data", str(batches), "--json", str(out)], [str(out)])
    for out in (a_file, dangling):
        tally.cli(f"report --out {out.name}", ["report", str(base / "mg.log"), str(base / "mf.log"), "--out",
                                                str(out), "-q"], [str(out)])

    counted = ("read", "BadInput", "traceback")
    total = sum(v for k_, v in tally.outcomes.items()
                if (k_.startswith("exit ") and "without" not in k_) or k_ in counted)
    with capsys.disabled():
        print(f"\nfuzz: {total} commands/imports, outcomes {dict(sorted(tally.outcomes.items()))}")
    assert not tally.problems, "\n".join(tally.problems[:15]) + f"\n... {len(tally.problems)} problems"
    assert tally.outcomes["traceback"] == 0


# ------------------------------------------------------------------------------------------------------
# property tests: one field replaced by garbage, every other field still read
# ------------------------------------------------------------------------------------------------------

GARBAGE = ["x", "6.9x3E+00", "#", "", "1.2.3", "--", "\ufffd\ufffd", "nanx", "[1, 2", "1e", "0x1F"]


def _megatron_fields(line: str) -> list[tuple[str, str]]:
    rest = line.split("|", 1)[1]
    return [(p.split(":", 1)[0].strip(), p.split(":", 1)[1].strip()) for p in rest.split("|")[:-1]]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_megatron_line_with_one_field_garbled_keeps_the_others(tmp_path, garbage):
    from sources.megatron_log import _key
    line = REAL.format(it=7, cs=112, loss=6.5, g=1.25)
    fields = _megatron_fields(line)
    good = parse_megatron_log(_write(tmp_path / "good.log", line))
    expected = {k: float(s.iloc[0]) for k, s in good.scalars.items()}
    for i, (name, value) in enumerate(fields):
        for variant in (f"{name}: {garbage}", garbage):   # the value garbled, or the whole field
            text = line.replace(f"| {name}: {value} |", f"| {variant} |", 1)
            run = parse_megatron_log(_write(tmp_path / f"f{i}.log", text))
            got = {k: float(s.iloc[0]) for k, s in run.scalars.items()}
            for key, v in expected.items():
                if key != _key(name):
                    assert got.get(key) == v, (variant, key, got)
            key_of = _key(name)
            assert key_of not in got or got[key_of] == expected[key_of], (variant, got)   # never a wrong value


@pytest.mark.parametrize("garbage", GARBAGE)
def test_mindformers_line_with_one_field_garbled_keeps_the_others(tmp_path, garbage):
    line = next(ln for ln in (DATA / "mindformers_train.log").read_text().splitlines() if "step:[    2/" in ln)
    head, rest = line.split("loss:", 1)
    fields = [f.strip() for f in ("loss:" + rest).split(", ")]
    good = parse_mindformers_log(_write(tmp_path / "good.log", line))
    expected = {k: float(s.iloc[0]) for k, s in good.scalars.items()}
    assert {"loss", "lr", "grad_norm", "loss_scale"} <= set(expected)
    for i, field in enumerate(fields):
        name = field.split(":", 1)[0]
        bad = list(fields)
        bad[i] = f"{name}: {garbage}"
        run = parse_mindformers_log(_write(tmp_path / f"f{i}.log", head + ", ".join(bad)))
        got = {k: float(s.iloc[0]) for k, s in run.scalars.items()}
        lost = {k for k in expected if k not in got}
        # only the garbled field's own keys may go missing (loss carries loss_avg with it)
        allowed = {"loss": {"loss", "loss_avg"}, "per_step_time": {"per_step_time_ms"}, "lr": {"lr"},
                   "overflow cond": {"overflow"}, "loss_scale": {"loss_scale"}, "global_norm": {"grad_norm"}}
        assert lost <= allowed.get(name, set()), (field, garbage, lost)
        for k in got:
            if k in expected and k not in allowed.get(name, set()):
                assert got[k] == expected[k]


def _write(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    return path
