"""One MindSpore process for tests/test_graph_full_tensors.py: the MindFormers mcore model of a YAML trained in GRAPH
with the kernel-dump capture (dumpers/mindspore_kernel_dump.py), then the same without it.

MindSpore reads MINDSPORE_DUMP_CONFIG once, at the process's first compile: the captured run comes first, in a
process of its own. Usage: python graph_kernel_dump_run.py WORK NAME [--plain] (WORK holds NAME.yaml,
weights.safetensors, batch.npz; the run store goes to WORK/NAME). Without --plain: trained by Model.train with
MindFormersDumperCallback's ``kernel_dump`` option. With --plain: a plain training loop with KernelDumpCapture
(the budget refusal first), then the same training without the capture; results in WORK/NAME.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STEPS = 2
CELLS = ("decoder.layers.?", "decoder.layers.?.input_layernorm", "decoder.layers.?.self_attention",
         "decoder.layers.?.pre_mlp_layernorm", "decoder.layers.?.mlp", "decoder.final_layernorm")


def build(work: Path, name: str):
    import yaml

    import demo.mindformers_mcore_cpu as mc
    from checkpoints.mindformers import read_safetensors

    cfg = yaml.safe_load((work / f"{name}.yaml").read_text())
    mc.set_yaml_context(cfg)
    net = mc.build_yaml_model(cfg)
    mc.install_moe_module_standins()
    mc.install_cpu_standins(net, "graph")
    arrays, _ = read_safetensors(work / "weights.safetensors")
    mc.load_parameter_arrays(net, arrays)
    return net


def train(net, batch: dict[str, np.ndarray], dumper=None) -> list[float]:
    import demo.mindformers_mcore_cpu as mc

    cell = mc.build_mcore_train_cell(net, learning_rate=1e-2)
    losses = []
    for step in range(1, STEPS + 1):
        if dumper is not None:
            dumper.begin_step(step)
        out = cell(*mc.mcore_inputs(batch))
        losses.append(float(out[0].asnumpy().reshape(-1)[0]))
        if dumper is not None:
            dumper.end_step(loss=losses[-1])
    return losses


def train_with_callback(work: Path, name: str, net, batch: dict[str, np.ndarray]) -> None:
    """The YAML way: MindSpore's Model.train with MindFormersDumperCallback(kernel_dump=...), which makes the
    capture in on_train_begin, before the first compile, and finishes it in on_train_end."""
    import mindspore.dataset as ds
    from mindspore.train import Model

    import demo.mindformers_mcore_cpu as mc
    from dumpers.mindformers import MindFormersDumperCallback

    cell = mc.build_mcore_train_cell(net, learning_rate=1e-2)
    row = tuple(t.asnumpy() for t in mc.mcore_inputs(batch))
    data = ds.GeneratorDataset([row] * STEPS, column_names=["input_ids", "labels", "loss_mask"], shuffle=False)
    cb = MindFormersDumperCallback(out_dir=str(work / name), batch_columns=["input_ids", "labels", "loss_mask"],
                                   kernel_dump={"cells": list(CELLS), "steps": [1, 2], "budget_mib": 64})
    Model(cell).train(1, data, callbacks=[cb], dataset_sink_mode=False)


def callback_refusal(work: Path, name: str) -> dict:
    """MindFormersDumperCallback(kernel_dump=...) over its budget, through on_train_begin with MindSpore's own
    RunContext (another net: this one is never trained): a warning, meta.json's note, tensors off, no dump."""
    import warnings

    from mindspore.train.callback import RunContext, _InternalCallbackParam

    from dumpers.mindformers import MindFormersDumperCallback
    from dumpers.mindspore_kernel_dump import ENV

    params = _InternalCallbackParam()
    params.network = build(work, name)
    params.train_network = params.train_dataset = None      # no training cell (never compiled), no dataset
    cb = MindFormersDumperCallback(out_dir=str(work / "refused_cb"),
                                   kernel_dump={"cells": list(CELLS), "steps": [1], "budget_mib": 0.01})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb.on_train_begin(RunContext(params))
    cb.dumper.close()
    meta = json.loads((work / "refused_cb" / "meta.json").read_text())
    return {"warnings": [str(w.message) for w in caught if "kernel_dump" in str(w.message)],
            "layer_capture": meta.get("layer_capture"), "env": os.environ.get(ENV),
            "config_written": (work / "refused_cb" / "kernel_dump_config.json").exists()}


def main(work: Path, name: str, plain: bool) -> None:
    import demo.mindformers_mcore_cpu as mc
    from core.errors import BadInput
    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper
    from dumpers.mindspore_kernel_dump import ENV, CaptureBudgetExceeded, KernelDumpCapture, KernelTapCell

    batch = dict(np.load(work / "batch.npz"))
    said: list[str] = []
    res: dict = {}
    net = build(work, name)
    if not plain:
        train_with_callback(work, name, net, batch)
        return
    try:       # (c) over the budget: one line, nothing wrapped, no dump configured
        KernelDumpCapture(net.model, work / "refused", CELLS, steps=[1], budget_mib=0.01, printer=said.append)
    except CaptureBudgetExceeded as exc:
        res["refused"] = str(exc)
    res["refused_left_env"] = os.environ.get(ENV)
    res["refused_wrapped"] = any(isinstance(c, KernelTapCell) for _, c in net.cells_and_names())
    res["refused_config"] = (work / "refused").exists()
    res["callback_refused"] = callback_refusal(work, name)
    cap = KernelDumpCapture(net.model, work / name, CELLS, steps=[1, 2], budget_mib=64, printer=said.append)
    dumper = MindSporeDumper(net.model, work / name, DumpConfig(tensors="off"), framework="mindformers",
                             name_scheme="mindformers_mcore")
    dumper.update_meta(cap.store_meta())
    res["captured_losses"] = train(net, batch, dumper)
    dumper.close()
    res["measured"] = cap.finish()
    res["estimated"] = cap.estimate
    res["said"] = said
    captured_weights = mc.parameter_arrays(net)
    plain = build(work, name)             # (a) the same run without the capture
    try:          # a capture after a compile: MindSpore has read its dump config already
        KernelDumpCapture(plain.model, work / "late", CELLS, steps=[1], printer=said.append)
    except BadInput as exc:
        res["late"] = str(exc)
    res["plain_losses"] = train(plain, batch)
    plain_weights = mc.parameter_arrays(plain)
    res["weights_equal"] = sorted(captured_weights) == sorted(plain_weights) and all(
        np.array_equal(captured_weights[k], plain_weights[k]) for k in plain_weights)
    (work / f"{name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "--plain" in sys.argv[3:])
