"""The `align report` arguments and the procedure Inputs they make: shared by the CLI and the demo, so the
demo's report is exactly what `align report` gives on the same runs."""

from __future__ import annotations

import argparse

from align.stages import Inputs, Options
from comparators.scalars import ScalarOptions
from comparators.tensor_pair import tolerance
from core.errors import BadInput


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("baseline", metavar="BASELINE",
                   help="the reference run (Megatron-LM): a run store, a log, a TensorBoard folder, golden values "
                        "or a dump (detected)")
    p.add_argument("candidate", metavar="CANDIDATE", help="the run compared with it (MindFormers), any of the same")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for report.html, summary.json, deltas.csv and figures/ (created; an existing file "
                        "is refused)")
    e = p.add_argument_group("more evidence (docs/workflow.md)")
    e.add_argument("--repeat", action="append", default=[], metavar="RUN",
                   help="a repeat of the baseline (same settings, run again without determinism or at another "
                        "TP): the error band and the noise floors (repeatable; default: none, the band is --rtol)")
    e.add_argument("--lr0", nargs=2, metavar=("BASELINE_LR0", "CANDIDATE_LR0"),
                   help="the lr = 0 pair (both runs again at learning rate 0): loss and grad norm must agree at "
                        "every step")
    e.add_argument("--lr0-repeat", action="append", default=[], metavar="RUN",
                   help="the baseline's repeat run again at learning rate 0 over the lr = 0 pair's steps: the noise "
                        "floor of every lr = 0 step (repeatable; default: the --repeat run's own steps)")
    e.add_argument("--baseline-config", metavar="FILE",
                   help="Megatron arguments: a training log, a launch script or JSON (default: the run's meta)")
    e.add_argument("--candidate-config", metavar="FILE", help="the MindFormers YAML (default: the run's meta)")
    e.add_argument("--optimizer-check", metavar="FILE_OR_RUN",
                   help="the candidate's optimizer step on the baseline's step-1 gradients (npz or run store)")
    e.add_argument("--isolation", metavar="FILE_OR_RUN",
                   help="single-module isolation: the candidate's modules on the baseline's inputs (align isolate)")
    e.add_argument("--conversion", metavar="FILE", help="the weight conversion report (convert-weights --json)")
    e.add_argument("--rerun", metavar="RUN",
                   help="the candidate's re-run of its first steps (e.g. PYNATIVE, for layer capture): compared "
                        "with the candidate first; its layer tensors stand in for the candidate's only as far as "
                        "it reproduces the candidate")
    e.add_argument("--baseline-env", metavar="FILE",
                   help="the baseline cluster's environment capture (align capture-env; default: the run's meta)")
    e.add_argument("--candidate-env", metavar="FILE",
                   help="the candidate cluster's environment capture (align capture-env; default: the run's meta)")
    e.add_argument("--mapping", default=None, metavar="PRESET_OR_FILE",
                   help="name mapping preset or YAML file (default: detected: a MindFormers 2.x mcore candidate "
                        "config gets its model's mcore preset, two Megatron runs the preset covering their names, "
                        "else Megatron-core <-> MindFormers Llama; the report names the source)")
    e.add_argument("--vocab-size", type=int,
                   help="data checks: ids must be in [0, vocab) (default: the runs' recorded vocabulary, padded as "
                        "Megatron pads it)")
    e.add_argument("--eos-id", type=int, help="data checks: the EOD token id (default: the runs' recorded data block)")
    e.add_argument("--pad-id", type=int,
                   help="data checks: the padding token id (default: the runs' recorded data block)")
    g = p.add_argument_group("thresholds (README: 'How the verdict is reached')")
    g.add_argument("--step-rtol", type=float, default=5e-3,
                   help="step-1/2 loss relative tolerance (default: %(default)s)")
    g.add_argument("--rtol", type=float, default=1e-2,
                   help="band as a share of |loss| with no repeats (default: %(default)s)")
    g.add_argument("--band-k", type=float, default=3.0,
                   help="band = K x rolling RMS of repeat deltas (default: %(default)s)")
    g.add_argument("--band-window", type=int, default=51,
                   help="rolling window of the band, in steps (default: %(default)s)")
    g.add_argument("--band-floor", type=float, default=0.0, help="smallest band, absolute (default: %(default)s)")
    g.add_argument("--band-floor-ulps", type=float, default=8.0,
                   help="smallest band in float32 ulps (units in the last place) of the largest baseline value: "
                        "rounding, not training (default: %(default)s)")
    g.add_argument("--max-outside", type=float, default=0.05,
                   help="allowed share of steps outside the band (default: %(default)s)")
    g.add_argument("--max-bias", type=float, default=0.5,
                   help="allowed |mean delta| / std(delta) (default: %(default)s)")
    g.add_argument("--fail-rate", type=float, default=1e-3,
                   help="with a repeat: the false-alarm rate a clean pair fails a long-run test at (default: "
                        "%(default)s)")
    g.add_argument("--warn-rate", type=float, default=1e-2,
                   help="with a repeat: the false-alarm rate a clean pair is warned at (default: %(default)s)")
    g.add_argument("--noise-allowance", type=float, default=2.0,
                   help="with a repeat: how much noisier than the baseline's repeat a clean candidate may be (the "
                        "repeat shares the baseline's framework and kernels; 0.13-2.8x, median ~1, on 41 clean demo "
                        "pairs, docs/calibration.md); the long-run count tests hold their rates for a candidate "
                        "this much noisier (default: %(default)s)")
    g.add_argument("--sustain", type=int, default=10,
                   help="consecutive out-of-band steps that make a divergence (default: %(default)s)")
    g.add_argument("--tail", type=float, default=0.2,
                   help="share of final steps checked for a late gap (default: %(default)s)")
    g.add_argument("--dtype",
                   help="precision the runs computed in: float32, bfloat16, float16 (default: read from the runs' "
                        "meta.json and the candidate's YAML, else float32)")
    g.add_argument("--layer-tolerance", action="append", default=[], metavar="DTYPE=PASS,WARN[,COS]",
                   help="layer tensors: relative error passing / warning up to, cosine passing from, per dtype "
                        "(e.g. float32=1e-5,1e-4,0.999999 for two runs on the same hardware; repeatable; default "
                        "by dtype, float32 1e-4,1e-2,0.99999)")
    g.add_argument("--local-norm-rtol", default=None, metavar="PASS,WARN",
                   help="step-1 local norms: relative difference passing / warning up to (default by dtype, "
                        "float32 1e-4,1e-2)")
    g.add_argument("--lr0-rtol", default=None, metavar="PASS,WARN",
                   help="lr=0 pair: relative loss / grad-norm difference passing / warning up to (default by "
                        "dtype, float32 1e-5,1e-4)")
    x = p.add_argument_group("speed (layer tensors)")
    x.add_argument("--jobs", type=int, default=None, metavar="N", help="parallel tensor readers (default: 2 threads)")
    x.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="a Dask scheduler (tcp://HOST:8786): the layer-tensor compare fans out to its workers "
                        "(needs the 'dask' extra; default: none, local readers)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warn too (for CI gates; default: warn exits 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr (default: progress on)")


def _layer_tolerance(items: list[str]) -> dict[str, tuple[float, float, float]]:
    out = {}
    for item in items:
        dtype, _, vals = item.partition("=")
        try:
            nums = [float(v) for v in vals.split(",")]
            if len(nums) not in (2, 3) or not dtype:
                raise ValueError
        except ValueError:
            raise BadInput(f"--layer-tolerance {item}: expected DTYPE=PASS,WARN[,COS]") from None
        out[dtype] = (nums[0], nums[1], nums[2] if len(nums) == 3 else tolerance(dtype)[2])
    return out


def _pair(value: str | None, flag: str) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        a, b = (float(v) for v in value.split(","))
    except ValueError:
        raise BadInput(f"{flag} {value}: expected PASS,WARN (two numbers)") from None
    if not 0 <= a <= b:
        raise BadInput(f"{flag} {value}: expected 0 <= PASS <= WARN")
    return a, b


def report_inputs(args: argparse.Namespace) -> Inputs:
    """The procedure's Inputs from `align report` arguments (also how the demo states its own command)."""
    opt = ScalarOptions(step_rtol=args.step_rtol, rtol=args.rtol, band_k=args.band_k,
                        band_window=args.band_window, band_floor=args.band_floor,
                        band_floor_ulps=args.band_floor_ulps,
                        max_outside=args.max_outside, max_bias=args.max_bias, sustain=args.sustain,
                        tail=args.tail, fail_rate=getattr(args, "fail_rate", 1e-3),
                        warn_rate=getattr(args, "warn_rate", 1e-2),
                        noise_allowance=getattr(args, "noise_allowance", 2.0))
    options = Options(scalar=opt, layer_tolerance=_layer_tolerance(args.layer_tolerance), dtype=args.dtype,
                      vocab_size=args.vocab_size, eos_id=args.eos_id, pad_id=args.pad_id, jobs=args.jobs,
                      scheduler=args.scheduler,
                      local_norm_rtol=_pair(getattr(args, "local_norm_rtol", None), "--local-norm-rtol"),
                      lr0_rtol=_pair(getattr(args, "lr0_rtol", None), "--lr0-rtol"))
    return Inputs(args.baseline, args.candidate, repeats=args.repeat, lr0=tuple(args.lr0) if args.lr0 else None,
                  baseline_config=args.baseline_config, candidate_config=args.candidate_config,
                  optimizer_check=args.optimizer_check, conversion=args.conversion, mapping=args.mapping,
                  rerun=getattr(args, "rerun", None), baseline_env=getattr(args, "baseline_env", None),
                  candidate_env=getattr(args, "candidate_env", None),
                  isolation=getattr(args, "isolation", None), lr0_repeats=getattr(args, "lr0_repeat", []),
                  options=options)


def parse_report_args(argv: list[str]) -> argparse.Namespace:
    """`align report` arguments from a list (the demo states its report as this very command line)."""
    p = argparse.ArgumentParser(prog="align report")
    add_report_arguments(p)
    return p.parse_args(argv)
