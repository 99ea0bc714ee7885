"""The classes a MindFormers YAML names with ``auto_register: xf_align.<Class>`` (``--register_path`` this folder).

Why a folder of its own: MindFormers' ``auto_register`` loads ``REGISTER_PATH/<module>.py`` (copying it to
``OM_MODULES_CACHE``) and registers the named class; this thin module re-exports the toolkit's classes from
the xf-align checkout (which must be on ``PYTHONPATH``), so the YAML needs no copied files:

* ``MegatronReplayDataset`` (``train_dataset_task``): replays a Megatron run store / seed layout;
* ``MindFormersDumperCallback`` (``callbacks``): scalars, replayed batches, named local norms, layer statistics;
* ``McoreCPUTrainOneStepCell`` (``runner_wrapper``, CPU only): the CPU stand-ins for the kernels MindSpore
  lacks on CPU, installed on the network the Trainer built, and MindFormers' step with a CPU overflow check;
* ``CPUTrainOneStepCell`` (``runner_wrapper``, CPU only): the same step for the legacy Llama.

Loading it also registers MindFormers' own GRAPH training classes of the mcore models under their names
(``TrainingQwen3ForCausalLM``, ``TrainingQwen3MoeForCausalLM``, ``TrainingDeepseekV3ForCausalLM``), so that a
YAML can name them in ``model_config.architectures``. Why: for ``Qwen3ForCausalLM`` (etc.) MindFormers picks
``PyNative*ForCausalLM`` in PYNATIVE mode, which needs ``hyper_parallel`` (not installable here): ``Qwen3ForCausalLM:
'NoneType' object is not callable``. Named directly, the training class runs the PYNATIVE re-run of steps 1-2
(layer hooks, full tensors) with the very model the GRAPH run compiled. The dataset entry is built before the
network, so its ``auto_register`` loads this module in time.

Example: docs/examples/mindformers_qwen3_tiny_cpu.yaml; docs/mindformers-launch.md.
"""

from __future__ import annotations

from demo.mindformers_cpu import CPUTrainOneStepCell
from demo.mindformers_mcore_cpu import McoreCPUTrainOneStepCell
from dumpers.mindformers import MindFormersDumperCallback
from dumpers.mindformers_replay import MegatronReplayDataset

__all__ = ["CPUTrainOneStepCell", "McoreCPUTrainOneStepCell", "MegatronReplayDataset", "MindFormersDumperCallback",
           "TRAINING_MODELS"]

# module path, class: MindFormers 2.x's GRAPH training classes of its mcore models
TRAINING_MODELS = (("mindformers.models.qwen3.modeling_qwen3_train", "TrainingQwen3ForCausalLM"),
                   ("mindformers.models.qwen3_moe.modeling_qwen3_moe_train", "TrainingQwen3MoeForCausalLM"),
                   ("mindformers.models.deepseek3.modeling_deepseek_v3_train", "TrainingDeepseekV3ForCausalLM"))


def _register_training_models() -> None:
    import importlib

    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

    for module, name in TRAINING_MODELS:
        cls = getattr(importlib.import_module(module), name)
        MindFormerRegister.register_cls(cls, MindFormerModuleType.MODELS, legacy=False)


_register_training_models()
