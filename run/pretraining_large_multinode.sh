#!/usr/bin/env bash
# gpt2-large (SL 512) on several nodes, replacing the reference's pretraining_large_poprun.sh (PopRun over a
# Pod): torchrun's rendezvous at MASTER_ADDR (run/launch.sh). Run the same command on every node:
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 host> NPROC_PER_NODE=8 bash run/pretraining_large_multinode.sh
# Under Slurm, run/slurm_pretraining_large.sbatch sets these from the allocation. The reference's layout had
# 16 replicas of 8 stages; --replication-factor is the number of processes in total (NNODES x NPROC_PER_NODE
# must divide it; the rest becomes gradient accumulation). Logging, metrics and checkpoints come from rank 0.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES (and MASTER_ADDR, NODE_RANK) on every node}"
source run/launch.sh  # torchrun: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
launch train_gpt2.py \
    --model gpt2-large \
    --max-len 512 \
    --optimizer AdamW \
    --learning-rate 0.00015 \
    --lr-schedule cosine \
    --lr-warmup 0.01 \
    --layers-per-ipu 1 5 5 5 5 5 5 5 \
    --ipus-per-replica 8 \
    --replication-factor 16 \
    --epochs 5 \
    --gradient-accumulation 1024 \
    --device-iterations 1 \
    --batch-size 1 \
    --enable-sequence-serialized True \
    --embedding-serialization-factor 8 \
    --recompute-checkpoint-every-layer True \
    --enable-half-partials True \
    --dataset generated \
    --replicated-tensor-sharding True \
    "$@"
