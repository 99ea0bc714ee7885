"""Make the msprobe dump fixtures with the real msprobe (mindstudio-probe 26.2.0), PyTorch and MindSpore.

Run in benchmarks/.venv-msprobe (benchmarks/msprobe_env.sh, plus `pip install mindspore==2.10.0` there):

    benchmarks/.venv-msprobe/bin/python tests/data/msprobe/make_msprobe_dumps.py OUT_DIR [pt|ms|both]

The committed fixtures: OUT_DIR = tests/data/msprobe (task tensor) and, with MSPROBE_TASK=statistics,
OUT_DIR = tests/data/msprobe/statistics (dump.json only).

pt: a real Megatron-core GPTModel (tiny Llama, CPU) runs one forward + backward under msprobe's
PrecisionDebugger (task tensor, level L0, every module) -> OUT_DIR/pt/step0/rank/{dump.json,
dump_tensor_data/*.pt}. ms: the same weights converted to MindFormers (align.convert_weights), a real
MindFormers LlamaForCausalLM (PYNATIVE, CPU) runs one forward + backward on the same batch under msprobe's
MindSpore PrecisionDebugger -> OUT_DIR/ms/step0/rank/{dump.json, dump_tensor_data/*.npy}, with one weight
perturbed (PERTURBED x (1 + 1e-3 N(0,1))): the compare must name layer 1.
mindformers is taken from the product's venv ($PRODUCT_VENV, default .venv; appended to sys.path: msprobe's
venv has no mindformers).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
CFG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=64, seq_length=8, micro_batch_size=2)


TASK = os.environ.get("MSPROBE_TASK", "tensor")    # "statistics": dump.json only (Max/Min/Mean/Norm)


def _config(out: Path, task: str | None = None) -> Path:
    task = task or TASK
    cfg = {"task": task, "dump_path": str(out), "rank": [], "step": [], "level": "L0", "async_dump": False,
           task: {"scope": [], "list": [], "data_mode": ["all"]}}
    p = out.with_suffix(".config.json")
    p.write_text(json.dumps(cfg))
    return p


def make_pt(out: Path) -> None:
    import torch
    from msprobe.pytorch import PrecisionDebugger

    from demo import megatron_cpu as mc

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    mc.init_megatron_cpu(tp=1, seed=1234)
    cfg = mc.TinyLlamaConfig(**CFG)
    model = mc.build_tiny_llama(cfg, seed=1234)
    cfg_path = _config(out)
    dbg = PrecisionDebugger(config_path=str(cfg_path))
    batch = mc.synthetic_batch(1, cfg)
    dbg.start(model=model)
    loss = mc.forward_loss(model, batch)
    loss.backward()
    dbg.stop()
    dbg.step()
    cfg_path.unlink()
    torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
               out.parent / "megatron_weights.pt")
    print("pt loss", float(loss))


PERTURBED = "model.layers.1.feed_forward.w2.weight"


def make_ms(out: Path) -> None:
    import mindspore as ms
    import numpy as np
    from msprobe.core.dump.data_dump.data_processor import mindspore_processor
    from msprobe.mindspore import PrecisionDebugger

    class MintWithoutNorm:
        """msprobe's statistics call mint.norm (LinalgVectorNorm has no CPU kernel in MindSpore 2.10); without
        the attribute msprobe itself falls back to ops.norm. Nothing else of msprobe is changed."""

        def __getattr__(self, name: str):  # noqa: ANN204
            if name == "norm":
                raise AttributeError(name)
            return getattr(ms.mint, name)

    mindspore_processor.mint = MintWithoutNorm()

    from align.convert_weights import convert_megatron_to_mindformers

    from demo import mindformers_cpu as mc

    warnings.simplefilter("ignore")
    mc.set_cpu_context("pynative", seed=1234)
    ckpt = out.parent / "mindformers_weights.ckpt"
    convert_megatron_to_mindformers([out.parent / "megatron_weights.pt"], ckpt, num_heads=CFG["num_attention_heads"],
                                    num_query_groups=CFG["num_query_groups"])

    class Like:          # the Megatron config, for overrides_like_megatron (duck-typed)
        extra: dict = {}

    like = Like()
    for k, v in CFG.items():
        setattr(like, k, v)
    net = mc.build_tiny_llama(seed=1234, **mc.overrides_like_megatron(like))
    params = ms.load_checkpoint(str(ckpt))
    w = params[PERTURBED].asnumpy()
    rng = np.random.default_rng(7)
    params[PERTURBED] = ms.Parameter(ms.Tensor(w * (1 + 1e-3 * rng.standard_normal(w.shape)).astype(np.float32)),
                                     name=PERTURBED)
    ms.load_param_into_net(net, params, strict_load=True)
    ckpt.unlink()
    from demo.megatron_cpu import TinyLlamaConfig, synthetic_batch  # the batch Megatron saw

    batch = {k: v.numpy() for k, v in synthetic_batch(1, TinyLlamaConfig(**CFG)).items()}
    loss_cell = mc.LlamaReplayLoss(net)
    grad_fn = ms.value_and_grad(loss_cell, None, net.trainable_params())
    cfg_path = _config(out)
    dbg = PrecisionDebugger(config_path=str(cfg_path))
    dbg.start(model=net)
    loss, _ = grad_fn(ms.Tensor(batch["tokens"].astype(np.int32)), ms.Tensor(batch["labels"].astype(np.int32)),
                      ms.Tensor(batch["loss_mask"]))
    dbg.stop()
    dbg.step()
    cfg_path.unlink()
    print("ms loss", float(loss.asnumpy()))


def prune(out: Path) -> None:
    """Keep the fixture small and free of this machine's paths: drop the tensor files of parameters and
    parameter gradients (the comparator reads module inputs/outputs and their gradients only) and stack.json
    (call stacks with file paths); dump.json keeps every entry, its absolute dump_data_dir made relative."""
    for dump_json in out.rglob("dump.json"):
        folder = dump_json.parent
        doc = json.loads(dump_json.read_text())
        if doc.get("dump_data_dir"):
            doc["dump_data_dir"] = "dump_tensor_data"
        dump_json.write_text(json.dumps(doc, indent=1))
        for f in (folder / "dump_tensor_data").glob("*"):
            if ".parameters_grad." in f.name or ".parameters." in f.name or ".forward.0.parameters" in f.name:
                f.unlink()
        (folder / "stack.json").unlink(missing_ok=True)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    which = sys.argv[2] if len(sys.argv) > 2 else "both"
    if which in ("pt", "both"):
        shutil.rmtree(out / "pt", ignore_errors=True)
        (out / "pt").mkdir(parents=True)
        make_pt(out / "pt")
    if which in ("ms", "both"):
        venv = Path(os.environ.get("PRODUCT_VENV", ROOT / ".venv"))
        sys.path += [str(p) for p in venv.glob("lib/python3*/site-packages")]
        shutil.rmtree(out / "ms", ignore_errors=True)
        (out / "ms").mkdir(parents=True)
        make_ms(out / "ms")
    for side in ("pt", "ms"):
        if (out / side).is_dir():
            prune(out / side)
    (out / "megatron_weights.pt").unlink(missing_ok=True)
