#!/bin/bash
# Megatron-LM pretraining of Qwen3-30B-A3B with the settings of MindFormers' pretrain_qwen3_30b_a3b_4k.yaml.
MODEL_ARGS=(
    --use-mcore-models
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
    --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128
    --seq-length 4096 --max-position-embeddings 40960
    --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm
    --position-embedding-type rope --rotary-base 1000000
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --vocab-size 151936 --make-vocab-size-divisible-by 1
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 --attention-softmax-in-fp32
)
MOE_ARGS=(
    --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768
    --moe-router-dtype fp32 --moe-router-pre-softmax --moe-router-topk-scaling-factor 1.5
    --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 0.001
    --moe-token-drop-policy probs --moe-grouped-gemm --expert-model-parallel-size 4
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 16 --train-iters 8000
    --lr 1e-5 --min-lr 0.0 --lr-decay-style constant --lr-warmup-iters 0
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.0 --clip-grad 1.0
    --bf16 --seed 1234
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --sequence-parallel
)
torchrun --nproc_per_node 8 pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}"
