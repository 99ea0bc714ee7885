"""What MindFormers' ``run_mindformer.py`` does for ``--config X.yaml --register_path DIR`` (train mode).

Why: the mindformers wheel does not ship run_mindformer.py (it lives in the source repository), and the
launch test must start training exactly as users do: REGISTER_PATH set and DIR on sys.path for
``auto_register``, the YAML read by MindFormerConfig, then ``set_output_path``, ``build_context`` and
``Trainer(config).train()``. No other code runs: every class comes from the YAML.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--register_path", default=None)
    args = parser.parse_args()
    if args.register_path is not None:
        path = os.path.abspath(args.register_path)
        os.environ["REGISTER_PATH"] = path          # read by MindFormerRegister.auto_register
        if path not in sys.path:
            sys.path.append(path)
    from mindformers.core.context import build_context
    from mindformers.tools.register import MindFormerConfig
    from mindformers.trainer import Trainer
    from mindformers.utils.file_utils import set_output_path

    config = MindFormerConfig(os.path.abspath(args.config))
    set_output_path(config.output_dir)
    build_context(config)
    Trainer(config).train()


if __name__ == "__main__":
    main()
