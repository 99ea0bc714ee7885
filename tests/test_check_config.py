"""check-config: a Megatron-LM arguments block (exact _print_args format) and a MindFormers Llama YAML
(real keys) with three planted mismatches: exactly those are found, and nothing else."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from align.checks import config as cc
from align.cli import check_config
from core.errors import BadInput
from sources.configs import parse_arguments_block, read_megatron

# A subset of a real Llama-2-7B-style Megatron-LM run's arguments (names as in megatron/training/arguments.py).
MEGATRON_ARGS = {
    "accumulate_allreduce_grads_in_fp32": True, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-08,
    "add_bias_linear": False, "add_position_embedding": False, "apply_wd_to_qk_layernorm": False,
    "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bf16": True, "clip_grad": 1.0,
    "context_parallel_size": 1, "data_parallel_size": 8, "expert_model_parallel_size": 1, "ffn_hidden_size": 11008,
    "fp16": False, "global_batch_size": 64, "group_query_attention": False, "hidden_dropout": 0.0,
    "hidden_size": 4096, "init_method_std": 0.02, "kv_channels": 128, "lr": 0.0003, "lr_decay_iters": 1000,
    "lr_decay_style": "cosine", "lr_warmup_fraction": None, "lr_warmup_iters": 30,
    "make_vocab_size_divisible_by": 128, "max_position_embeddings": 4096, "micro_batch_size": 1,
    "min_lr": 3e-05, "moe_aux_loss_coeff": 0.0, "moe_expert_capacity_factor": None, "moe_router_topk": 2,
    "normalization": "RMSNorm", "norm_epsilon": 1e-05, "num_attention_heads": 32, "num_experts": None,
    "num_layers": 32, "num_query_groups": 1, "optimizer": "adam", "padded_vocab_size": 32000,
    "params_dtype": "torch.bfloat16", "pipeline_model_parallel_size": 1, "position_embedding_type": "rope",
    "rotary_base": 10000, "seed": 1234, "seq_length": 4096, "sequence_parallel": False, "swiglu": True,
    "tensor_model_parallel_size": 1, "train_iters": 1000, "untie_embeddings_and_output_weights": True,
    "use_distributed_optimizer": False, "vocab_size": 32000, "weight_decay": 0.1,
    "tokenizer_type": "Llama2Tokenizer", "a_very_long_argument_name_to_exercise_no_dots_at_all": 3,
}


def megatron_log(args: dict) -> str:
    """The exact layout of Megatron-LM's _print_args (title 'arguments'), inside other log lines."""
    lines = ["using world size: 8, data-parallel size: 8, context-parallel size: 1",
             "------------------------ arguments ------------------------"]
    body = []
    for k, v in args.items():
        v = "torch.bfloat16" if v == "torch.bfloat16" else v
        body.append("  {} {} {}".format(k, "." * (48 - len(k)), v))
    lines += sorted(body, key=lambda x: x.lower())
    lines += ["-------------------- end of arguments ---------------------", "setting number of micro-batches"]
    return "\n".join(lines) + "\n"


MF_YAML = {
    "seed": 1234, "output_dir": "./output", "run_mode": "train",
    "runner_config": {"epochs": 1, "batch_size": 1, "sink_mode": True, "sink_size": 1,
                      "gradient_accumulation_steps": 8},
    "runner_wrapper": {"type": "MFTrainOneStepCell", "use_clip_grad": True, "max_grad_norm": 1.0,
                       "scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536}},
    "optimizer": {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1},
    "lr_schedule": {"type": "CosineWithWarmUpLR", "learning_rate": 3.0e-4, "lr_end": 3.0e-5,
                    "warmup_steps": 30, "total_steps": 1000},
    "parallel": {"parallel_mode": 1, "enable_parallel_optimizer": False, "gradients_mean": False},
    "parallel_config": {"data_parallel": 8, "model_parallel": 1, "pipeline_stage": 1, "use_seq_parallel": False,
                        "micro_batch_num": 1, "vocab_emb_dp": True, "gradient_aggregation_group": 4},
    "model": {"arch": {"type": "LlamaForCausalLM"},
              "model_config": {"type": "LlamaConfig", "batch_size": 1, "seq_length": 4096, "hidden_size": 4096,
                               "num_layers": 32, "num_heads": 32, "vocab_size": 32000, "multiple_of": 256,
                               "rms_norm_eps": 1.0e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                               "ignore_token_id": -100, "compute_dtype": "bfloat16",
                               "layernorm_compute_type": "float32", "softmax_compute_type": "float32",
                               "rotary_dtype": "float32", "param_init_type": "bfloat16", "use_past": False,
                               "theta": 10000.0, "use_flash_attention": True}},
}


def _run(tmp_path: Path, mg_text: str, mf: dict, name: str = "train.log") -> dict:
    (tmp_path / name).write_text(mg_text)
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(mf))
    p = argparse.ArgumentParser()
    check_config.add_arguments(p)
    out = tmp_path / "out.json"
    rc = check_config.run(p.parse_args([str(tmp_path / name), str(tmp_path / "llama.yaml"), "--json", str(out)]))
    report = json.loads(out.read_text())
    report["rc"] = rc
    return report


def test_block_parser_reads_exact_format() -> None:
    parsed = parse_arguments_block(megatron_log(MEGATRON_ARGS))
    assert parsed["adam_beta2"] == 0.95 and parsed["bf16"] is True and parsed["num_experts"] is None
    assert parsed["params_dtype"] == "bfloat16" and parsed["normalization"] == "RMSNorm"
    assert parsed["a_very_long_argument_name_to_exercise_no_dots_at_all"] == 3
    assert len(parsed) == len(MEGATRON_ARGS)


def test_consistent_configs_have_no_findings(tmp_path: Path) -> None:
    rep = _run(tmp_path, megatron_log(MEGATRON_ARGS), MF_YAML)
    assert rep["verdict"] == "pass", rep["findings"]
    assert rep["counts"]["mismatch"] == 0 and rep["counts"]["check"] == 0 and rep["rc"] == 0
    assert rep["counts"]["match"] >= 30


def test_planted_mismatches_found_and_nothing_else(tmp_path: Path) -> None:
    mf = yaml.safe_load(yaml.safe_dump(MF_YAML))
    mf["model"]["model_config"]["rms_norm_eps"] = 1.0e-6          # planted 1
    mf["optimizer"]["betas"] = [0.9, 0.999]                         # planted 2
    mf["lr_schedule"]["warmup_steps"] = 10                          # planted 3
    mf["model"]["model_config"]["pad_token_id"] = 2                 # trap: pad == eos
    rep = _run(tmp_path, megatron_log(MEGATRON_ARGS), mf)
    got = {(f["component"], f["metric"]) for f in rep["findings"]}
    assert got == {("norm_eps", "mismatch"), ("adam_beta2", "mismatch"), ("warmup_ratio", "mismatch"),
                   ("advice.pad_equals_eos", "check")}
    assert rep["verdict"] == "fail" and rep["rc"] == 1


def test_launch_script_and_guide_advice(tmp_path: Path) -> None:
    script = """#!/bin/bash
GPUS_PER_NODE=8
TP=1
GPT_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 4096 --max-position-embeddings 4096 --tensor-model-parallel-size $TP
    --micro-batch-size 1 --global-batch-size 64 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-iters 30 --train-iters 1000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --clip-grad 1.0 --bf16 --swiglu --normalization RMSNorm --use-rotary-position-embeddings
    --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32001
    --make-vocab-size-divisible-by 1 --use-distributed-optimizer   # hidden/attention dropout left at default
)
torchrun --nproc_per_node $GPUS_PER_NODE pretrain_gpt.py "${GPT_ARGS[@]}"
"""
    mf = yaml.safe_load(yaml.safe_dump(MF_YAML))
    mf["model"]["model_config"]["vocab_size"] = 32001
    rep = _run(tmp_path, script, mf, name="pretrain_llama.sh")
    got = {(f["component"], f["metric"]) for f in rep["findings"]}
    # Megatron's defaults: dropout 0.1 (mismatch vs MindFormers' 0), adam eps default equal
    assert ("hidden_dropout", "mismatch") in got and ("attention_dropout", "mismatch") in got
    assert ("advice.dropout_on", "check") in got
    assert ("advice.odd_vocab_size", "check") in got
    assert ("advice.optimizer_parallel_on", "check") in got
    assert not any(m == "mismatch" and c not in ("hidden_dropout", "attention_dropout") for c, m in got), got


def test_json_arguments_and_bad_input(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"args": MEGATRON_ARGS}))
    args, kind = read_megatron(tmp_path / "a.json")
    assert kind == "json" and args["hidden_size"] == 4096
    (tmp_path / "x.txt").write_text("nothing here\n")
    with pytest.raises(BadInput):
        read_megatron(tmp_path / "x.txt")


# --- MindFormers 2.x (mcore) YAMLs as shipped in the mindformers 2.1.0 wheel (tests/data/configs/README.md) ----
CONFIGS = Path(__file__).parent / "data" / "configs"


def _rows(report: dict) -> dict[str, dict]:
    return {r["key"]: r for r in report["rows"]}


def _check(script: str, yaml_name: str, tmp_path: Path) -> dict:
    p = argparse.ArgumentParser()
    check_config.add_arguments(p)
    out = tmp_path / "out.json"
    rc = check_config.run(p.parse_args([str(CONFIGS / script), str(CONFIGS / yaml_name), "--json", str(out)]))
    report = json.loads(out.read_text())
    report["rc"] = rc
    return report


def test_shipped_qwen3_yaml_against_matching_megatron_flags(tmp_path: Path) -> None:
    rep = _check("megatron_qwen3_32b.sh", "pretrain_qwen3_32b_4k.yaml", tmp_path)
    rows = _rows(rep)
    assert rep["counts"]["mismatch"] == 0 and rep["rc"] == 0, rep["findings"]
    # the keys 1.x-era reading got wrong or could not read
    for key, value in {"rotary_base": 1e6, "num_layers": 64, "num_heads": 64, "num_query_groups": 8,
                       "kv_channels": 128, "qk_layernorm": True, "ffn_hidden_size": 25600}.items():
        assert rows[key]["status"] == "match" and rows[key]["mindformers"] == value, key
    assert rows["params_dtype"]["mindformers"] == "float32"      # the YAML's params_dtype, not a default
    # the only finding: Megatron's --bf16 params vs MindFormers' fp32 params (a real difference, to check)
    assert {f["component"] for f in rep["findings"]} == {"params_dtype"}
    assert rows["norm_type"]["status"] == "not read"               # not in the YAML: never a guessed default


def test_shipped_qwen3_moe_yaml_against_matching_megatron_flags(tmp_path: Path) -> None:
    rep = _check("megatron_qwen3_30b_a3b.sh", "pretrain_qwen3_30b_a3b_4k.yaml", tmp_path)
    rows = _rows(rep)
    assert rep["counts"]["mismatch"] == 0 and rep["rc"] == 0, rep["findings"]
    for key, value in {"num_experts": 128, "moe_topk": 8, "moe_ffn_hidden_size": 768,
                       "moe_router_dtype": "float32", "moe_router_load_balancing_type": "global_aux_loss",
                       "moe_router_topk_scaling_factor": 1.5, "moe_token_drop_policy": "probs",
                       "global_batch_size": 16, "ep": 4, "sequence_parallel": True}.items():
        assert rows[key]["status"] == "match" and rows[key]["mindformers"] == value, key
    assert {(f["component"], f["metric"]) for f in rep["findings"]} == {
        ("params_dtype", "check"), ("advice.aux_loss_on", "check")}


def test_qwen3_moe_real_differences_are_reported(tmp_path: Path) -> None:
    script = (CONFIGS / "megatron_qwen3_30b_a3b.sh").read_text()
    script = script.replace("--moe-router-dtype fp32 ", "").replace("--kv-channels 128", "") \
                   .replace("--rotary-base 1000000", "--rotary-base 10000")
    (tmp_path / "mg.sh").write_text(script)
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_30b_a3b_4k.yaml").read_text())
    mf["micro_batch_interleave_num"] = 2                           # doubles MindFormers' global batch
    (tmp_path / "mf.yaml").write_text(yaml.safe_dump(mf))
    rep = _check(str(tmp_path / "mg.sh"), str(tmp_path / "mf.yaml"), tmp_path)
    mismatches = {f["component"] for f in rep["findings"] if f["metric"] == "mismatch"}
    assert mismatches == {"moe_router_dtype", "kv_channels", "rotary_base", "global_batch_size"}
    assert ("advice.moe_router_dtype", "check") in {(f["component"], f["metric"]) for f in rep["findings"]}
    rows = _rows(rep)
    assert rows["kv_channels"]["megatron"] == 64 and rows["moe_router_dtype"]["megatron"] == "bfloat16"


def test_fused_kernels_on_one_side_are_a_check(tmp_path: Path) -> None:
    (tmp_path / "mg.sh").write_text((CONFIGS / "megatron_qwen3_32b.sh").read_text().replace(
        "--attention-softmax-in-fp32", "--attention-softmax-in-fp32 --no-rope-fusion"))
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text())
    mf["model"]["model_config"]["apply_rope_fusion"] = True
    (tmp_path / "mf.yaml").write_text(yaml.safe_dump(mf))
    rep = _check(str(tmp_path / "mg.sh"), str(tmp_path / "mf.yaml"), tmp_path)
    rows = _rows(rep)
    assert rows["rope_fusion"]["status"] == "check" and rows["rope_fusion"]["megatron"] is False
    assert rep["counts"]["mismatch"] == 0


def test_shipped_deepseek3_yaml_mla_mtp_moe_keys() -> None:
    """DeepSeek-V3 (MLA + MoE + MTP): what the YAML sets is read; what it leaves to the model class is
    'not read' - the expert count included, never 0 for an MoE model."""
    cfg = yaml.safe_load((CONFIGS / "pretrain_deepseek3_671b.yaml").read_text())
    c = cc.mindformers_common(cfg)
    assert c["multi_latent_attention"] is True and c["q_lora_rank"] is cc.NOT_READ
    assert c["mtp_num_layers"] == 1 and c["mtp_loss_scaling_factor"] == 0.3
    assert c["num_experts"] is cc.NOT_READ and c["moe_ffn_hidden_size"] == 2048
    assert c["moe_token_drop_policy"] == "probs"                  # enable_sdrop-style False
    assert c["moe_router_load_balancing_type"] == "seq_aux_loss" and c["moe_router_enable_expert_bias"] is True
    assert c["rope_fusion"] is False and c["swiglu_fusion"] is False and c["init_method_std"] == 0.01
    mg = {"num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "num_experts": 256,
          "moe_router_topk": 8, "moe_ffn_hidden_size": 2048, "multi_latent_attention": True, "q_lora_rank": 1536,
          "kv_lora_rank": 512, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3, "vocab_size": 129280,
          "make_vocab_size_divisible_by": 1, "seq_length": 4096, "init_method_std": 0.01}
    rows, _ = cc.compare_configs(mg, cfg)
    by_key = {r.key: r for r in rows}
    assert by_key["num_experts"].status == "not read" and by_key["q_lora_rank"].status == "not read"
    for key in ("mtp_num_layers", "mtp_loss_scaling_factor", "moe_ffn_hidden_size", "num_layers", "init_method_std"):
        assert by_key[key].status == "match", key
    assert any(r.key == "advice.mla_softmax_scale" for r in rows)


def test_sigmoid_router_normalised_topk_and_mla_from_kv_lora_rank() -> None:
    """megatron-core normalises a sigmoid router's top-k probabilities (top-k > 1) as MindFormers'
    norm_topk_prob does; an mcore YAML with kv_lora_rank is MLA even without multi_latent_attention; MLA's
    softmax-scale advice is a match when both sides use plain RoPE (scaling 1) and a check otherwise."""
    mg = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_experts": 4, "moe_router_topk": 2,
          "moe_router_score_function": "sigmoid", "multi_latent_attention": True, "kv_lora_rank": 16,
          "q_lora_rank": 32, "rope_type": "rope"}
    mf = {"use_legacy": False, "model": {"model_config": {
        "type": "DeepseekV3Config", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "kv_lora_rank": 16,
        "q_lora_rank": 32, "moe_router_score_function": "sigmoid", "rope_scaling": {"type": "yarn", "factor": 1.0}}}}
    rows = {r.key: r for r in cc.compare_configs(mg, mf)[0]}
    for key in ("moe_norm_topk_prob", "multi_latent_attention", "kv_lora_rank", "q_lora_rank",
                "advice.mla_softmax_scale"):
        assert rows[key].status == "match", (key, rows[key])
    mg.pop("rope_type")
    mg["rotary_scaling_factor"] = 40.0
    mf["model"]["model_config"]["rope_scaling"]["factor"] = 40.0
    rows = {r.key: r for r in cc.compare_configs(mg, mf)[0]}
    assert rows["advice.mla_softmax_scale"].status == "check"


def test_mla_attention_keeps_float32_while_flash_attention_casts() -> None:
    """MindFormers' SelfAttention casts float32 q/k/v to float16 for flash attention; MLA's own attention
    (multi_latent_attention.py) does not, so a float32 DeepSeek-V3 run is judged at float32."""
    qwen = {"use_legacy": False, "model": {"model_config": {"type": "Qwen3MoeConfig", "compute_dtype": "float32"}}}
    mla = {"use_legacy": False, "model": {"model_config": {"type": "DeepseekV3Config", "compute_dtype": "float32",
                                                           "kv_lora_rank": 16}}}
    assert cc.mindformers_attention_dtype(qwen) == "float16"
    assert cc.mindformers_attention_dtype(mla) is None
