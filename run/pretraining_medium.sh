#!/usr/bin/env bash
# gpt2-medium pretraining with the reference's POD16 layout (GPT-2 medium, 345M). Runs anywhere: launched with
# torchrun: NPROC_PER_NODE = stages x replicas runs every stage in its own process (pipeline); fewer processes
# run the stages co-located in each, and replicas without a process become gradient accumulation. Extra flags pass through, e.g. --training-steps 10 --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
source run/launch.sh  # torchrun: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR
launch train_gpt2.py \
    --model gpt2-medium \
    --max-len 1024 \
    --optimizer AdamW \
    --learning-rate 0.00015 \
    --lr-schedule cosine \
    --lr-warmup 0.01 \
    --layers-per-ipu 0 3 3 3 3 4 4 4 \
    --matmul-proportion 0.30 0.15 0.15 0.15 0.15 0.15 0.15 0.15 \
    --ipus-per-replica 8 \
    --replication-factor 2 \
    --epochs 20 \
    --gradient-accumulation 4096 \
    --device-iterations 8 \
    --batch-size 1 \
    --enable-sequence-serialized True \
    --remap-logit True \
    --embedding-serialization-factor 4 \
    --recompute-checkpoint-every-layer True \
    --enable-half-partials True \
    --dataset generated \
    --replicated-tensor-sharding True \
    "$@"
