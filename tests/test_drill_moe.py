"""`align drill` on the demo's MoE (Qwen3-MoE: router + routed experts) and MLA (DeepSeek-V3 attention) models:
a conversion fault in one weight (two rows swapped) is named at the operator that reads it.

Faults only (the clean MoE MLP and MLA attention name nothing: measured by hand, docs/commands.md), to keep the
suite short. Each drill's time is printed (`pytest -s`); nothing asserts on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest


def _pair(root: Path, kind: str, module: str, weight: str) -> tuple[Path, Path, Path]:
    """(baseline store with the capture and operator trace of ``module``, candidate YAML, candidate weights with
    rows 0 and 1 of ``weight`` swapped)."""
    import torch
    import yaml

    from checkpoints.mindformers import write_safetensors
    from demo import megatron_cpu as mg
    from demo.model import MCORE_PRESETS, demo_model, for_kind, megatron_config_kwargs
    from demo.spec import Spec, mindformers_config
    from dumpers.megatron import MegatronDumper
    from dumpers.torch_dumper import DumpConfig
    from dumpers.torch_module_backward import ModuleBackwardCapture
    from dumpers.torch_op_trace import trace_modules
    from mapping import TransformParams
    from models import load_mapping

    spec = replace(for_kind(demo_model(), kind), num_layers=1)
    mg.init_megatron_cpu(tp=1)
    cfg = mg.TinyLlamaConfig(**megatron_config_kwargs(spec))
    model = mg.build_tiny_llama(cfg, seed=11)
    store = root / f"baseline_{kind}"
    dumper = MegatronDumper(model, None, DumpConfig(out=store, tensor_steps=[1], local_norms=False))
    cap = ModuleBackwardCapture(model, store, [module], steps=[1])
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    batch = mg.synthetic_batch(1, cfg)
    dumper.begin_step(1)
    cap.begin_step(1)
    dumper.record_batch(batch)
    loss = mg.forward_loss(model, batch)
    loss.backward()
    cap.end_step()
    cap.close()
    dumper.end_step(loss=float(loss))
    dumper.close()
    trace_modules(model, store, 1)
    c = mindformers_config(Spec(role="candidate", out=str(root / "unused"), steps=1, model=spec, model_kind=kind))
    (root / f"{kind}.yaml").write_text(yaml.safe_dump(c))
    m = load_mapping(MCORE_PRESETS[kind])
    groups = spec.num_attention_heads if kind == "mla" else spec.num_query_groups
    conv, _ = m.convert({k: v for k, v in weights.items() if not m.ignored(k, "baseline")}, "candidate",
                        TransformParams(num_heads=spec.num_attention_heads, num_query_groups=groups))
    w = np.array(conv[weight])
    w[[0, 1]] = w[[1, 0]]
    conv[weight] = w
    write_safetensors(conv, root / f"{kind}.safetensors")
    return store, root / f"{kind}.yaml", root / f"{kind}.safetensors"


@pytest.mark.parametrize(("kind", "module", "weight"), [
    ("moe", "decoder.layers.0.mlp", "decoder.layers.0.mlp.router.weight"),
    ("mla", "decoder.layers.0.self_attention", "decoder.layers.0.self_attention.linear_kv_up_proj.weight"),
])
def test_a_swapped_weight_row_is_named_at_the_matmul_that_reads_it(kind: str, module: str, weight: str,
                                                                   tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from align.cli import main

    store, yaml_path, ckpt = _pair(tmp_path, kind, module, weight)
    t0 = time.perf_counter()
    rc = main(["drill", str(store), "--module", module, "--candidate-yaml", str(yaml_path), "--candidate-ckpt",
               str(ckpt), "--out", str(tmp_path / "drill")])
    res = json.loads((tmp_path / "drill" / "drill.json").read_text())
    print(f"drill {kind} {module}: exit {rc} in {time.perf_counter() - t0:.1f} s "
          f"{[(n['op'], n['why'][:40]) for n in res['named']]}")
    assert rc == 1 and res["verdict"] == "fail"
    first = res["named"][0]
    assert first["kind"] == "MatMul" and first["phase"] == "forward" and "another order" in first["why"]
    assert first["own_verdict"] == "pass"          # the operator computes right: what it reads is wrong
