#!/bin/bash
# Megatron-LM pretraining of Qwen3-32B with the settings of MindFormers' pretrain_qwen3_32b_4k.yaml.
TP=4
PP=4
MODEL_ARGS=(
    --use-mcore-models
    --num-layers 64 --hidden-size 5120 --ffn-hidden-size 25600
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 4096 --max-position-embeddings 4096
    --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm
    --position-embedding-type rope --rotary-base 1000000
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --vocab-size 151936 --make-vocab-size-divisible-by 1
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --attention-softmax-in-fp32 --fp32-residual-connection
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 4 --train-iters 8000
    --lr 1e-6 --min-lr 0.0 --lr-decay-style constant --lr-warmup-iters 0
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.0 --clip-grad 1.0
    --bf16 --seed 42
    --tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP
)
torchrun --nproc_per_node 8 pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
