#!/usr/bin/env bash
# gpt2-large pretraining with the reference's POD16 layout (GPT-2 large, 762M, SL 1024). Runs anywhere: launched with
# torchrun: NPROC_PER_NODE = stages x replicas runs every stage in its own process (pipeline); fewer processes
# run the stages co-located in each, and replicas without a process become gradient accumulation. Extra flags pass through, e.g. --training-steps 10 --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
source run/launch.sh  # torchrun: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR
launch train_gpt2.py \
    --model gpt2-large \
    --max-len 1024 \
    --optimizer AdamW \
    --learning-rate 0.00015 \
    --lr-schedule cosine \
    --lr-warmup 0.01 \
    --layers-per-ipu 0 2 2 2 2 2 2 2 2 3 3 3 3 3 3 2 \
    --matmul-proportion 0.2 0.15 0.2 0.2 0.2 0.15 0.15 0.2 0.2 0.15 0.2 0.2 0.2 0.15 0.15 0.2 \
    --ipus-per-replica 16 \
    --replication-factor 1 \
    --epochs 20 \
    --gradient-accumulation 8192 \
    --device-iterations 8 \
    --batch-size 1 \
    --enable-sequence-serialized True \
    --remap-logit True \
    --embedding-serialization-factor 4 \
    --recompute-checkpoint-every-layer True \
    --enable-half-partials True \
    --dataset generated \
    --replicated-tensor-sharding False \
    "$@"
