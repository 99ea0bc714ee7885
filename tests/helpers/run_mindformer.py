"""What MindFormers' ``run_mindformer.py`` does for ``--config X.yaml --register_path DIR [--KEY.SUB VALUE ...]``
(train mode, GRAPH or ``--context.mode 1``).

Why: the mindformers wheel does not ship run_mindformer.py (it lives in the source repository), and the
launch tests must start training exactly as users do: REGISTER_PATH set and DIR on sys.path for
``auto_register``, the YAML read by MindFormerConfig, ``--KEY.SUB VALUE`` pairs set into it (parsed by
MindFormers' ``parse_value``), then ``set_output_path``, ``build_context`` and ``Trainer(config).train()``.
No other code runs: every class comes from the YAML. (The real script resolves a relative ``--config`` or
``--register_path`` against its own folder; this one against the working directory: pass absolute paths.
Its ``--mode 1`` switches to ``mindformers.pynative``, which needs hyper_parallel; ``--context.mode 1`` is
the YAML's own PYNATIVE mode.)
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--register_path", default=None)
    args, rest = parser.parse_known_args()
    rest = [part for item in rest for part in item.split("=")]
    if len(rest) % 2:
        raise ValueError("input arg key-values are not in pair, please check input args. ")
    if args.register_path is not None:
        path = os.path.abspath(args.register_path)
        os.environ["REGISTER_PATH"] = path          # read by MindFormerRegister.auto_register
        if path not in sys.path:
            sys.path.append(path)
    from mindformers.core.context import build_context
    from mindformers.tools.register import MindFormerConfig
    from mindformers.tools.utils import parse_value
    from mindformers.trainer import Trainer
    from mindformers.utils.file_utils import set_output_path

    config = MindFormerConfig(os.path.abspath(args.config))
    while rest:
        key, value = rest.pop(0), rest.pop(0)
        if not key.startswith("--"):
            raise ValueError("Custom config key need to start with --.")
        *parents, leaf = key[2:].split(".")
        node = config
        for name in parents:
            if name not in node:
                raise ValueError(f"{name} is not a key of {node}, please check input arg keys. ")
            node = node[name]
        node[leaf] = parse_value(value)
    set_output_path(config.output_dir)
    build_context(config)
    Trainer(config).train()


if __name__ == "__main__":
    main()
