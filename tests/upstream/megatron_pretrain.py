"""By-hand check on a real Megatron-LM checkout: its own ``pretrain_gpt.py`` on CPU, dumped by
``python -m dumpers.megatron_lm``, then ``align report STORE LOG``. Not part of ``make test`` (CI cannot
download upstream code; pytest does not collect this folder: no ``test_*`` names, see conftest.py)::

    python tests/upstream/megatron_pretrain.py --checkout /path/to/Megatron-LM --out /tmp/mlm

What it runs (the checkout is only read; nothing is written into it):

1. the C++ dataset helper (``megatron/core/datasets/helpers.cpp``) built with g++ and pybind11 into a cache
   folder (``$TMPDIR/xf-align-upstream/helpers/<sha>``), loaded by the shim instead of Megatron's ``make``;
2. triton and einops, which Megatron-LM imports unconditionally: used from the venv when it has them, else
   installed once with ``pip install --no-deps --target`` into the cache folder (not into the venv);
3. ``pretrain_gpt.py`` once for the initial weights: one iteration at ``--lr 0`` saved with ``--save
   --save-interval 1`` (torch_dist; the legacy torch format for core < 0.13, whose torch_dist writer
   does not match torch 2.13's). Megatron-LM cannot save at iteration 0 (``save_checkpoint`` runs after
   an iteration; ``--ckpt-convert-format`` needs an existing checkpoint), and Adam at lr 0 (with decoupled
   weight decay x lr = 0) leaves every weight bit-equal, so ``OUT/checkpoint/iter_0000001`` holds the
   initial weights. The training run loads it (``--load --finetune``: weights only, iteration 0), so it
   provably starts from what the other side converts (``align convert-weights OUT/checkpoint``);
4. ``pretrain_gpt.py`` under ``python -m dumpers.megatron_lm --align-out OUT/store``: the demo's dense model
   (demo/model.py ``demo_model()``: vocab 128 = NullTokenizer ``--vocab-size 127`` padded, hidden 64, 2
   layers, 4 heads, 2 query groups, ffn 128, seq 16, micro batch 2, global batch 4, RMSNorm eps 1e-5, qk
   layernorm, SwiGLU, RoPE, untied output, no bias, ``--transformer-impl local``), gloo, 4 iterations,
   ``--log-interval 1``; stdout and stderr go to ``OUT/megatron.log``. Data: ``--mock-data``; for core
   < 0.13 a small indexed dataset made by the checkout's tools/preprocess_data.py (``indexed_data``), as
   0.12's mock dataset yields token ids up to 4095, beyond the 128 vocabulary;
5. ``align report OUT/store OUT/megatron.log --out OUT/report``; the verdict and each stage's are printed.

Every process of both runs gets the CPU shim (tests/upstream/megatron_cpu_shim.py, through a
``sitecustomize`` in ``OUT/build/site``); its docstring lists which CUDA calls it answers and why. The
calls it answered are summed into ``OUT/shim_calls.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIM_DIR = Path(__file__).resolve().parent
PYDEPS = ("einops==0.8.2", "triton==3.6.0")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--qk-layernorm", "--swiglu",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--transformer-impl", "local", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--vocab-size", "127", "--tokenizer-type", "NullTokenizer", "--split", "1,0,0",
         "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
         "--distributed-backend", "gloo", "--num-workers", "0", "--use-cpu-initialization",
         "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
         "--no-rope-fusion", "--no-persist-layer-norm",
         "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
         "--adam-eps", "1e-8"]
#: the optimizer and schedule of the example YAML (docs/examples/mindformers_qwen3_tiny_cpu.yaml), so that the
#: pair check (tests/upstream/check.py) compares like with like: AdamW, constant lr 1e-3, no warmup
TRAIN = ["--train-iters", "4", "--lr", "1e-3", "--min-lr", "0", "--lr-decay-style", "constant",
         "--lr-warmup-iters", "0"]
#: ``--moe``: the demo's MoE shape (4 experts, top 2, expert ffn 32) with the router's losses on, to see the
#: store's ``load_balancing_loss`` / ``z_loss`` next to the log's
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
#: the MoE shape of the example YAML MindFormers trains (docs/examples/mindformers_qwen3_moe_tiny_cpu.yaml): no
#: router losses (``moe_aux_loss_coeff: 0.0``; Megatron's default coefficient is 0 and no z-loss)
MOE_PAIR = MOE[:MOE.index("--moe-router-load-balancing-type")]
#: the TP=2 dense baseline of ``make upstream-check`` (2 processes under torchrun)
TP2 = ["--tensor-model-parallel-size", "2"]
#: the MoE baseline at EP=2 (2 processes: DP=2, the 4 experts 2 per rank)
EP2 = ["--expert-model-parallel-size", "2"]
INITIAL = ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-decay-style", "constant",
           "--save-interval", "1"]

SITECUSTOMIZE = '''"""Written by tests/upstream/megatron_pretrain.py: installs the CPU shim in every Python process."""
import os
import sys

if os.environ.get("XF_ALIGN_MEGATRON_CPU") == "1":
    sys.path.insert(0, os.environ["XF_ALIGN_SHIM_DIR"])
    import megatron_cpu_shim

    megatron_cpu_shim.install()
'''


class UpstreamError(RuntimeError):
    """A step of the check failed; the message names the step and the log to read."""


def _cache(cache: Path | None) -> Path:
    return Path(cache) if cache is not None else Path(tempfile.gettempdir()) / "xf-align-upstream"


def build_helpers(checkout: Path, cache: Path | None = None, python: str = sys.executable) -> Path:
    """The checkout's C++ dataset helper, built with g++ and pybind11 (as its Makefile does) into the cache."""
    src = checkout / "megatron" / "core" / "datasets" / "helpers.cpp"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    lib = _cache(cache) / "helpers" / digest / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    includes = subprocess.run([python, "-m", "pybind11", "--includes"], capture_output=True, text=True,
                              check=True).stdout.split()
    tmp = lib.with_suffix(".tmp")
    cmd = ["g++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", *includes, str(src), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UpstreamError(f"building {src} failed: {proc.stderr.strip()[-500:]}")
    tmp.replace(lib)
    return lib


def python_deps(cache: Path | None = None, python: str = sys.executable) -> Path | None:
    """None when ``python`` imports triton and einops; else a folder they were pip-installed into."""
    missing = [spec for spec in PYDEPS if subprocess.run(
        [python, "-c", f"import {spec.split('==')[0]}"], capture_output=True).returncode != 0]
    if not missing:
        return None
    target = _cache(cache) / "pydeps"
    if all((target / spec.split("==")[0]).is_dir() for spec in missing):
        return target
    print(f"installing {' '.join(missing)} into {target} (not into the venv)", flush=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), *missing],
                   check=True)
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def checkout_version(checkout: Path) -> str | None:
    """megatron/core/package_info.py's MAJOR.MINOR.PATCH."""
    text = (checkout / "megatron" / "core" / "package_info.py").read_text()
    parts = [re.search(rf"^{k} = (\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def _env(checkout: Path, build: Path, helpers: Path, pydeps: Path | None) -> dict[str, str]:
    site = build / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(site), str(checkout), *([str(pydeps)] if pydeps else []), str(ROOT)]
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(path), XF_ALIGN_MEGATRON_CPU="1", XF_ALIGN_SHIM_DIR=str(SHIM_DIR),
               XF_ALIGN_HELPERS_CPP=str(helpers), XF_ALIGN_SHIM_COUNTS=str(build / "shim_calls"),
               TORCHDYNAMO_DISABLE="1", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return env


def _launch(cmd: list[str], env: dict[str, str], log: Path, cwd: Path, what: str, timeout: int = 600) -> None:
    for _ in range(3):   # the free port may be taken by another process before gloo binds it: try another
        if "torch.distributed.run" not in cmd:
            env = dict(env, MASTER_PORT=str(_free_port()))
        with open(log, "w", encoding="utf-8") as f:
            proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        if proc.returncode == 0 or "EADDRINUSE" not in log.read_text(errors="replace"):
            break
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        raise UpstreamError(f"{what} exited {proc.returncode}: {tail[0] if tail else ''} (log: {log})")


def indexed_data(script_dir: Path, env: dict[str, str], build: Path, python: str = sys.executable) -> list[str]:
    """``--data-path PREFIX``: 64 documents of random token ids in [0, 127), each ending in the NullTokenizer's
    end-of-document id 127, written by the checkout's own tools/preprocess_data.py (for checkouts whose mock
    dataset emits ids beyond the vocabulary: core 0.12's yields positions 1..4095)."""
    import numpy as np

    rng = np.random.default_rng(1234)
    src = build / "documents.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for _ in range(64):
            ids = rng.integers(0, 127, size=int(rng.integers(5, 40)))
            f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
    prefix = build / "documents"
    _launch([python, str(script_dir / "tools" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
             str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--append-eod",
             "--workers", "1"], env, build / "preprocess_data.log", build, "tools/preprocess_data.py")
    return ["--data-path", f"{prefix}_text_document"]


def _older(version: str | None, than: tuple[int, int]) -> bool:
    return version is not None and tuple(int(x) for x in version.split(".")[:2]) < than


def _torchrun(python: str, nproc: int) -> list[str]:
    """The launcher of a run over ``nproc`` processes (torchrun, one node, a free rendezvous port)."""
    return [python] if nproc == 1 else [python, "-m", "torch.distributed.run", "--standalone",
                                        f"--nproc-per-node={nproc}"]


def run(checkout: str | Path, out: str | Path, *, cache: Path | None = None, python: str = sys.executable,
        extra: list[str] | None = None, nproc: int = 1) -> dict[str, Path]:
    """Initial-weights checkpoint, then the dumped training run; -> paths of store, log and checkpoint.
    ``extra``: more Megatron-LM arguments for both runs (e.g. ``MOE``, ``TP2``); ``nproc`` > 1: both runs under
    torchrun with that many processes (gloo on CPU)."""
    checkout, out = Path(checkout).resolve(), Path(out).resolve()
    script = checkout / "pretrain_gpt.py"
    if not script.is_file() or not (checkout / "megatron" / "training").is_dir():
        raise UpstreamError(f"{checkout}: not a Megatron-LM checkout (no pretrain_gpt.py or megatron/training)")
    build = out / "build"
    for old in ("store", "checkpoint", "build", "report"):
        shutil.rmtree(out / old, ignore_errors=True)
    build.mkdir(parents=True)
    env = _env(checkout, build, build_helpers(checkout, cache, python), python_deps(cache, python))
    if nproc > 1:      # torchrun gives each process its rank, world size and rendezvous address
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    launch = _torchrun(python, nproc)
    paths = {"store": out / "store", "log": out / "megatron.log", "checkpoint": out / "checkpoint",
             "checkpoint_log": out / "checkpoint.log"}
    old = _older(checkout_version(checkout), (0, 13))
    data = indexed_data(checkout, env, build, python) if old else ["--mock-data"]
    # 0.12's torch_dist writer calls torch's _write_item without serialization_format (torch >= 2.7)
    data += ["--ckpt-format", "torch" if old else "torch_dist", *(extra or [])]
    _launch([*launch, str(script), *MODEL, *data, *INITIAL, "--save", str(paths["checkpoint"])], env,
            paths["checkpoint_log"], build, "the initial-weights run (--lr 0, --save)")
    _launch([*launch, "-m", "dumpers.megatron_lm", "--align-out", str(paths["store"]), str(script), *MODEL, *data,
             *TRAIN, "--load", str(paths["checkpoint"]), "--finetune"], env, paths["log"], build,
            "the training run under dumpers.megatron_lm")
    counts: dict[str, int] = {}
    for f in build.glob("shim_calls.*"):
        for k, v in json.loads(f.read_text()).items():
            counts[k] = counts.get(k, 0) + int(v)
    (out / "shim_calls.json").write_text(json.dumps(dict(sorted(counts.items())), indent=1))
    meta = json.loads((paths["store"] / "meta.json").read_text())
    used, want = meta.get("versions", {}).get("megatron-core"), checkout_version(checkout)
    if want and (used or "").split("+")[0].split("rc")[0] != want:
        raise UpstreamError(f"the run used megatron-core {used}, not the checkout's {want}: put the checkout "
                            "first on PYTHONPATH")
    return paths


def report(store: Path, log: Path, out: Path, python: str = sys.executable, extra: tuple[str, ...] = ()) -> dict:
    """``align report STORE LOG [EXTRA] --out OUT`` (LOG: the log, or any run); its summary.json (with the exit
    status as ``exit``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([python, "-m", "align", "report", str(store), str(log), *extra, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise UpstreamError(f"align report exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return {**json.loads(summary_path.read_text()), "exit": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", required=True, help="a Megatron-LM checkout (has pretrain_gpt.py)")
    ap.add_argument("--out", required=True, help="folder for the store, log, checkpoint and report")
    ap.add_argument("--moe", action="store_true", help="the MoE variant (MOE arguments)")
    ap.add_argument("--cache", default=None, help="built helper and pip-installed triton/einops (default "
                                                  "$TMPDIR/xf-align-upstream)")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    try:
        paths = run(ns.checkout, out, cache=Path(ns.cache) if ns.cache else None, extra=MOE if ns.moe else None)
        summary = report(paths["store"], paths["log"], out / "report")
    except (UpstreamError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"megatron_pretrain: {exc}", file=sys.stderr)
        return 2
    calls = json.loads((out / "shim_calls.json").read_text())
    print(f"checkout {ns.checkout} (megatron-core {checkout_version(Path(ns.checkout))}); CUDA calls answered "
          f"on CPU: {sum(calls.values())}")
    for k, p in paths.items():
        print(f"  {k}: {p}")
    print(f"align report: verdict {summary['verdict']} (exit {summary['exit']}); report {out / 'report'}")
    for name, st in summary["stages"].items():
        if st.get("verdict") != "skipped":
            fails = [f["message"] for f in summary["findings"] if f["stage"] == name and f["verdict"] == "fail"]
            print(f"  {name:<18} {st['verdict']}" + (f": {fails[0]}" if fails else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
