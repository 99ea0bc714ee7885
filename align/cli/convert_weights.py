"""`align convert-weights`: Megatron-core <-> MindFormers checkpoints through the mapping."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from core.errors import BadInput

HELP = "Megatron-core <-> MindFormers checkpoint conversion"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align convert-weights --to mindformers IN.pt [IN_tp1.pt ...] --out OUT.ckpt --num-heads N ...`."""
    parser.add_argument("inputs", nargs="+", help="Megatron state_dict .pt (one per TP rank, in rank order), "
                        "a Megatron checkpoint folder (torch_dist or mp_rank_* files), or one MindFormers "
                        ".safetensors (mcore) / .ckpt (legacy Llama)")
    parser.add_argument("--to", choices=["mindformers", "megatron"], required=True,
                        help="the framework to write for")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the converted checkpoint: .safetensors, .ckpt (a MindSpore checkpoint) or .pt (to "
                        "megatron); the suffix picks the file format, the tensor names the preset (--mapping)")
    parser.add_argument("--num-heads", type=int, required=True, help="attention heads (to split / fuse QKV)")
    parser.add_argument("--num-query-groups", type=int, help="GQA groups (default: MHA, = heads)")
    parser.add_argument("--mapping",
                        help="preset name or YAML mapping file (default: the preset the checkpoint's tensor names "
                             "need: mcore dense, MoE (a router, experts), MLA (linear_q_down_proj ...) or the legacy "
                             "Llama (model.layers.N.attention.wq ...); a dense Megatron checkpoint's names fit both "
                             "mcore dense and the legacy Llama: .safetensors then means mcore, .ckpt the legacy "
                             "Llama)")
    parser.add_argument("--num-experts", type=int,
                        help="routed experts per MoE layer (to megatron, MoE presets; default: the experts whose "
                             "names appear)")
    parser.add_argument("--scheme", choices=["local", "te", "local+grouped", "te+grouped"], default="local",
                        help="Megatron names to write (to megatron): local/te norms, +grouped for TE grouped "
                        "GEMM experts (default: %(default)s)")
    parser.add_argument("--size", action="append", default=[], metavar="NAME=N",
                        help="a named size a fused tensor splits back by (to megatron), e.g. q_down=1536 "
                        "(q_lora_rank) for megatron_core__mindformers_mcore_mla_qkv_concat (repeatable; default: none)")
    parser.add_argument("--json", action="store_true",
                        help="print the conversion report as JSON (for align report --conversion; default: one line)")


def parse_sizes(items: Sequence[str]) -> dict[str, int]:
    """``["q_down=1536", ...]`` -> ``{"q_down": 1536}``; a malformed item is bad input."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) <= 0:
            raise BadInput(f"--size {item!r}: expected NAME=N with a positive integer N")
        out[name.strip()] = int(value)
    return out


def run(args: argparse.Namespace) -> int:
    from checkpoints.convert import (
        check_model_params,
        check_out_path,
        convert_megatron_to_mindformers,
        convert_mindformers_to_megatron,
    )

    # command-line mistakes are refused before any file is read (exit 2, one line)
    from core.outputs import check_out_file
    from runstore.schema import regular_file

    check_out_path(args.out)
    check_out_file(args.out, "--out")     # and a dangling symlink, an unwritable folder
    check_model_params(args.num_heads, args.num_query_groups, args.num_experts)
    for p in args.inputs:
        folder = args.to == "mindformers" and len(args.inputs) == 1 and Path(p).is_dir()
        if not folder:
            regular_file(p, "file")       # missing, a folder, or a FIFO / device (which would block or never end)
    if args.to == "mindformers":
        res = convert_megatron_to_mindformers(args.inputs, args.out, num_heads=args.num_heads,
                                              num_query_groups=args.num_query_groups, mapping=args.mapping,
                                              num_experts=args.num_experts)
    else:
        if len(args.inputs) != 1:
            raise BadInput("converting to Megatron takes exactly one MindSpore checkpoint")
        res = convert_mindformers_to_megatron(args.inputs[0], args.out, num_heads=args.num_heads,
                                              num_query_groups=args.num_query_groups, mapping=args.mapping,
                                              scheme=args.scheme, num_experts=args.num_experts,
                                              sizes=parse_sizes(getattr(args, "size", None) or []))
    if args.json:
        print(json.dumps({"verdict": res.verdict, **res.details, "findings": [f.to_json() for f in res.findings]},
                         indent=2))
    elif res.verdict == "fail":
        # one line: what is missing or wrong (the first problem, and how many more); nothing was written
        fails = [f for f in res.findings if f.verdict == "fail"]
        more = f" (and {len(fails) - 1} more problems; --json lists them)" if len(fails) > 1 else ""
        first = fails[0].message if fails else "conversion failed"
        if not any(str(i) in first for i in args.inputs):   # mapping findings name tensors, not the file
            first = f"{', '.join(args.inputs)}: {first}"
        print(f"FAIL {first}{more}; nothing written to {res.details['out']}")
    else:
        for f in res.findings:
            print(f"{f.verdict.upper():4} {f.message}")
        via = f" (preset {res.details['mapping']})" if res.details.get("mapping") and not args.mapping else ""
        print(f"wrote {res.details['tensors']} tensors to {res.details['out']}{via} ({res.verdict})")
    return 1 if res.verdict == "fail" else 0
