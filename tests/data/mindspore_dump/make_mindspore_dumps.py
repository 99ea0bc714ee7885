"""Write the real MindSpore GRAPH-mode dumps under tests/data/mindspore_dump/ (MindSpore 2.10, CPU).

MindSpore's own dump (MINDSPORE_DUMP_CONFIG set before ``import mindspore``; tutorials "Using Dump in the
Graph Mode", CPU/GPU section) of a tiny network whose cells carry MindFormers mcore names (= Megatron's):
``network`` (a loss wrapper) -> ``model`` (class GPTModel) -> ``decoder.layers.{0,1}.{input_layernorm,
self_attention.linear_proj, pre_mlp_layernorm, mlp.linear_fc2}``, ``decoder.final_layernorm``. Ops are
per-cell primitive instances (as MindFormers writes them), so each kernel carries its own cell's scope.

    python tests/data/mindspore_dump/make_mindspore_dumps.py base       # 2 iterations -> base/
    python tests/data/mindspore_dump/make_mindspore_dumps.py perturbed  # layer 1 linear_fc2 weight + 1e-3

base saves inputs and outputs (input_output 0), perturbed outputs only (2); the graphs/ folder (IR) is
not kept. One process per dump: the config is read once, at import. saved_data "tensor" is the only mode CPU runs
("statistic" / "full": RuntimeError "storing statistic dump is only supported on GPU and Ascend").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(which: str):
    """(net, x): the tiny mcore-named network and its input; ``perturbed``: layer 1's linear_fc2 weight + 1e-3.
    Import after MINDSPORE_DUMP_CONFIG is set (MindSpore reads it at import)."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    h = 8

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.tanh = ops.Tanh()
            self.linear_proj = nn.Dense(h, h)

        def construct(self, x):
            return self.linear_proj(self.tanh(x))

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.relu = ops.ReLU()
            self.linear_fc2 = nn.Dense(h, h)

        def construct(self, x):
            return self.linear_fc2(self.relu(x))

    class TransformerLayer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.input_layernorm = nn.LayerNorm((h,))
            self.self_attention = Attention()
            self.pre_mlp_layernorm = nn.LayerNorm((h,))
            self.mlp = MLP()
            self.add1, self.add2 = ops.Add(), ops.Add()

        def construct(self, x):
            x = self.add1(x, self.self_attention(self.input_layernorm(x)))
            return self.add2(x, self.mlp(self.pre_mlp_layernorm(x)))

    class TransformerBlock(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([TransformerLayer(), TransformerLayer()])
            self.final_layernorm = nn.LayerNorm((h,))

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.final_layernorm(x)

    class GPTModel(nn.Cell):
        def __init__(self):
            super().__init__()
            self.decoder = TransformerBlock()

        def construct(self, x):
            return self.decoder(x)

    class CausalLM(nn.Cell):
        def __init__(self):
            super().__init__()
            self.model = GPTModel()

        def construct(self, x):
            return self.model(x)

    class LossCell(nn.Cell):
        def __init__(self):
            super().__init__()
            self.network = CausalLM()
            self.square, self.mean = ops.Square(), ops.ReduceMean()

        def construct(self, x):
            return self.mean(self.square(self.network(x)))

    ms.set_seed(0)
    net = LossCell()
    rng = np.random.RandomState(0)
    for p in net.get_parameters():
        p.set_data(ms.Tensor(rng.randn(*p.shape).astype(np.float32) * 0.5 + (1.0 if "gamma" in p.name else 0.0)))
    if which == "perturbed":
        w = net.network.model.decoder.layers[1].mlp.linear_fc2.weight
        w.set_data(w + ms.Tensor(np.full(w.shape, 1e-3, np.float32)))
    x = ms.Tensor(rng.randn(2, 4, h).astype(np.float32))
    return net, x


def main(which: str) -> None:
    out = HERE / which
    tmp = Path(tempfile.mkdtemp())
    cfg = {"common_dump_settings": {"dump_mode": 0, "path": str(tmp / "dump"), "net_name": "Net",
                                    "iteration": "all" if which == "base" else "0", "saved_data": "tensor",
                                    "input_output": 0 if which == "base" else 2, "kernels": [],
                                    "support_device": [0, 1, 2, 3, 4, 5, 6, 7]},
           "e2e_dump_settings": {"enable": True, "trans_flag": True}}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    os.environ["MINDSPORE_DUMP_CONFIG"] = str(tmp / "cfg.json")
    net, x = build(which)
    for _ in range(2 if which == "base" else 1):
        print(which, net(x))
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tmp / "dump", out, ignore=shutil.ignore_patterns("graphs"))  # IR files: 185 KB, unread
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "base")
