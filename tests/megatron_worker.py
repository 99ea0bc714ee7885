"""Scenarios on a real Megatron-core GPTModel (CPU, gloo), run as a script: alone or under torchrun.

Why a script: Megatron's parallel state is process-global and TP/DP need several processes, so the tests
launch this file and read back the JSON result each rank writes plus the run stores.

Scenarios (``--scenarios a,b,...``, run in this order in one process):
  identical   3 steps without and with the dumper (all features on), for the plain torch optimizer on a
              bare GPTModel and for Megatron's optimizer on a DDP-wrapped one: losses, grad norms, params.
  nan_grad    NaN written into one parameter's gradient (on ``--nan-rank`` only) at step 2.
  nan_act     NaN written into one module's forward output at step 2 (hook registered before the dumper).
  unwritable  the run store's ``steps`` folder replaced by a file after step 1.
  pause       dumps steps 1-2, then stops inside step 3 after the local norms are in the open step file,
              prints PAUSED and sleeps (the test SIGKILLs it).

``--then TP OUT SCENARIOS`` (repeatable) runs more scenarios at another tensor-parallel size in the same
launch (Megatron's parallel state re-initialised in the same process group): one torchrun start-up for TP=2
and DP=2 instead of two.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from demo import megatron_cpu as mc  # noqa: E402
from dumpers.megatron import MegatronDumper  # noqa: E402
from dumpers.seed_torch import seed_everything  # noqa: E402
from dumpers.torch_dumper import DumpConfig  # noqa: E402

NAN_PARAM = "decoder.layers.1.mlp.linear_fc2.weight"
NAN_MODULE = "decoder.layers.0.mlp.linear_fc1"
STEPS = 3


def digest(model: torch.nn.Module) -> dict[str, str]:
    return {n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
            for n, p in model.named_parameters()}


def train(cfg: mc.TinyLlamaConfig, info: mc.ParallelInfo, *, megatron_opt: bool, dumper_cfg: DumpConfig | None,
          inject=None, between=None, pause_at: int | None = None) -> dict:  # noqa: ANN001
    model = mc.build_tiny_llama(cfg, seed=1234)
    if megatron_opt:
        model = mc.wrap_ddp(model)
        opt = mc.make_megatron_optimizer(model, lr=1e-3, clip_grad=1.0)
    else:
        opt = mc.torch_optimizer(model, lr=1e-3)
    if inject is not None:
        inject(model)
    dumper = MegatronDumper(model, opt, dumper_cfg) if dumper_cfg is not None else None
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        batch = mc.synthetic_batch(step, cfg, dp_rank=info.dp_rank)
        if dumper is not None:
            dumper.begin_step(step)
            dumper.record_batch(batch)
        model.current_step = step
        loss, gnorm = mc.train_step(model, opt, batch)
        losses.append(loss)
        norms.append(gnorm)
        if dumper is not None:
            if pause_at == step:
                print("PAUSED", flush=True)
                time.sleep(600)
            dumper.end_step(loss=loss)
        if between is not None:
            between(step)
    out = {"losses": losses, "grad_norms": norms, "digest": digest(model)}
    if dumper is not None:
        dumper.close()
        out["errors"] = dumper.errors
        out["error_log"] = dumper.error_log
    return out


def param_nan_injector(rank_ok: bool):  # noqa: ANN201
    def inject(model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            if name.replace("module.", "", 1) == NAN_PARAM and rank_ok:
                def hook(g: torch.Tensor, model=model) -> torch.Tensor:
                    if getattr(model, "current_step", 0) == 2:
                        g = g.clone()
                        g.view(-1)[0] = float("nan")
                    return g
                p.register_hook(hook)
    return inject


def module_nan_injector(model: torch.nn.Module) -> None:
    mod = {n.replace("module.", "", 1): m for n, m in model.named_modules()}[NAN_MODULE]

    def hook(module, args, output):  # noqa: ANN001, ANN202
        if getattr(model, "current_step", 0) != 2:
            return None
        out, bias = output if isinstance(output, tuple) else (output, None)
        out = out.clone()
        out.view(-1)[3] = float("nan")
        return (out, bias) if isinstance(output, tuple) else out
    mod.register_forward_hook(hook)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default="identical")
    ap.add_argument("--nan-rank", type=int, default=0)
    ap.add_argument("--then", nargs=3, action="append", default=[], metavar=("TP", "OUT", "SCENARIOS"),
                    help="after --scenarios, re-initialise Megatron's parallel state at TP in the same "
                         "process group and run SCENARIOS into OUT (one launch, several layouts)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    seed_record = seed_everything(1234, deterministic=True)
    info = mc.init_megatron_cpu(tp=args.tp, seed=1234)
    cfg = mc.TinyLlamaConfig()
    out = Path(args.out)
    everything = dict(tensors="full", nan_trace="all", seed_layout=True, local_norms=True, batch=True,
                      meta={"seed": seed_record["seed"], "determinism": seed_record["determinism"],
                            "config": cfg.as_dict()})
    run_scenarios(args, cfg, info, out, args.scenarios, everything)
    for tp, then_out, scenarios in args.then:    # another layout in the same launch (mc.set_parallel)
        info = mc.set_parallel(tp=int(tp), seed=1234)
        run_scenarios(args, cfg, info, Path(then_out), scenarios, everything)
    mc.destroy_megatron_cpu()


def run_scenarios(args: argparse.Namespace, cfg: mc.TinyLlamaConfig, info: mc.ParallelInfo, out: Path,
                  scenarios: str, everything: dict) -> None:
    """Run ``scenarios`` (comma-separated) at the current layout; each rank writes out/result_rank{r}.json."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"info": info.as_dict()}
    for scenario in scenarios.split(","):
        run_dir = out / scenario
        if scenario == "identical":
            for megatron_opt in (False, True):
                key = "megatron_opt" if megatron_opt else "torch_opt"
                base = train(cfg, info, megatron_opt=megatron_opt, dumper_cfg=None)
                dumped = train(cfg, info, megatron_opt=megatron_opt,
                               dumper_cfg=DumpConfig(out=run_dir / key, **everything))
                result[f"identical.{key}"] = {"base": base, "dumped": dumped}
        elif scenario == "nan_grad":
            r = train(cfg, info, megatron_opt=True, dumper_cfg=DumpConfig(out=run_dir, nan_trace="grads"),
                      inject=param_nan_injector(info.rank == args.nan_rank))
            result[scenario] = r
        elif scenario == "nan_act":
            r = train(cfg, info, megatron_opt=True, dumper_cfg=DumpConfig(out=run_dir, **everything),
                      inject=module_nan_injector)
            result[scenario] = r
        elif scenario == "unwritable":
            def breaker(step: int, run_dir: Path = run_dir) -> None:
                if step == 1 and info.rank == 0:
                    shutil.rmtree(run_dir / "steps")
                    (run_dir / "steps").write_text("not a folder")
            base = train(cfg, info, megatron_opt=True, dumper_cfg=None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                r = train(cfg, info, megatron_opt=True, dumper_cfg=DumpConfig(out=run_dir, **everything),
                          between=breaker)
            r["warnings"] = [str(w.message) for w in caught if "dumper" in str(w.message)]
            result[scenario] = {"base": base, "dumped": r}
        elif scenario == "attach":
            # the pretrain_gpt.py form: dumper made on the bare model, optimizer attached later,
            # step boundaries from record_batch(step=...), last step ended by close()
            bare = mc.build_tiny_llama(cfg, seed=1234)
            dumper = MegatronDumper(bare, None, DumpConfig(out=run_dir))
            model = mc.wrap_ddp(bare)
            opt = mc.make_megatron_optimizer(model, lr=1e-3, clip_grad=1.0)
            dumper.attach_optimizer(opt)
            norms = []
            for step in range(1, STEPS + 1):
                batch = mc.synthetic_batch(step, cfg, dp_rank=info.dp_rank)
                dumper.record_batch(batch, step=step)
                norms.append(mc.train_step(model, opt, batch)[1])
            dumper.close()
            result[scenario] = {"grad_norms": norms, "errors": dumper.errors}
        elif scenario == "pause":
            train(cfg, info, megatron_opt=True, dumper_cfg=DumpConfig(out=run_dir, **everything), pause_at=3)
    (out / f"result_rank{info.rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
