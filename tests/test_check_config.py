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
    # the findings, each a real difference to check: Megatron's --bf16 params vs MindFormers' fp32 params; the
    # data shuffle seed (Megatron --seed 42, the YAML's data_loader seed 1234); the YAML's pipeline offset
    # [-1, -1, 1, 1] (15/15/17/17 layers) vs Megatron's even 16-layer split
    assert {f["component"] for f in rep["findings"]} == {"params_dtype", "data_seed", "pipeline_layers"}
    assert rows["pipeline_layers"]["megatron"] == [[16] * 4] and rows["pipeline_layers"]["mindformers"] == [
        [15, 15, 17, 17]]
    for key in ("seed", "flash_attention", "fp32_residual_connection", "warmup_ratio", "adam_beta2"):
        assert rows[key]["status"] == "match", (key, rows[key])
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


# --- issue 24: every numerics-relevant key read right, no false mismatch or check -----------------------------
def _script(tmp_path: Path, text: str, name: str = "mg.sh") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def _yaml(tmp_path: Path, cfg: dict, name: str = "mf.yaml") -> str:
    (tmp_path / name).write_text(yaml.safe_dump(cfg))
    return str(tmp_path / name)


def _qwen3_32b_real_shape() -> dict:
    """The Qwen3-32B pretrain YAML as MindFormers 2.x wrote it before fp32_residual_connection: the same
    file with `residual_dtype: "float32"` and `offset: [0]` (its converter maps residual_dtype through
    is_float_32 to fp32_residual_connection)."""
    text = (CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text()
    text = text.replace("    fp32_residual_connection: True\n", '    residual_dtype: "float32"\n')
    cfg = yaml.safe_load(text)
    assert "fp32_residual_connection" not in cfg["model"]["model_config"]
    return cfg


def test_residual_dtype_float32_vs_megatron_without_fp32_residual_is_a_mismatch(tmp_path: Path) -> None:
    cfg = _qwen3_32b_real_shape()
    script = (CONFIGS / "megatron_qwen3_32b.sh").read_text()
    rep = _check(_script(tmp_path, script.replace(" --fp32-residual-connection", "")), _yaml(tmp_path, cfg),
                 tmp_path)
    row = _rows(rep)["fp32_residual_connection"]
    assert (row["status"], row["megatron"], row["mindformers"]) == ("mismatch", False, True)
    assert rep["counts"]["mismatch"] == 1 and rep["rc"] == 1      # the one real numerical difference
    rep = _check(str(CONFIGS / "megatron_qwen3_32b.sh"), _yaml(tmp_path, cfg), tmp_path)
    assert _rows(rep)["fp32_residual_connection"]["status"] == "match" and rep["counts"]["mismatch"] == 0
    cfg["model"]["model_config"]["residual_dtype"] = "bfloat16"
    assert cc.mindformers_common(cfg)["fp32_residual_connection"] is False


def test_residual_in_fp32_for_an_fp32_run_without_the_flag() -> None:
    mg = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "fp32_residual_connection": False}
    mf = {"use_legacy": False, "model": {"model_config": {"num_hidden_layers": 2, "compute_dtype": "float32"}}}
    rows = {r.key: r for r in cc.compare_configs(mg, mf)[0]}
    assert rows["fp32_residual_connection"].status == "match"


def test_legacy_yaml_beta1_beta2_and_residual_dtype_read(tmp_path: Path) -> None:
    mf = yaml.safe_load(yaml.safe_dump(MF_YAML))
    mf["optimizer"] = {"type": "FP32StateAdamWeightDecay", "beta1": 0.9, "beta2": 0.95, "eps": 1.0e-8,
                       "weight_decay": 0.1}
    c = cc.mindformers_common(mf)
    assert (c["adam_beta1"], c["adam_beta2"]) == (0.9, 0.95)
    rep = _run(tmp_path, megatron_log(MEGATRON_ARGS), mf)
    # the one real difference: 1.x AdamWeightDecay has no bias correction (Megatron's Adam has)
    assert {f["component"] for f in rep["findings"] if f["metric"] == "mismatch"} == {"optimizer"}
    assert _rows(rep)["adam_beta2"]["status"] == "match"
    mf["optimizer"]["beta2"] = 0.999                                 # a real difference is still one
    assert _rows(_run(tmp_path, megatron_log(MEGATRON_ARGS), mf))["adam_beta2"]["status"] == "mismatch"
    mf["model"]["model_config"]["residual_dtype"] = "float32"       # 1.x LlamaConfig key
    assert cc.mindformers_common(mf)["fp32_residual_connection"] is True
    mf["optimizer"]["beta1"] = "0.9"
    with pytest.raises(BadInput, match="beta1"):
        _run(tmp_path, megatron_log(MEGATRON_ARGS), mf)


@pytest.mark.parametrize("lr_schedule", [
    {"type": "ConstantWarmUpLR", "learning_rate": 3.0e-4, "warmup_ratio": 0, "total_steps": -1},
    {"type": "ConstantWarmUpLR", "learning_rate": 3.0e-4, "warmup_steps": 0, "total_steps": -1},
    {"type": "ConstantWarmUpLR", "learning_rate": 3.0e-4, "total_steps": -1},
    {"type": "ConstantWarmUpLR", "learning_rate": 3.0e-4, "warmup_ratio": 0.0},
])
@pytest.mark.parametrize("legacy", [True, False])
def test_no_warmup_is_ratio_zero_on_both_sides(lr_schedule: dict, legacy: bool) -> None:
    mg = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "lr": 3e-4, "lr_warmup_iters": 0,
          "lr_decay_style": "constant", "train_samples": 1000}          # no train_iters: no decay length
    mf = {"lr_schedule": lr_schedule, "model": {"model_config": {"num_layers": 2, "hidden_size": 64,
                                                                 "num_heads": 4}}}
    if not legacy:
        mf["use_legacy"] = False
    rows = {r.key: r for r in cc.compare_configs(mg, mf)[0]}
    assert rows["warmup_ratio"].status == "match", rows["warmup_ratio"]


def test_seeds_compared(tmp_path: Path) -> None:
    script = (CONFIGS / "megatron_qwen3_30b_a3b.sh").read_text()
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_30b_a3b_4k.yaml").read_text())
    rows = _rows(_check(str(CONFIGS / "megatron_qwen3_30b_a3b.sh"), _yaml(tmp_path, mf), tmp_path))
    assert rows["seed"]["status"] == rows["data_seed"]["status"] == "match"
    rows = _rows(_check(_script(tmp_path, script.replace("--seed 1234", "--seed 7")), _yaml(tmp_path, mf),
                        tmp_path))
    assert (rows["seed"]["status"], rows["seed"]["megatron"], rows["seed"]["mindformers"]) == ("check", 7, 1234)
    assert (rows["data_seed"]["status"], rows["data_seed"]["mindformers"]) == ("check", 1234)
    del mf["train_dataset"]["data_loader"]                              # no Megatron dataset: no data seed
    mf["train_dataset"]["data_loader"] = {"type": "MindDataset"}
    assert "data_seed" not in _rows(_check(_script(tmp_path, script), _yaml(tmp_path, mf), tmp_path))


@pytest.mark.parametrize(("flags", "expected", "status"), [
    ("", True, "match"),                                   # auto under --bf16: a flash / fused kernel
    (" --use-flash-attn", True, "match"),
    (" --attention-backend flash", True, "match"),
    (" --attention-backend fused", True, "match"),
    (" --attention-backend unfused", False, "check"),
    (" --attention-backend local", False, "check"),
    (" --transformer-impl local", False, "check"),
])
def test_flash_attention_compared(tmp_path: Path, flags: str, expected: bool, status: str) -> None:
    script = (CONFIGS / "megatron_qwen3_32b.sh").read_text().replace("--bf16", "--bf16" + flags)
    rep = _check(_script(tmp_path, script), "pretrain_qwen3_32b_4k.yaml", tmp_path)
    row = _rows(rep)["flash_attention"]
    assert (row["megatron"], row["mindformers"], row["status"]) == (expected, True, status)
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text())
    mf["model"]["model_config"]["use_flash_attention"] = False
    row = _rows(_check(_script(tmp_path, script), _yaml(tmp_path, mf), tmp_path))["flash_attention"]
    assert row["status"] == ("match" if not expected else "check")


def test_flash_attention_auto_in_fp32_is_unfused() -> None:
    mg = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    mf = {"use_legacy": False, "model": {"model_config": {"num_hidden_layers": 2, "use_flash_attention": False}}}
    rows = {r.key: r for r in cc.compare_configs(mg, mf)[0]}
    assert rows["flash_attention"].status == "match" and rows["flash_attention"].megatron is False
    mg["attention_backend"] = "AttnBackend.flash"                     # as a log's arguments block prints it
    rows = {r.key: r for r in cc.compare_configs(mg, mf)[0]}
    assert rows["flash_attention"].status == "check" and rows["flash_attention"].megatron is True


@pytest.mark.parametrize(("flags", "offset", "megatron", "status"), [
    ("", [0, 0, 0, 0], [[16, 16, 16, 16]], "match"),
    ("", 0, [[16, 16, 16, 16]], "match"),
    ("", [-1, -1, 1, 1], [[16, 16, 16, 16]], "check"),
    (" --decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 17", [-1, -1, 1, 1],
     [[15, 16, 16, 17]], "check"),
    (" --decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 17", [-1, 0, 0, 1],
     [[15, 16, 16, 17]], "match"),
    (" --decoder-first-pipeline-num-layers 13", [-3, 1, 1, 1], [[13, 17, 17, 17]], "match"),
    (" --decoder-first-pipeline-num-layers 14", [-2, 0, 1, 1], "50 middle layers do not split evenly into 3 stages",
     "check"),
    (" --decoder-first-pipeline-num-layers 16", [0, 0, 0, 0], [[16, 16, 16, 16]], "match"),
    (" --num-layers-per-virtual-pipeline-stage 8", [[0, 0, 0, 0], [0, 0, 0, 0]], [[8] * 4, [8] * 4], "match"),
])
def test_pipeline_offset_compared(tmp_path: Path, flags: str, offset: object, megatron: list, status: str) -> None:
    script = (CONFIGS / "megatron_qwen3_32b.sh").read_text().replace("--bf16", "--bf16" + flags)
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text())
    mf["model"]["model_config"]["offset"] = offset
    if isinstance(offset, list) and isinstance(offset[0], list):
        mf["model"]["model_config"]["pp_interleave_num"] = len(offset)
        mf["parallel"]["pipeline_config"] = {"pipeline_interleave": True}
    row = _rows(_check(_script(tmp_path, script), _yaml(tmp_path, mf), tmp_path))["pipeline_layers"]
    assert row["megatron"] == megatron and row["status"] == status, row


@pytest.mark.parametrize("offset", [[1, 0, 0, 0], [0, 0, 0], 1.5, [0.5, -0.5, 0, 0]])
def test_pipeline_offset_mindformers_refuses_is_a_check_never_a_split(tmp_path: Path, offset: object) -> None:
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text())
    mf["model"]["model_config"]["offset"] = offset
    if isinstance(offset, float):
        with pytest.raises(BadInput, match="offset"):
            _check(str(CONFIGS / "megatron_qwen3_32b.sh"), _yaml(tmp_path, mf), tmp_path)
        return
    row = _rows(_check(str(CONFIGS / "megatron_qwen3_32b.sh"), _yaml(tmp_path, mf), tmp_path))["pipeline_layers"]
    assert row["status"] == "check" and isinstance(row["mindformers"], str) and "offset" in row["mindformers"]


def test_deepseek3_and_qwen3_moe_pairs_have_no_false_row_for_the_new_keys(tmp_path: Path) -> None:
    cfg = yaml.safe_load((CONFIGS / "pretrain_deepseek3_671b.yaml").read_text())
    c = cc.mindformers_common(cfg)
    # 61 layers over 8 stages x 2 interleave chunks: 3 each plus the YAML's offset
    assert c["pipeline_layers"] == [[4] * 8, [4] * 7 + [1]]
    assert (c["seed"], c["data_seed"], c["flash_attention"]) == (42, 1234, True)
    assert (c["adam_beta1"], c["adam_beta2"], c["warmup_steps"]) == (0.9, 0.95, 200)
    mg = {"num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "num_experts": 256,
          "moe_router_topk": 8, "multi_latent_attention": True, "bf16": True, "seed": 42,
          "adam_beta1": 0.9, "adam_beta2": 0.95, "pipeline_model_parallel_size": 8,
          "pipeline_model_parallel_layout": "Et*4|...", "use_flash_attn": True}
    rows = {r.key: r for r in cc.compare_configs(mg, cfg)[0]}
    for key in ("seed", "flash_attention", "adam_beta1", "adam_beta2"):
        assert rows[key].status == "match", (key, rows[key])
    assert rows["data_seed"].status == "check"                       # 42 vs the loader's 1234: real
    assert rows["fp32_residual_connection"].status == "not read"     # the YAML leaves it to the model class
    rep = _check("megatron_qwen3_30b_a3b.sh", "pretrain_qwen3_30b_a3b_4k.yaml", tmp_path)
    rows = _rows(rep)
    for key in ("seed", "data_seed", "flash_attention", "pipeline_layers", "warmup_ratio", "adam_beta1",
                "adam_beta2"):
        assert rows[key]["status"] == "match", (key, rows[key])
    assert rows["fp32_residual_connection"]["status"] == "not read"


def test_bad_types_of_the_new_keys_are_one_line(tmp_path: Path) -> None:
    script = (CONFIGS / "megatron_qwen3_32b.sh").read_text().replace(
        "--bf16", "--bf16 --decoder-first-pipeline-num-layers many")
    with pytest.raises(BadInput, match="decoder_first_pipeline_num_layers"):
        _check(_script(tmp_path, script), "pretrain_qwen3_32b_4k.yaml", tmp_path)
    mf = yaml.safe_load((CONFIGS / "pretrain_qwen3_32b_4k.yaml").read_text())
    mf["train_dataset"]["data_loader"]["config"]["seed"] = "x"
    with pytest.raises(BadInput, match="seed"):
        _check(str(CONFIGS / "megatron_qwen3_32b.sh"), _yaml(tmp_path, mf), tmp_path)


# --- issue 22: a replay run's global batch is read from the batches it replays ---------------------------

def _docs_replay_yaml(data_dir: Path) -> dict:
    """The replay block of docs/mindformers-launch.md, as a user copies it, pointed at ``data_dir``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "mindformers-launch.md").read_text()
    block = next(b.split("\n", 1)[1] for b in text.split("```yaml")[1:] if "MegatronReplayDataset" in b)
    block = block.split("```", 1)[0]
    assert "/path/to/megatron_batches" in block
    cfg = yaml.safe_load(block.replace("/path/to/megatron_batches", str(data_dir)))
    cfg["parallel_config"] = {"data_parallel": 1}
    return cfg


def test_replay_of_a_run_store_gives_the_global_batch_and_says_so(tmp_path: Path) -> None:
    """A Megatron run store of 2 micro-batches of 2 per step (what the dumper writes), replayed as the docs'
    YAML says (batch_size 1: one row per whole step): 4 samples per step on both sides."""
    import numpy as np

    from runstore import RunWriter

    store = tmp_path / "megatron_run"
    with RunWriter(store, rank=0, meta={"framework": "megatron-core", "parallel": {"tp": 1, "pp": 1, "dp": 1}}) as w:
        for step in (1, 2, 3):
            tokens = np.arange(4 * 16).reshape(4, 16) % 50
            w.put_array(step, "batch/tokens", tokens, {"micro_batches": 2})
            w.put_array(step, "batch/labels", np.roll(tokens, -1, axis=1), {"micro_batches": 2})
    cfg = _docs_replay_yaml(store)
    mg = {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16, "num_layers": 2,
          "tensor_model_parallel_size": 1}
    assert cc.mindformers_common(cfg)["global_batch_size"] == 1          # what the YAML alone says
    rows, res = cc.compare_configs(mg, cfg)
    row = {r.key: r for r in rows}
    gbs = row["global_batch_size"]
    assert (gbs.megatron, gbs.mindformers, gbs.status) == (4, 4, "match")
    assert f"replayed run store {store}" in gbs.note and "2 Megatron micro-batches" in gbs.note
    assert row["replay_seq_length"].status == "match"
    mbs = row["micro_batch_size"]     # one forward of 4 rows against Megatron's 2 micro-batches of 2
    assert (mbs.mindformers, mbs.status) == (4, "check") and "one forward" in mbs.note
    batch = {"global_batch_size", "micro_batch_size", "replay_seq_length"}
    assert not [f for f in res.findings if f.verdict == "fail" and f.component in batch]
    rows, res = cc.compare_configs({**mg, "global_batch_size": 8, "seq_length": 32}, cfg)    # real mismatches
    assert {f.component for f in res.findings if f.verdict == "fail"} >= {"global_batch_size", "replay_seq_length"}


def test_replay_of_a_folder_not_here_is_a_check_not_a_fail(tmp_path: Path) -> None:
    for folder, says in ((tmp_path / "not_here", "does not exist"), (tmp_path / "@STORE@", "placeholder @STORE@")):
        cfg = _docs_replay_yaml(folder)
        rows, res = cc.compare_configs({"global_batch_size": 4, "micro_batch_size": 2}, cfg)
        gbs = {r.key: r for r in rows}["global_batch_size"]
        assert gbs.status == "check" and says in gbs.note, gbs.note
        assert not [f for f in res.findings if f.verdict == "fail" and "batch" in f.component]


def test_padding_formula_is_megatrons() -> None:
    """megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding: multiple = make_vocab_size_divisible_by
    x tensor_model_parallel_size; the size rounded up to it."""
    from align.checks.vocab import padded_vocab_size

    assert padded_vocab_size(127, 128, 2) == 256 and padded_vocab_size(127, 128, 1) == 128
    assert padded_vocab_size(128, 128, 1) == 128 and padded_vocab_size(32000, 128, 8) == 32768
    assert padded_vocab_size(129280, 1, 8) == 129280 and padded_vocab_size(50257, 128, 1) == 50304


def _null_tokenizer_log(tp: int, **more: object) -> str:
    # Megatron-LM prints padded_vocab_size None: its arguments block comes before the tokenizer pads
    return megatron_log({**MEGATRON_ARGS, "vocab_size": 127, "padded_vocab_size": None, "tokenizer_type":
                         "NullTokenizer", "tensor_model_parallel_size": tp, **more})


@pytest.mark.parametrize("tp,yaml_vocab,want", [(2, 127, 256), (2, 128, 256), (1, 127, 128), (2, 256, 256)])
def test_yaml_vocab_size_must_be_megatrons_padded_vocabulary(tmp_path: Path, tp: int, yaml_vocab: int,
                                                              want: int) -> None:
    """Issue 37: --vocab-size 127 (NullTokenizer: 128 ids) is padded to 256 rows at TP=2 (128 at TP=1); a YAML
    with another vocab_size cannot load the converted embedding: a mismatch whose message says the number."""
    mf = yaml.safe_load(yaml.safe_dump(MF_YAML))
    mf["model"]["model_config"]["vocab_size"] = yaml_vocab
    rep = _run(tmp_path, _null_tokenizer_log(tp), mf)
    row = _rows(rep)["vocab_size"]
    assert row["megatron"] == want
    found = [f for f in rep["findings"] if f["component"] == "vocab_size"]
    if yaml_vocab == want:
        assert row["status"] == "match" and not found
        return
    assert row["status"] == "mismatch" and rep["rc"] == 1
    assert f"set model.model_config.vocab_size: {want}" in row["note"], row["note"]
    assert f"a multiple of make_vocab_size_divisible_by 128 x TP {tp}" in row["note"]
    assert len(found) == 1 and found[0]["verdict"] == "fail" and f"vocab_size: {want}" in found[0]["message"]


def test_vocab_padding_default_from_a_launch_script(tmp_path: Path) -> None:
    """A launch script that leaves --make-vocab-size-divisible-by at Megatron's default (128) still pads."""
    script = ("torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
              "--num-attention-heads 4 --seq-length 32 --tensor-model-parallel-size 2 --vocab-size 127 "
              "--tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 4 --lr 1e-4\n")
    mf = yaml.safe_load(yaml.safe_dump(MF_YAML))
    mf["model"]["model_config"]["vocab_size"] = 127
    rep = _run(tmp_path, script, mf, name="pretrain.sh")
    row = _rows(rep)["vocab_size"]
    assert row["megatron"] == 256 and row["status"] == "mismatch"
    assert "set model.model_config.vocab_size: 256" in row["note"]
