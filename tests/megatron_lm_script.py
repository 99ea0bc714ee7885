"""A training script shaped like Megatron-LM's pretrain_gpt.py, for the wrapper launch
``python -m dumpers.megatron_lm --align-out DIR --align-module megatron_lm_shape tests/megatron_lm_script.py``:
it knows nothing of the dumper; it builds the model, optimizer and data iterators and calls ``train()``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_lm_shape as shape  # noqa: E402  (the module the wrapper patched)

from demo import megatron_cpu as mc  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[sys.argv.index("--log") + 1])
    mc.init_megatron_cpu(tp=1, seed=1234)
    cfg = mc.TinyLlamaConfig(micro_batch_size=2)
    ddp = [mc.wrap_ddp(c) for c in mc.build_model_chunks(cfg, seed=1234)]
    opt = mc.make_megatron_optimizer(ddp, lr=1e-3, clip_grad=1.0)
    shape.initialize()
    train = iter([mc.synthetic_batch(s, cfg, dp_rank=d) for s in (1, 2, 3) for d in (0, 1)])
    valid = iter([mc.synthetic_batch(100 + s, cfg) for s in range(4)])
    log = shape.train(shape.forward_step, ddp, opt, shape.scheduler(opt), train, valid,
                      SimpleNamespace(seq_len=cfg.seq_length, mbs=cfg.micro_batch_size))
    out.write_text(json.dumps(log))
    mc.destroy_megatron_cpu()
