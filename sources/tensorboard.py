"""TensorBoard event directories (Megatron's --tensorboard-dir, MindFormers' tensorboard_dir) -> Run.

Megatron's and MindFormers' tags are mapped to the run store's scalar keys; ``... vs samples`` / ``vs tokens``
copies of the same curves are left out. The two losses are kept apart: Megatron's ``lm loss`` and
MindFormers' ``lm-loss`` are the language-model loss (key ``loss``, the one runs are compared on), while
MindFormers' ``loss`` tag is lm + load-balancing + MTP loss; next to an ``lm-loss`` tag it becomes
``total_loss`` (alone, a dense model's ``loss`` equals its lm loss and stays ``loss``, with a note).
MindFormers' TrainingStateMonitor writes named local norms as ``local_norm/<parameter>`` tags; they become
the run's per-step local-norm tables. Reading uses TensorBoard's own event reader (the optional ``tensorboard``
extra): the log-only path keeps needing nothing more than numpy, pandas, matplotlib and h5py.

Records are framed here, not by TensorBoard's loader (which stops at the first record that fails its
checksum and drops every later step without a word): each record is ``length (8 bytes) | masked CRC32C of
the length | data | masked CRC32C of the data``; past a bad record the reader scans forward to the next
offset whose length checksum and data checksum both verify, reads on, and notes what it skipped.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from core.errors import BadInput
from runstore.run import Run, make_series
from sources import Source

LM_LOSS_TAGS = ("lm loss", "lm-loss")
TAGS = {
    "lm loss": "loss",
    "lm-loss": "loss",
    "loss": "loss",
    "mtp-loss": "mtp_loss",
    "load-balancing-loss": "load_balancing_loss",
    "train/loss": "loss",
    "grad-norm": "grad_norm",
    "grad_norm": "grad_norm",
    "learning-rate": "lr",
    "learning_rate": "lr",
    "loss-scale": "loss_scale",
    "num-zeros": "num_zeros",
    "batch-size": "global_batch_size",
    "params-norm": "params_norm",
    "iteration-time": "elapsed_s",
    "lm loss validation": "val_loss",
    "lm loss validation ppl": "val_ppl",
}


def event_files(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("events.out.tfevents.*") if p.is_file())


def scalar_key(tag: str) -> str:
    """The run-store key of a Megatron / MindFormers TensorBoard tag (``lm loss`` -> ``loss``)."""
    return TAGS.get(tag, re.sub(r"[^0-9a-zA-Z]+", "_", tag).strip("_").lower())


def frame_records(data: bytes, crc: Callable[[bytes], int]) -> tuple[list[bytes], int, int, bool]:
    """The records of one event file whose length and data checksums verify: (records, damaged regions
    skipped, bytes skipped, whether the file ends inside a record). ``crc`` is the masked CRC32C."""
    out: list[bytes] = []
    n, pos, regions, skipped = len(data), 0, 0, 0

    def record_at(p: int) -> int:
        """The end of a verified record at ``p``, or -1."""
        if p + 12 > n or crc(data[p: p + 8]) != struct.unpack_from("<I", data, p + 8)[0]:
            return -1
        length = struct.unpack_from("<Q", data, p)[0]
        end = p + 12 + length + 4
        if end > n or crc(data[p + 12: end - 4]) != struct.unpack_from("<I", data, end - 4)[0]:
            return -1
        return end

    while pos < n:
        end = record_at(pos)
        if end >= 0:
            out.append(data[pos + 12: end - 4])
            pos = end
            continue
        # a bad record: the next one starts where a length (< 4 GiB: four zero high bytes) and both checksums verify
        p = pos + 1
        while True:
            z = data.find(b"\x00\x00\x00\x00", p + 4)
            if z < 0 or z - 4 + 12 > n:
                p = n
                break
            p = z - 4
            if record_at(p) >= 0:
                break
            p += 1
        if p >= n and (n - pos < 12 or crc(data[pos: pos + 8]) == struct.unpack_from("<I", data, pos + 8)[0]
                       and pos + 12 + struct.unpack_from("<Q", data, pos)[0] + 4 > n):
            return out, regions, skipped, True     # the file ends inside its last record (still being written)
        regions += 1
        skipped += p - pos
        pos = p
    return out, regions, skipped, False


def _events(f: Path, notes: list[str]) -> list:
    """The events of one file, past damaged records (noted)."""
    from google.protobuf.message import DecodeError  # noqa: PLC0415
    from tensorboard.compat.proto import event_pb2  # noqa: PLC0415
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # noqa: PLC0415

    try:
        data = f.read_bytes()
    except OSError as exc:
        raise BadInput(f"{f}: unreadable ({exc.__class__.__name__})") from None
    records, regions, skipped, cut = frame_records(data, masked_crc32c)
    events, bad = [], 0
    for rec in records:
        try:
            events.append(event_pb2.Event.FromString(rec))
        except (DecodeError, RuntimeError, ValueError):
            bad += 1
    if data and not records:
        raise BadInput(f"{f}: corrupt TensorBoard event file (no record passes its checksum)")
    if regions:
        notes.append(f"{f.name}: skipped {regions} damaged region(s) ({skipped} bytes, at least {regions} "
                     "record(s) that fail their checksum); the records after them were read")
    if cut:
        notes.append(f"{f.name}: the file ends inside a record (cut short, or still being written); "
                     "read the complete ones")
    if bad:
        notes.append(f"{f.name}: {bad} record(s) pass their checksum but are no TensorBoard event; skipped")
    return events


def read_tensorboard(path: str | Path) -> Run:
    path = Path(path)
    files = event_files(path)
    if not files:
        raise BadInput(f"{path}: no TensorBoard event files (events.out.tfevents.*)")
    try:
        from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
            SCALARS,
            EventAccumulator,
        )
    except ImportError:
        raise BadInput(f"{path}: reading TensorBoard files needs the 'tensorboard' package "
                       "(pip install 'xf-align[tensorboard]')") from None
    series: dict = {}
    notes: list[str] = []
    norms: dict[int, dict[str, float]] = {}
    scalars: list[tuple[str, list]] = []
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={SCALARS: 0})
        for event in _events(f, notes):
            try:   # what acc.Reload() does with each event its loader yields (restarts purged the same way)
                acc._ProcessEvent(event)  # noqa: SLF001
            except Exception as exc:  # a record that verifies but holds a malformed summary
                raise BadInput(f"{f}: corrupt TensorBoard event ({exc.__class__.__name__})") from None
        for tag in acc.Tags().get("scalars", []):
            if " vs " in tag:
                continue
            if tag.startswith("local_norm/"):
                for e in acc.Scalars(tag):
                    norms.setdefault(int(e.step), {})[tag.split("/", 1)[1]] = float(e.value)
                continue
            scalars.append((tag, acc.Scalars(tag)))
    tags = {t for t, _ in scalars}
    has_lm = any(t in tags for t in LM_LOSS_TAGS)
    if "loss" in tags and not has_lm:
        notes.append("TensorBoard 'loss' read as the lm loss (no 'lm loss' / 'lm-loss' tag); with MoE or MTP "
                     "MindFormers' 'loss' also holds the aux losses")
    for tag, events in scalars:
        key = "total_loss" if tag == "loss" and has_lm else scalar_key(tag)
        s = make_series([e.step for e in events], [e.value for e in events], key)
        series[key] = s if key not in series else s.combine_first(series[key])
    local_norms = {step: pd.DataFrame({"name": list(d), "norm": np.fromiter(d.values(), np.float64, len(d)),
                                       "numel": np.full(len(d), -1, np.int64)})
                   for step, d in sorted(norms.items())}
    if not series and not local_norms:
        names = ", ".join(f.name for f in files[:3])
        raise BadInput(f"{path}: no readable scalars in {names} (corrupt or empty event files?)")
    if len(files) > 1:
        notes.append(f"{len(files)} event files merged (a later file wins on repeated steps)")
    meta = {"framework": "tensorboard", "source": {"kind": "tensorboard", "path": str(path)}}
    if "total_loss" in series:
        meta["loss_key"] = "lm_loss"
        notes.append("loss = MindFormers' lm-loss tag (comparable with Megatron's 'lm loss'); its 'loss' tag "
                     "(lm + aux + MTP) is total_loss")
    return Run(str(path), "tensorboard", meta, series, local_norms, notes)


def _is_tensorboard(path: Path, head: bytes | None) -> bool:
    return head is None and any(path.rglob("events.out.tfevents.*"))


SOURCE = Source("tensorboard", 50, _is_tensorboard, read_tensorboard,
                "a TensorBoard log dir (events.out.tfevents.*)")
