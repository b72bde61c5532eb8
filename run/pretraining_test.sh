#!/usr/bin/env bash
# A short smoke run of the gpt2-test model (4 layers) on generated data with the test layout.
set -euo pipefail
cd "$(dirname "$0")/.."
source run/launch.sh  # torchrun: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR
launch train_gpt2.py \
    --model gpt2-test \
    --max-len 128 \
    --optimizer AdamW \
    --learning-rate 0.00015 \
    --lr-schedule cosine \
    --lr-warmup 0.01 \
    --layers-per-ipu 0 4 \
    --matmul-proportion 0.20 0.20 \
    --ipus-per-replica 2 \
    --replication-factor 1 \
    --epochs 1 \
    --gradient-accumulation 2 \
    --device-iterations 1 \
    --batch-size 1 \
    --dataset generated \
    "$@"
