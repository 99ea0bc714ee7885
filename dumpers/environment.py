"""The cluster capture: what changes numerics on one side besides model and config, recorded for a diff.

Recorded: the environment variables of the documented list (core/numerics_env.yaml; secret-looking names keep a
digest only), library / runtime / driver versions, the framework's determinism and precision settings as they
take effect on this device, the random generators' state (seeds, and whether anything drew since seeding),
content hashes of the dataset files, and per-parameter fingerprints of the loaded weights. Run on each
cluster (``align capture-env``, or ``DumpConfig(capture_env=True)`` in the live run), the two captures are
compared by comparators/environment.py in the report's checklist.

Why these fingerprints: a parameter's ``sha256`` (its float32 bytes in the stored layout) compares where the
mapping keeps the layout; where it changes the layout (fused QKV split, fc1 halves interleaved, experts
stacked) the ``mset`` does: a multiset hash (the sum mod 2^64 of a 64-bit mix of every value's bits), the
same for any order of the same values, so a group of tensors compares through the mapping exactly, not
within a tolerance. The L2 norm and sum are there to say by how much two differ.

Framework-free at import: torch and MindSpore are read only when the process has them loaded (the dumpers),
or imported when asked (``import_frameworks``: the CLI, for the one framework it captures).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib
import importlib.metadata as _md
import math
import os
import platform
import random
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from core.numerics_env import FRAMEWORKS, load_spec

CAPTURE_KIND = "xf-align environment capture"
CAPTURE_VERSION = 1
#: distributions read for each package name of the list (first one installed wins)
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-cu12",
                           "transformer_engine_torch"),
    "mindspore": ("mindspore", "mindspore-ascend", "mindspore-gpu"),
    "flash-attn": ("flash-attn", "flash_attn"),
}
RUNTIMES = ("python", "cuda", "cudnn", "nccl", "nvidia_driver", "gpu", "cann", "ascend_driver")
ASCEND_ROOT = "/usr/local/Ascend"
NVIDIA_PROC = "/proc/driver/nvidia/version"
CHUNK = 64 << 20            # dataset files: hashed in chunks of this size (in parallel), at most MAX_CHUNKS a file
MAX_CHUNKS = 256
_READ = 8 << 20
_BLOCK = 1 << 18            # weights: elements per block (hash, norm, mix)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# -- environment variables --------------------------------------------------------------------------------

def read_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The listed variables and those under the listed prefixes; a secret-looking name keeps a digest."""
    spec = load_spec()
    env = os.environ if environ is None else environ
    out = {}
    for name in sorted(env):
        if spec.watched(name):
            value = env[name]
            out[name] = f"<redacted sha256:{_digest(value.encode())}>" if spec.secret(name) else value
    return out


# -- versions ---------------------------------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return _md.version(dist)
        except _md.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - a broken install's metadata: not installed, for us
            continue
    return None


def _info_version(path: Path) -> str | None:
    """``version=...`` / ``Version=...`` of an Ascend ``*.info`` / ``version.cfg`` file."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = re.search(r"^\s*(?:version|Version|VERSION)\s*=\s*(\S+)", text, re.M)
    return m.group(1) if m else None


def ascend_versions(root: str | os.PathLike = ASCEND_ROOT,
                    environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """CANN and NPU driver versions from the files their installers leave (the toolkit's
    ``<arch>-linux/ascend_toolkit_install.info``, nnae's, ``driver/version.info``)."""
    env = os.environ if environ is None else environ
    root = Path(root)
    homes = [Path(env[k]) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH") if env.get(k)]
    homes += [root / "ascend-toolkit" / "latest", root / "nnae" / "latest", root / "latest"]
    cann = None
    for home in homes:
        for pattern in ("*-linux/ascend_toolkit_install.info", "ascend_toolkit_install.info",
                        "*-linux/ascend_nnae_install.info", "ascend_nnae_install.info", "version.cfg"):
            for f in sorted(home.glob(pattern)) if home.is_dir() else []:
                cann = cann or _info_version(f)
    driver = _info_version(root / "driver" / "version.info")
    return {"cann": cann, "ascend_driver": driver}


def nvidia_driver(proc: str | os.PathLike = NVIDIA_PROC) -> str | None:
    try:
        text = Path(proc).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)", text)
    return m.group(1) if m else None


def _torch_versions(torch: Any) -> dict[str, str | None]:
    out: dict[str, str | None] = {"cuda": torch.version.cuda}
    try:
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        out["cudnn"] = str(v) if v else None
    except Exception:  # noqa: BLE001
        out["cudnn"] = None
    out["nccl"] = out["gpu"] = None
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            cap = "".join(map(str, torch.cuda.get_device_capability(0)))
            out["gpu"] = f"{torch.cuda.get_device_name(0)} (sm_{cap})"
    except Exception:  # noqa: BLE001 - a GPU that cannot be queried: unknown
        pass
    return out


def read_versions(modules: Mapping[str, Any], *, ascend_root: str | os.PathLike = ASCEND_ROOT,
                  nvidia_proc: str | os.PathLike = NVIDIA_PROC,
                  environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Every package of the list (installed version or None) and the runtimes: python, CUDA / cuDNN / NCCL and
    the GPU from torch (when loaded), the NVIDIA driver, CANN and the NPU driver where their files are."""
    spec = load_spec()
    out: dict[str, str | None] = {}
    for name in spec.packages:
        if name not in RUNTIMES:
            out[name] = _dist_version(name)
    out["python"] = platform.python_version()
    out.update({"cuda": None, "cudnn": None, "nccl": None, "gpu": None})
    if "torch" in modules:
        out.update(_torch_versions(modules["torch"]))
    out["nvidia_driver"] = nvidia_driver(nvidia_proc)
    out.update(ascend_versions(ascend_root, environ))
    return out


# -- framework settings (as they take effect on this device) --------------------------------------------

def _quiet(fn: Callable[[], Any]) -> Any:
    """A setting's value, None when this framework version cannot say (never raises, never warns)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except Exception:  # noqa: BLE001
        return None


def torch_settings(torch: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Determinism and float32 precision switches. ``matmul_tf32`` / ``conv_tf32``: whether float32 matmuls /
    convolutions run in TF32 here: CUDA present, the framework allowing it (allow_tf32, matmul precision
    high / medium, fp32_precision tf32) and no NVIDIA_TF32_OVERRIDE=0 (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
    forces matmuls on)."""
    env = os.environ if environ is None else environ
    b = torch.backends
    s: dict[str, Any] = {
        "deterministic_algorithms": _quiet(torch.are_deterministic_algorithms_enabled),
        "deterministic_warn_only": _quiet(torch.is_deterministic_algorithms_warn_only_enabled),
        "cudnn_deterministic": _quiet(lambda: bool(b.cudnn.deterministic)),
        "cudnn_benchmark": _quiet(lambda: bool(b.cudnn.benchmark)),
        "allow_tf32_matmul": _quiet(lambda: bool(b.cuda.matmul.allow_tf32)),
        "allow_tf32_cudnn": _quiet(lambda: bool(b.cudnn.allow_tf32)),
        "float32_matmul_precision": _quiet(torch.get_float32_matmul_precision),
        "fp32_precision": _quiet(lambda: str(b.fp32_precision)),
        "fp32_precision_matmul": _quiet(lambda: str(b.cuda.matmul.fp32_precision)),
        "fp32_precision_conv": _quiet(lambda: str(b.cudnn.conv.fp32_precision)),
        "allow_fp16_reduced_precision_reduction":
            _quiet(lambda: bool(b.cuda.matmul.allow_fp16_reduced_precision_reduction)),
        "allow_bf16_reduced_precision_reduction":
            _quiet(lambda: bool(b.cuda.matmul.allow_bf16_reduced_precision_reduction)),
        "num_threads": _quiet(torch.get_num_threads),
        "cuda_available": bool(_quiet(torch.cuda.is_available)),
    }

    def inherit(v: str | None) -> str | None:
        return s["fp32_precision"] if v == "none" else v

    cuda = s["cuda_available"]
    off = env.get("NVIDIA_TF32_OVERRIDE") == "0"
    mm = bool(s["allow_tf32_matmul"]) or s["float32_matmul_precision"] in ("high", "medium") or \
        inherit(s["fp32_precision_matmul"]) == "tf32" or env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
    conv = bool(s["allow_tf32_cudnn"]) or inherit(s["fp32_precision_conv"]) == "tf32"
    s["matmul_tf32"] = bool(cuda and mm and not off)
    s["conv_tf32"] = bool(cuda and conv and not off)
    return s


def _ascend_precision() -> dict[str, Any]:
    try:
        from mindspore._c_expression import AscendOpPrecisionConf  # Ascend builds only
    except ImportError:
        return {}
    conf = AscendOpPrecisionConf.get_instance()
    return {k: _quiet(getattr(conf, k)) for k in ("matmul_allow_hf32", "conv_allow_hf32", "precision_mode")}


def mindspore_settings(ms: Any) -> dict[str, Any]:
    """Determinism, execution mode and the Ascend precision switches as they take effect: on a device that is
    not Ascend nothing runs in HF32 or casts float32 down; on Ascend the values set (op_precision or the
    context's ascend_config), else CANN's defaults (matmul HF32 off, conv HF32 on) and MindSpore's
    precision_mode default (must_keep_origin_dtype); None where this build cannot say."""
    s: dict[str, Any] = {
        "deterministic": _quiet(lambda: ms.get_context("deterministic")),
        "mode": _quiet(lambda: "PYNATIVE" if ms.get_context("mode") == ms.PYNATIVE_MODE else "GRAPH"),
        "device_target": _quiet(lambda: ms.get_context("device_target")),
        "jit_level": _quiet(lambda: (ms.get_context("jit_config") or {}).get("jit_level")),
    }
    if s["device_target"] != "Ascend":
        s.update(matmul_allow_hf32=False, conv_allow_hf32=False, precision_mode="must_keep_origin_dtype")
        return s
    conf = _ascend_precision()
    ctx = _quiet(lambda: dict(ms.get_context("ascend_config") or {})) or {}
    defaults = {"matmul_allow_hf32": False, "conv_allow_hf32": True, "precision_mode": "must_keep_origin_dtype"}
    for key, default in defaults.items():
        v = conf.get(key) or ctx.get(key)
        if v in ("1", "0"):
            v = v == "1"
        s[key] = v if v not in (None, "") else (default if conf else None)
    return s


# -- random generators ------------------------------------------------------------------------------------

def random_state(modules: Mapping[str, Any], seeds: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Each generator's seed where it can be read, a digest of its state, and whether it is still fresh
    (nothing drawn since it was seeded: the seed must be known, from the generator or ``seeds``, the record
    ``seed_everything`` returns). Reading changes no state."""
    seeds = dict(seeds or {})
    out: dict[str, Any] = {"observed": True}
    py, npseed = seeds.get("python"), seeds.get("numpy")

    def python_state() -> dict[str, Any]:
        st = random.getstate()
        return {"seed": py, "state": _digest(repr(st).encode()),
                "fresh": (random.Random(py).getstate() == st) if isinstance(py, int) else None}

    def numpy_state() -> dict[str, Any]:
        _name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        fresh = None
        if isinstance(npseed, int):
            ref = np.random.RandomState(npseed).get_state(legacy=True)
            fresh = bool(np.array_equal(ref[1], keys) and ref[2] == pos and ref[3] == has_gauss)
        state = np.asarray(keys).tobytes() + f"{pos},{has_gauss},{cached}".encode()
        return {"seed": npseed, "state": _digest(state), "fresh": fresh}

    out["python"] = _quiet(python_state)
    out["numpy"] = _quiet(numpy_state)
    torch = modules.get("torch")
    if torch is not None:
        def torch_state() -> dict[str, Any]:
            seed = int(torch.initial_seed())
            state = torch.get_rng_state()
            g = torch.Generator()
            g.manual_seed(seed)
            d = {"seed": seed, "state": _digest(state.numpy().tobytes()),
                 "fresh": bool(torch.equal(g.get_state(), state))}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                d["cuda_seed"] = int(torch.cuda.initial_seed())
                d["cuda_state"] = _digest(torch.cuda.get_rng_state().numpy().tobytes())
            return d
        out["torch"] = _quiet(torch_state)
    ms = modules.get("mindspore")
    if ms is not None:
        out["mindspore"] = _quiet(lambda: {"seed": ms.get_seed(), "initial_seed": int(ms.initial_seed()),
                                           "state": _digest(ms.get_rng_state().asnumpy().tobytes())})
    return out


# -- dataset files ----------------------------------------------------------------------------------------

def _chunk_size(size: int) -> int:
    cs = CHUNK
    while -(-size // cs) > MAX_CHUNKS:
        cs *= 2
    return cs


def _hash_range(path: Path, start: int, length: int) -> bytes:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            data = os.pread(fd, min(_READ, length - done), start + done)
            if not data:
                raise BadInput(f"{path}: file shrank while it was hashed")
            h.update(data)
            done += len(data)
    finally:
        os.close(fd)
    return h.digest()


def _files_of(path: str | os.PathLike) -> list[tuple[str, Path]]:
    """The regular files of a dataset path. A FIFO, a device (``/dev/zero``) or a dangling link, given or
    inside the folder, is refused by name: hashing one blocks or never ends, skipping one hides a file."""
    from runstore.schema import regular_file

    p = Path(path)
    if not p.is_dir():
        if not p.exists() and not p.is_symlink():
            raise BadInput(f"{p}: no such dataset file or folder")
        return [(p.name, regular_file(p, "dataset file"))]
    try:
        files = sorted((f.relative_to(p).as_posix(), regular_file(f, "dataset file"))
                       for f in p.rglob("*") if not f.is_dir())
    except OSError as exc:
        raise BadInput(f"{exc.filename or p}: cannot list ({exc.strerror})") from None
    if not files:
        raise BadInput(f"{p}: dataset folder holds no file")
    return files


def hash_files(paths: Sequence[str | os.PathLike], workers: int | None = None) -> list[dict[str, Any]]:
    """One entry per path (a file, or a folder: every file under it): each file's size and sha256, and the
    MB/s. A file larger than one chunk (64 MiB) is hashed in chunks on ``workers`` threads; its ``sha256``
    is then the sha256 of its chunks' sha256s (``chunks`` keeps a digest per chunk, so a difference is
    placed to the chunk); a file of one chunk has its plain sha256 (what ``sha256sum`` prints)."""
    entries = [(str(p), _files_of(p)) for p in paths]
    jobs: list[tuple[Path, int, int]] = []
    layout: list[list[tuple[str, Path, int, int, int]]] = []   # per entry: (name, file, size, chunk, first job)
    for _, files in entries:
        rows = []
        for name, f in files:
            try:
                size = f.stat().st_size
            except OSError as exc:
                raise BadInput(f"{f}: cannot read ({exc.strerror})") from None
            cs = _chunk_size(size)
            rows.append((name, f, size, cs, len(jobs)))
            jobs += [(f, i * cs, min(cs, size - i * cs)) for i in range(max(1, -(-size // cs)))]
        layout.append(rows)
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
            digests = list(pool.map(lambda j: _hash_range(*j), jobs))
    except PermissionError as exc:
        raise BadInput(f"{exc.filename}: cannot read (permission denied)") from None
    except OSError as exc:
        raise BadInput(f"{exc.filename or 'dataset file'}: cannot read ({exc.strerror})") from None
    seconds = time.perf_counter() - t0
    total = sum(size for rows in layout for _, _, size, _, _ in rows)
    out = []
    for (path, _), rows in zip(entries, layout, strict=True):
        files = []
        for name, _f, size, cs, first in rows:
            n = max(1, -(-size // cs))
            parts = digests[first:first + n]
            rec: dict[str, Any] = {"name": name, "size": size}
            if n == 1:
                rec["sha256"] = parts[0].hex()
            else:
                rec["sha256"] = hashlib.sha256(b"".join(parts)).hexdigest()
                rec["chunk_size"] = cs
                rec["chunks"] = [d.hex()[:16] for d in parts]
            files.append(rec)
        nbytes = sum(r["size"] for r in files)
        out.append({"path": path, "files": files, "bytes": nbytes,
                    "digest": hashlib.sha256("\n".join(f"{r['name']}\t{r['size']}\t{r['sha256']}"
                                                       for r in files).encode()).hexdigest()})
    rate = total / 1e6 / seconds if seconds > 0 else None
    for e in out:
        e["seconds"] = round(seconds, 4)
        e["mb_per_s"] = round(rate, 1) if rate else None
    return out


# -- weights ----------------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix_sum(u: np.ndarray, x: np.ndarray, t: np.ndarray) -> int:
    """Sum mod 2^64 of splitmix64(u) over ``u`` (uint32 or uint64 words), with scratch buffers x, t."""
    n = u.size
    xv, tv = x[:n], t[:n]
    np.copyto(xv, u, casting="unsafe")
    xv += _GOLDEN
    np.right_shift(xv, _S1, out=tv)
    xv ^= tv
    xv *= _M1
    np.right_shift(xv, _S2, out=tv)
    xv ^= tv
    xv *= _M2
    np.right_shift(xv, _S3, out=tv)
    xv ^= tv
    return int(xv.sum(dtype=np.uint64))


def fingerprint(array: np.ndarray) -> dict[str, Any]:
    """shape, sha256 of the values (floating point as float32, little-endian, C order), mset (order-free
    multiset hash of the same values), float64 L2 norm and sum."""
    a = np.asarray(array)
    shape = list(a.shape)
    if a.dtype.kind == "f" and a.dtype != np.float32:
        a = a.astype(np.float32)
    elif a.dtype.kind in "iub":
        a = a.astype(np.int64)
    elif a.dtype.kind != "f":
        raise BadInput(f"a weight of dtype {a.dtype} cannot be fingerprinted")
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.dtype.byteorder == ">":
        flat = flat.astype(flat.dtype.newbyteorder("<"))
    words = flat.view(np.uint32 if flat.dtype.itemsize == 4 else np.uint64)
    h = hashlib.sha256()
    x = np.empty(min(_BLOCK, max(1, words.size)), np.uint64)
    t = np.empty_like(x)
    y = np.empty(x.size, np.float64)
    mset, sq, total = 0, 0.0, 0.0
    for i in range(0, flat.size, _BLOCK):
        block = flat[i:i + _BLOCK]
        h.update(memoryview(block).cast("B"))
        mset = (mset + _mix_sum(words[i:i + _BLOCK], x, t)) & 0xFFFFFFFFFFFFFFFF
        b64 = y[:block.size]
        np.copyto(b64, block, casting="unsafe")
        sq += float(np.dot(b64, b64))
        total += float(b64.sum())
    return {"shape": shape, "sha256": h.hexdigest(), "mset": f"{mset:016x}", "norm": math.sqrt(sq),
            "sum": total}


def _named_fingerprint(name: str, arr: np.ndarray) -> dict[str, Any]:
    try:
        return fingerprint(arr)
    except BadInput as exc:
        raise BadInput(f"weight {name}: {exc}") from None


def fingerprint_weights(items: Iterable[tuple[str, Callable[[], np.ndarray], str]],
                        workers: int | None = None) -> dict[str, Any]:
    """``items``: (name, a function giving the array on the host, stored dtype). Arrays are fetched one at a
    time here and fingerprinted on ``workers`` threads, at most two per worker held at once."""
    workers = workers or default_workers()
    params: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    nbytes = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: list[tuple[str, str, Any]] = []

        def drain(keep: int) -> None:
            while len(pending) > keep:
                name, dtype, fut = pending.pop(0)
                params[name] = {**fut.result(), "dtype": dtype}

        for name, get, dtype in items:
            arr = get()
            nbytes += int(np.asarray(arr).size) * 4
            pending.append((name, dtype, pool.submit(_named_fingerprint, name, arr)))
            drain(2 * workers)
        drain(0)
    seconds = time.perf_counter() - t0
    return {"params": params, "bytes": nbytes, "seconds": round(seconds, 4),
            "mb_per_s": round(nbytes / 1e6 / seconds, 1) if seconds > 0 else None}


# -- the capture ------------------------------------------------------------------------------------------

def framework_modules(import_frameworks: Sequence[str] = ()) -> dict[str, Any]:
    """torch / mindspore as loaded in this process, plus those in ``import_frameworks`` imported now (an
    import that fails leaves it out)."""
    mods = {fw: sys.modules[fw] for fw in FRAMEWORKS if fw in sys.modules}
    for fw in import_frameworks:
        if fw not in mods:
            try:
                mods[fw] = importlib.import_module(fw)
            except Exception:  # noqa: BLE001 - not installed or broken: its versions say so
                pass
    return mods


def capture_environment(framework: str, *, by: str, data: Sequence[str | os.PathLike] = (),
                        weights: Iterable[tuple[str, Callable[[], np.ndarray], str]] | None = None,
                        weights_source: str | None = None, parallel: Mapping[str, Any] | None = None,
                        seeds: Mapping[str, Any] | None = None, observe_random: bool = True,
                        import_frameworks: Sequence[str] = (), environ: Mapping[str, str] | None = None,
                        workers: int | None = None, ascend_root: str | os.PathLike = ASCEND_ROOT,
                        nvidia_proc: str | os.PathLike = NVIDIA_PROC) -> dict[str, Any]:
    """One side's capture (a JSON-able dict; comparators.environment.CAPTURE_SCHEMA is its shape).

    ``framework``: the side (torch or mindspore): which switches answer the list's questions. ``by``: who
    captured (the CLI, a dumper). ``observe_random``: False where the generators are not the training
    process's (the CLI runs in a process of its own). ``parallel``: the layout the weights were taken in
    (a dumper's rank 0 holds shards under TP / PP / EP)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, not {framework!r}")
    mods = framework_modules(import_frameworks)
    settings = {}
    if "torch" in mods:
        settings["torch"] = torch_settings(mods["torch"], environ)
    if "mindspore" in mods:
        settings["mindspore"] = mindspore_settings(mods["mindspore"])
    capture: dict[str, Any] = {
        "kind": CAPTURE_KIND, "version": CAPTURE_VERSION, "framework": framework,
        "captured": {"by": by, "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                     "platform": platform.platform()},
        "env": read_env(environ),
        "versions": read_versions(mods, ascend_root=ascend_root, nvidia_proc=nvidia_proc, environ=environ),
        "settings": settings,
        "random": random_state(mods, seeds) if observe_random else {
            "observed": False, "note": f"captured by {by} in a process of its own: the training process's "
                                       "generators are recorded by the dumper (DumpConfig(capture_env=True))"},
        "data": hash_files(data, workers) if data else [],
        "weights": None,
    }
    if weights is not None:
        w = fingerprint_weights(weights, workers)
        w["source"] = weights_source
        w["parallel"] = dict(parallel or {})
        capture["weights"] = w
    return capture


def write_capture(path: str | os.PathLike, capture: Mapping[str, Any]) -> Path:
    """The capture as JSON at ``path`` (atomically); one-line BadInput when it cannot be written."""
    from runstore.atomic import atomic_write_json

    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{p}: is a directory, expected a file name for the capture")
    try:
        atomic_write_json(p, dict(capture))
    except OSError as exc:
        raise BadInput(f"{p}: cannot write ({exc.strerror or exc.__class__.__name__})") from None
    return p
