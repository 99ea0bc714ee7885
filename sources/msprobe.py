"""msprobe (mindstudio-probe) dump directories, PyTorch and MindSpore, opened as layer-tensor sources.

Layout msprobe writes (``dump_path`` of its config)::

    DUMP/step<N>/rank<R>/dump.json                 (or proc<PID>/ when not distributed, rank/ without a number)
    DUMP/step<N>/rank<R>/dump_tensor_data/*.pt     PyTorch full tensors (task "tensor")
    DUMP/step<N>/rank<R>/dump_tensor_data/*.npy    MindSpore full tensors

``dump.json`` = {"task", "level", "framework", "dump_data_dir", "data": {KEY: {...}}}, ``data`` in execution
order. Module/cell keys are ``Module.<name>.<Class>.<forward|backward|parameters_grad>.<call>`` (PyTorch) or
``Cell.<name>.<Class>...`` (MindSpore); API keys (level L1) are ``Functional.linear.0.forward``. A forward
entry holds ``input_args`` (list), ``input_kwargs`` (dict), ``output`` and ``parameters``; a backward entry
holds ``input`` (the gradients arriving at the module's outputs) and ``output`` (the gradients it passes
on). Each tensor entry has ``dtype``, ``shape``, ``Max``, ``Min``, ``Mean``, ``Norm`` and, in tensor mode,
``data_name`` (the file under dump_tensor_data/).

Rows use the run store's ``tensor_stats`` vocabulary (module, kind ``forward.input.0`` /
``forward.output.0`` / ``backward.grad_output.0`` / ``backward.grad_input.0``, dtype, shape, numel, max,
min, mean, norm) so the layer-tensor comparator pairs them through the mapping like a dumper's rows.
Parameters and parameter gradients are left out (weights compare through conversion and local norms, and a
fused parameter has no one-to-one counterpart); so are integer / boolean tensors (ids, masks).
msprobe counts steps from 0: ``step<N>`` is step N + 1 here, as Megatron's iteration and MindFormers' step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from core.errors import BadInput
from sources import Source
from sources.jsontext import load_json

if TYPE_CHECKING:
    from runstore.run import Run

DUMP_JSON = "dump.json"
TENSOR_DIR = "dump_tensor_data"
_STEP_RE = re.compile(r"^step(\d+)$")
_RANK_RE = re.compile(r"^(?:rank(\d*)|proc(\d+))$")
_DIRECTIONS = ("forward", "backward", "parameters_grad")
_FLOAT = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}


def normalise_dtype(dtype: Any) -> str | None:
    """``torch.float32`` / ``Float32`` / ``BFloat16`` -> ``float32`` / ``bfloat16``; None for non-floats."""
    d = str(dtype or "").lower().replace("torch.", "").replace("mindspore.", "")
    return _FLOAT.get(d)


def split_key(key: str) -> tuple[str, str, int] | None:
    """(module name, direction, call index) of a dump.json key, None for keys that are not tensor rows."""
    parts = key.split(".")
    if len(parts) >= 4 and parts[0] in ("Module", "Cell") and parts[-2] in _DIRECTIONS and parts[-1].isdigit():
        return ".".join(parts[1:-3]) or parts[-3], parts[-2], int(parts[-1])
    if len(parts) >= 3 and parts[-1] in _DIRECTIONS:          # API level: Functional.linear.0.forward
        return ".".join(parts[:-1]), parts[-1], int(parts[-2]) if parts[-2].isdigit() else 0
    return None


def _num(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _tensors(value: Any, path: str) -> list[tuple[str, dict[str, Any]]]:
    """Flatten msprobe's nested argument lists into (index path, tensor entry) pairs."""
    if isinstance(value, dict) and "dtype" in value and "shape" in value:
        return [(path, value)]
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(value, list):
        for i, v in enumerate(value):
            out += _tensors(v, f"{path}.{i}" if path else str(i))
    elif isinstance(value, dict):
        for k, v in value.items():
            out += _tensors(v, f"{path}.{k}" if path else str(k))
    return out


_SECTIONS = {"forward": (("input_args", "forward.input"), ("input_kwargs", "forward.input"),
                         ("output", "forward.output")),
             "backward": (("input", "backward.grad_output"), ("output", "backward.grad_input"))}


@dataclass
class MsprobeDump:
    """One msprobe dump directory: steps -> ranks -> folder holding dump.json; a layer source
    (sources.layers.LayerSource) whose rows name their tensor files (.pt needs a torch reader)."""

    needs_readers: ClassVar[bool] = True
    root: Path
    folders: dict[int, dict[int, Path]] = field(default_factory=dict)
    framework: str = "unknown"
    task: str = "unknown"
    level: str = "unknown"

    def array_steps(self) -> list[int]:
        return sorted(self.folders)

    def array_ranks(self, step: int) -> list[int]:
        return sorted(self.folders.get(step, {}))

    def folder(self, step: int, rank: int = 0) -> Path:
        f = self.folders.get(step, {}).get(rank)
        if f is None:
            have = ", ".join(f"step{s - 1}" for s in self.array_steps())
            raise BadInput(f"{self.root}: msprobe dump has no step {step} (msprobe step{step - 1}), rank {rank} "
                           f"(has {have or 'none'})")
        return f

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]:
        """Rows in execution order, each with ``ref`` (the tensor file, or None in statistics mode)."""
        folder = self.folder(step, rank)
        path = folder / DUMP_JSON
        data = dump_data(path)
        rows: list[dict[str, Any]] = []
        any_file = False
        for key, entry in data.items():
            parsed = split_key(key)
            if parsed is None or not isinstance(entry, dict) or parsed[1] not in _SECTIONS:
                continue
            module, direction, _ = parsed
            for section, kind in _SECTIONS[direction]:
                for idx, t in _tensors(entry.get(section), ""):
                    dtype = normalise_dtype(t.get("dtype"))
                    if dtype is None:
                        continue
                    raw = t.get("shape") or []
                    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                            and x >= 0 for x in raw):
                        raise BadInput(f"{path}: key '{key}': shape {str(raw)[:40]!r} is not a list of sizes")
                    shape = list(raw)
                    name = t.get("data_name")
                    ref = None
                    if isinstance(name, str) and name and "/" not in name and name not in (".", ".."):
                        ref = str(folder / TENSOR_DIR / name)
                        any_file = True
                    numel = math.prod(shape) if shape else 1
                    mx, mn = _num(t.get("Max")), _num(t.get("Min"))
                    rows.append({"order": len(rows), "module": module, "kind": f"{kind}.{idx}", "dtype": dtype,
                                 "shape": "x".join(map(str, shape)), "numel": numel, "max": mx, "min": mn,
                                 "mean": _num(t.get("Mean")), "norm": _num(t.get("Norm")),
                                 "nan": int(math.isnan(mx) or math.isnan(mn)),
                                 "inf": int(math.isinf(mx) or math.isinf(mn)), "ref": ref, "key": key})
        return rows, any_file


def dump_data(path: Path) -> dict[str, Any]:
    """The ``data`` object of one dump.json; a one-line BadInput naming the file when it is truncated,
    garbled, nested too deeply or has no ``data`` object."""
    doc = load_json(path, "JSON")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: no 'data' object (not an msprobe dump.json)")
    return data


def check_dumps(d: MsprobeDump) -> list[str]:
    """Read every dump.json of the dump (``align import`` reads none of the tensors): BadInput for the first
    one that is not a dump.json, a note for each step / rank whose dump.json holds no tensor entry, and
    BadInput when none holds one (an import must not show a dump of 0 tensors as if it were read)."""
    empty: list[str] = []
    total = 0
    for step, ranks in sorted(d.folders.items()):
        for _, folder in sorted(ranks.items()):
            data = dump_data(folder / DUMP_JSON)
            n = sum(1 for k, v in data.items() if isinstance(v, dict) and split_key(k) is not None)
            total += n
            if not n:
                empty.append(f"step{step - 1}/{folder.name}")
    if not total:
        raise BadInput(f"{d.root}: no msprobe dump.json holds a module or API entry (empty 'data')")
    if empty:
        return [f"{len(empty)} dump.json file(s) hold no module or API entry ({', '.join(empty[:3])})"]
    return []


def find_dump_folders(root: Path) -> dict[int, dict[int, Path]]:
    """step -> rank -> folder with dump.json, for a dump root, a step folder, or a rank folder."""
    root = Path(root)
    if (root / DUMP_JSON).is_file():
        m = _STEP_RE.match(root.parent.name)
        return {int(m.group(1)) + 1 if m else 1: {_rank_of(root.name, 0): root}}
    out: dict[int, dict[int, Path]] = {}
    step_dirs = [root] if _STEP_RE.match(root.name) else sorted(p for p in root.iterdir() if p.is_dir())
    for sd in step_dirs:
        m = _STEP_RE.match(sd.name)
        if not m:
            continue
        step = int(m.group(1)) + 1
        procs = sorted(p for p in sd.iterdir() if p.is_dir() and _RANK_RE.match(p.name) and
                       (p / DUMP_JSON).is_file())
        for i, p in enumerate(procs):
            out.setdefault(step, {})[_rank_of(p.name, i)] = p
    return out


def _rank_of(name: str, fallback: int) -> int:
    m = _RANK_RE.match(name)
    if m and m.group(1):
        return int(m.group(1))
    return fallback    # "rank" (no number) or "proc<PID>": one process per folder, in name order


def is_msprobe_dump(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / DUMP_JSON).is_file():
        return True
    return any(p.glob(f"step*/*/{DUMP_JSON}")) or (bool(_STEP_RE.match(p.name)) and any(p.glob(f"*/{DUMP_JSON}")))


def open_msprobe(path: str | Path) -> MsprobeDump:
    """Open an msprobe dump (its dump_path, one step<N> folder, or one rank folder)."""
    root = Path(path)
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory (an msprobe dump is a folder with step*/rank*/dump.json)")
    folders = find_dump_folders(root)
    if not folders:
        raise BadInput(f"{root}: no msprobe dump.json (expected step<N>/rank<R>/dump.json)")
    first = next(iter(next(iter(folders.values())).values()))
    head: dict[str, Any] = {}
    try:
        with open(first / DUMP_JSON, encoding="utf-8") as fh:
            text = fh.read(4096)
        for k in ("task", "level", "framework"):
            m = re.search(rf'"{k}"\s*:\s*"([^"]*)"', text)
            if m:
                head[k] = m.group(1)
    except (OSError, UnicodeDecodeError) as exc:   # issue 14: a non-UTF-8 dump.json is bad input
        raise BadInput(f"{first / DUMP_JSON}: unreadable ({exc.__class__.__name__})") from None
    return MsprobeDump(root, folders, head.get("framework", "unknown"), head.get("task", "unknown"),
                       head.get("level", "unknown"))


def read_msprobe(path: str | Path) -> Run:
    """An msprobe dump as a Run: no scalars; the layer-tensor stage reads it through ``open_msprobe``."""
    from runstore.run import Run  # pandas: only when a Run is built, not for the tensor compare

    d = open_msprobe(path)
    checked = check_dumps(d)
    fw = {"pytorch": "torch", "mindspore": "mindspore"}.get(d.framework, d.framework)
    meta = {"framework": fw, "source": {"kind": "msprobe", "path": str(path), "task": d.task, "level": d.level},
            "name_scheme": "msprobe", "msprobe": {"steps": d.array_steps(),
                                                  "ranks": sorted({r for v in d.folders.values() for r in v})}}
    notes = [f"msprobe {d.framework} dump ({d.task}, {d.level}): layer tensors only, no loss curve", *checked]
    return Run(str(path), "msprobe", meta, {}, {}, notes)


def _is_msprobe(path: Path, head: bytes | None) -> bool:
    return head is None and is_msprobe_dump(path)


def _layers(obj: Any) -> MsprobeDump:
    """The dump's layer rows, from its path or the Run read from it."""
    return open_msprobe(obj if isinstance(obj, (str, Path)) else obj.path)


SOURCE = Source("msprobe", 20, _is_msprobe, read_msprobe, "an msprobe dump (step*/rank*/dump.json)",
                layers=_layers, layers_only=True)
