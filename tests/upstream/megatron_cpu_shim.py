"""Test support: Megatron-LM's own ``pretrain_gpt.py`` on a machine without a GPU (CPU, gloo).

Nothing here is product code and nothing of it is copied from Megatron-LM: it answers the CUDA calls a
Megatron-LM checkout makes with CPU ones, so that the checkout's real training loop, model and optimizer
run unchanged. ``install()`` runs in every process of the run (``sitecustomize`` in the build folder that
tests/upstream/megatron_pretrain.py puts first on PYTHONPATH, when ``XF_ALIGN_MEGATRON_CPU=1``). What it
does, and why:

* ``torch.cuda`` calls (``_cuda_calls``): ``current_device`` answers the CPU device (Megatron allocates its
  buffers, masks and RoPE tables there); ``synchronize`` / ``set_device`` / ``empty_cache`` / ``nvtx`` /
  ``Event`` / ``Stream`` / ``stream`` do nothing (the timers and the DDP / optimizer overlap code call them;
  gloo has already waited on every request); ``device_count`` answers 1 and ``is_available`` True
  (``initialize_megatron`` asserts it; the CPU build of torch still never initialises CUDA: every call that
  would is answered here);
  the memory statistics (``memory_allocated``, ``memory_stats``, ...) answer 0 (the memory report);
  the device probes (``get_device_capability``, ``get_device_name``, ``get_device_properties``) describe a
  generic compute-capability 8.0 device named ``cpu`` (core >= 0.18 probes the device while importing);
  ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` act on a CPU generator kept per process (Megatron's
  CUDA RNG tracker forks a state per model-parallel region; dropout is off here, so the states are
  only kept and restored). Each call is counted (``COUNTS``) and the counts are written to
  ``$XF_ALIGN_SHIM_COUNTS`` at exit, so the driver can report how many calls were answered.
* ``device='cuda'`` / ``.cuda()`` / ``.to('cuda')`` inside torch calls: a process-wide TorchFunctionMode
  rewrites them to CPU (Megatron's optimizer, DDP buffers and loss reduction hard-code them).
* ``megatron.core.datasets.utils.compile_helpers``: a no-op. It runs ``make`` inside the checkout; the
  driver builds ``helpers.cpp`` with g++ and pybind11 into its build folder instead, and this module loads
  that library as ``megatron.core.datasets.helpers_cpp`` (``$XF_ALIGN_HELPERS_CPP``).
* ``megatron.legacy.fused_kernels.load``: a no-op. It reads ``nvcc -V`` and makes a build folder inside
  the checkout; it compiles nothing for this model (the unfused softmax path is used).
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm``: defined as None when missing. core 0.14-0.16
  define it only when Transformer Engine imports, and the router reads it (``NameError`` without TE); None
  is what its own fallback checks for.
* ``typing.override`` (and ``typing.TypeIs`` / ``typing.ReadOnly`` when missing): taken from
  typing_extensions. Megatron-LM main (core >= 0.18) imports ``typing.override``, new in Python 3.12; the
  decorator only marks methods, so the 3.11 backport behaves the same.

The environment the driver sets on top: TORCHDYNAMO_DISABLE=1 (Megatron decorates a few functions with
``torch.compile``; there is no compiler toolchain for them on CPU), PYTHONDONTWRITEBYTECODE=1 (nothing is
written into the checkout), and triton / einops from a side folder when the venv lacks them (Megatron-LM
imports both unconditionally; triton imports on a machine without a GPU).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import typing
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

COUNTS: Counter[str] = Counter()
_CPU = None


def _count(name: str, fn: Callable[..., Any], prefix: str = "torch.cuda.") -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        COUNTS[f"{prefix}{name}"] += 1
        return fn(*args, **kwargs)
    wrapper.__name__ = name
    return wrapper


class _Nothing:
    """Stands for a CUDA Event / Stream / nvtx range: every method does nothing, timings are 0."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _typing_backports() -> None:
    """Python 3.12 names of ``typing`` that Megatron-LM main imports, from typing_extensions."""
    import typing_extensions

    for name in ("override", "TypeIs", "ReadOnly"):
        if not hasattr(typing, name) and hasattr(typing_extensions, name):
            setattr(typing, name, getattr(typing_extensions, name))


def _cuda_calls() -> dict[str, Callable[..., Any]]:
    import torch

    gen = torch.Generator()
    gen.manual_seed(0)

    def get_rng_state(device: Any = "cuda") -> Any:
        return gen.get_state()

    def set_rng_state(state: Any, device: Any = "cuda") -> None:
        gen.set_state(state)

    def manual_seed(seed: int) -> None:
        gen.manual_seed(int(seed))

    def memory_stats(device: Any = None) -> dict[str, int]:
        return {k: 0 for k in ("reserved_bytes.all.current", "allocated_bytes.all.current",
                               "allocated_bytes.all.peak", "allocation.all.current",
                               "num_alloc_retries", "active_bytes.all.current")}

    zero = lambda *a, **k: 0  # noqa: E731 - memory figures
    nothing = lambda *a, **k: None  # noqa: E731
    return {
        "current_device": lambda: _CPU, "synchronize": nothing, "set_device": nothing,
        "empty_cache": nothing, "device_count": lambda: 1, "is_available": lambda: True, "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state, "manual_seed": manual_seed, "manual_seed_all": manual_seed,
        "memory_allocated": zero, "max_memory_allocated": zero, "memory_reserved": zero,
        "max_memory_reserved": zero, "memory_stats": memory_stats, "reset_peak_memory_stats": nothing,
        "Event": _Nothing, "Stream": _Nothing, "stream": lambda *a, **k: contextlib.nullcontext(),
        "current_stream": lambda *a, **k: _Nothing(), "default_stream": lambda *a, **k: _Nothing(),
        "get_device_capability": lambda *a, **k: (8, 0), "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: SimpleNamespace(
            name="cpu", major=8, minor=0, multi_processor_count=1, total_memory=0),
    }


def _patch_torch_cuda() -> None:
    import torch

    calls = _cuda_calls()
    for name, fn in calls.items():
        setattr(torch.cuda, name, _count(name, fn) if callable(fn) and not isinstance(fn, type) else fn)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        setattr(torch.cuda.random, name, getattr(torch.cuda, name))
    nvtx = _Nothing()
    torch.cuda.nvtx = nvtx  # type: ignore[attr-defined]


def _device_mode() -> Any:
    """A TorchFunctionMode that turns ``device='cuda'`` (and ``.cuda()`` / ``.to('cuda')``) into CPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda(dev: Any) -> bool:
        if isinstance(dev, torch.device):
            return dev.type == "cuda"
        if isinstance(dev, str):
            return dev.startswith("cuda")
        return isinstance(dev, int) and not isinstance(dev, bool)

    class CpuDeviceMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                COUNTS["Tensor.cuda"] += 1
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)   # Megatron asserts 'torch.cuda.FloatTensor' for grads
                return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
            if "device" in kwargs and is_cuda(kwargs["device"]):
                COUNTS["device='cuda'"] += 1
                kwargs["device"] = _CPU
            if func is torch.Tensor.to and len(args) > 1 and is_cuda(args[1]):
                COUNTS["Tensor.to('cuda')"] += 1
                args = (args[0], _CPU, *args[2:])
            return func(*args, **kwargs)

    return CpuDeviceMode()


_PATCHES: dict[str, Callable[[Any], None]] = {}


def _no_compile_helpers(mod: Any) -> None:
    mod.compile_helpers = _count("megatron.core.datasets.utils.compile_helpers (no-op)", lambda: None, "")


def _te_general_gemm_name(mod: Any) -> None:
    if not hasattr(mod, "te_general_gemm"):
        mod.te_general_gemm = None


def _no_fused_kernels(mod: Any) -> None:
    mod.load = _count("megatron.legacy.fused_kernels.load (no-op)", lambda args=None: None, "")


class _PatchedLoader:
    """The module's own loader; after it ran the module, the patch is applied. Anything else (source lines for
    tracebacks, ``get_filename``, ...) is the original loader's."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _PATCHES[self._name](module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Applies a patch to a module right after it is imported (the module's file is not touched)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchedLoader(spec.loader, fullname)
                return spec
        return None


def _load_helpers(path: str) -> None:
    """The prebuilt C++ dataset helper as ``megatron.core.datasets.helpers_cpp``."""
    name = "megatron.core.datasets.helpers_cpp"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    sys.modules[name] = importlib.util.module_from_spec(spec)
    loader.exec_module(sys.modules[name])


def _write_counts(path: str) -> None:
    with contextlib.suppress(OSError):
        with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as f:
            json.dump(dict(COUNTS), f, indent=1, sort_keys=True)


def install() -> None:
    """Everything listed in the module docstring, once per process."""
    global _CPU
    if _CPU is not None:
        return
    import torch

    _CPU = torch.device("cpu")
    _typing_backports()
    if not torch.cuda.is_available():
        _device_mode().__enter__()
        _patch_torch_cuda()
    _PATCHES.update({"megatron.core.datasets.utils": _no_compile_helpers,
                     "megatron.legacy.fused_kernels": _no_fused_kernels,
                     "megatron.core.transformer.moe.moe_utils": _te_general_gemm_name})
    sys.meta_path.insert(0, _PatchAfterImport())
    helpers = os.environ.get("XF_ALIGN_HELPERS_CPP")
    if helpers:
        _load_helpers(helpers)
    counts = os.environ.get("XF_ALIGN_SHIM_COUNTS")
    if counts:
        atexit.register(_write_counts, counts)
