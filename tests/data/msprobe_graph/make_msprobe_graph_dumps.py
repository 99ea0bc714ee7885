"""Write the real msprobe static-graph (L2, jit_level O0) dumps under tests/data/msprobe_graph/ (CPU).

msprobe (mindstudio-probe 26.2.0) ``PrecisionDebugger`` with ``level: L2`` in MindSpore GRAPH mode: its
KernelKbykDump (msprobe/mindspore/dump/dump_processor/kernel_kbyk_dump.py) writes
``{dump_path}/kernel_kbyk_dump.json`` (net_name "Net", statistic_category max/min/avg/l2norm) and points
MINDSPORE_DUMP_CONFIG at it, so MindSpore writes its kernel dump under ``{dump_path}/rank_R/Net/G/ITER/``.
The network is tests/data/mindspore_dump/make_mindspore_dumps.py's (MindFormers mcore cell names).

    PYTHONPATH=$PWD:MSPROBE python tests/data/msprobe_graph/make_msprobe_graph_dumps.py base       # 2 steps
    PYTHONPATH=$PWD:MSPROBE python tests/data/msprobe_graph/make_msprobe_graph_dumps.py perturbed  # 1 step

(MSPROBE: a folder where mindstudio-probe 26.2.0 and pytz / einops / openpyxl are importable; used here:
the unzipped wheel.) ``data_mode: ["output"]`` keeps the data small; task "tensor" (CPU refuses
"statistics": "storing statistic dump is only supported on GPU and Ascend"). The IR folder graphs/ is dropped.
L0 (cell) static-graph dumps need the TensorDump kernel, which CPU lacks (kernel not registered on CPU).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "mindspore_dump"))


def main(which: str) -> None:
    from make_mindspore_dumps import build
    from msprobe.mindspore import PrecisionDebugger

    out = HERE / which
    tmp = Path(tempfile.mkdtemp())
    cfg = {"task": "tensor", "dump_path": str(tmp / "dump"), "rank": [], "step": [], "level": "L2",
           "tensor": {"scope": [], "list": [], "data_mode": ["output"]}}
    (tmp / "config.json").write_text(json.dumps(cfg))
    debugger = PrecisionDebugger(config_path=str(tmp / "config.json"))
    debugger.start()
    net, x = build(which)
    for _ in range(2 if which == "base" else 1):
        print(which, net(x))
        debugger.step()                  # one msprobe step per training step: MindSpore's iteration += 1
    debugger.stop()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tmp / "dump", out, ignore=shutil.ignore_patterns("graphs"))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "base")
