"""The setup the isolation and repro tests share: a tiny Megatron-core baseline's step 1 (its run store, and
its module backward capture), the MindFormers mcore candidate's YAML and step-1 weights, and `align isolate`
run with a fault planted in the model it builds.

Why one place: tests/test_isolation.py, test_isolation_backward.py, test_isolation_faults.py and
test_repro.py each built the same baseline and candidate files by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np


def megatron_baseline(store: Path, *, num_layers: int = 2, seed: int = 11, modules: Sequence[str] = (),
                      meta: dict[str, Any] | None = None, full_modules: Sequence[str] | None = None,
                      backward: bool = True) -> tuple[Path, dict[str, np.ndarray], Any]:
    """(store, weights, model spec) of the demo's dense Megatron-core model's step 1: the batch in the run store;
    ``full_modules``: full forward tensors of those modules (forward only, no backward, when ``backward`` is
    False); ``modules``: the module backward capture of those (``loss`` included: the loss function)."""
    import torch

    from demo import megatron_cpu as mg
    from demo.model import demo_model, megatron_config_kwargs
    from dumpers.megatron import MegatronDumper
    from dumpers.torch_dumper import DumpConfig
    from dumpers.torch_module_backward import ModuleBackwardCapture

    spec = replace(demo_model(), num_layers=num_layers)
    mg.init_megatron_cpu(tp=1)
    cfg = mg.TinyLlamaConfig(**megatron_config_kwargs(spec))
    model = mg.build_tiny_llama(cfg, seed=seed)
    extra: dict[str, Any] = {"meta": meta} if meta else {}
    if full_modules is not None:
        extra.update(tensors="full", modules=list(full_modules), backward=backward)
    dumper = MegatronDumper(model, None, DumpConfig(out=store, tensor_steps=[1], local_norms=False, **extra))
    cap = ModuleBackwardCapture(model, store, list(modules), steps=[1]) if modules else None
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    batch = mg.synthetic_batch(1, cfg)
    dumper.begin_step(1)
    if cap is not None:
        cap.begin_step(1)
    dumper.record_batch(batch)
    if backward:
        loss = mg.forward_loss(model, batch)
        loss.backward()
    else:
        with torch.no_grad():
            loss = mg.forward_loss(model, batch)
    if cap is not None:
        assert cap.end_step() is not None
        cap.close()
    dumper.end_step(loss=float(loss))
    dumper.close()
    assert dumper.errors == 0
    return store, weights, spec


def candidate_files(folder: Path, spec: Any, weights: dict[str, np.ndarray], *,
                    yaml_edit: Callable[[dict[str, Any]], None] | None = None,
                    weights_edit: Callable[[dict[str, np.ndarray]], None] | None = None) -> tuple[Path, Path]:
    """(YAML, step-1 safetensors) of the MindFormers mcore candidate of ``spec``: the baseline's weights
    converted by the dense preset; ``yaml_edit`` / ``weights_edit`` plant a setting or a conversion fault."""
    import yaml

    from checkpoints.mindformers import write_safetensors
    from demo.model import MCORE_PRESETS
    from demo.spec import Spec, mindformers_config
    from mapping import TransformParams
    from models import load_mapping

    cfg = mindformers_config(Spec(role="candidate", out=str(folder / "unused"), steps=1, model=spec))
    if yaml_edit is not None:
        yaml_edit(cfg)
    (folder / "candidate.yaml").write_text(yaml.safe_dump(cfg))
    conv, _ = load_mapping(MCORE_PRESETS["dense"]).convert(weights, "candidate", TransformParams(
        num_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups))
    if weights_edit is not None:
        weights_edit(conv)
    write_safetensors(conv, folder / "step1.safetensors")
    return folder / "candidate.yaml", folder / "step1.safetensors"


def run_isolate(store: Path, yaml_path: Path, ckpt: Path, out: Path, *extra: str,
                plant: Callable[[Any], None] | None = None) -> int:
    """`align isolate` on the candidate files, ``plant(net)`` applied to the model it builds (a demo fault in
    the candidate's own code); the process's MindSpore / MindFormers context is left as other tests expect."""
    import demo.mindformers_mcore_cpu as mc
    from align.cli import main

    build = mc.build_pynative_model
    if plant is not None:
        def build_with_fault(c: Any) -> Any:
            net = build(c)
            plant(net)
            return net
        mc.build_pynative_model = build_with_fault
    try:
        return main(["isolate", str(store), "--candidate-yaml", str(yaml_path), "--candidate-ckpt", str(ckpt),
                     "--out", str(out), *extra])
    finally:
        mc.build_pynative_model = build
        mc.set_mcore_context("graph")
        mc.reset_mindformers_context()


def run_repro_script(script: Path) -> dict[str, float]:
    """Run a repro script in a fresh process, outside this project (no PYTHONPATH, another folder); the
    rel_l2 of each printed line, keyed '<what> | <against what>'."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-P", str(script)], cwd=script.parent.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = {}
    for line in done.stdout.splitlines():
        m = re.match(r"(\S+(?: \S+)?)\s+vs (.+?)\s+rel_l2=(\S+)", line)
        if m:
            out[f"{m.group(1)} | {m.group(2)}"] = float(m.group(3))
    return out
