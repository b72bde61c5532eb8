#!/usr/bin/env bash
# Instruction tuning on prompt/completion records: start from the weights of CHECKPOINT, one of our
# checkpoints or any local Hugging Face GPT-2 directory (save_pretrained output), with a new AdamW
# state and schedule; only completion tokens carry loss (--loss-on completion masks the prompt's).
#
#   CHECKPOINT=path/to/gpt2 DATA='sft/*.jsonl' bash run/finetune_instruct.sh
#
# DATA: JSONL files or globs, one record per line with a prompt and a completion (see docs/data.md,
# --dataset jsonl); they are tokenized once into a cache beside them. OUTPUT (default
# checkpoints/finetune_instruct) receives the checkpoints. Extra flags pass through, e.g. --epochs 1.
set -euo pipefail
cd "$(dirname "$0")/.."
source run/launch.sh  # torchrun: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR
: "${CHECKPOINT:?set CHECKPOINT to our checkpoint or a Hugging Face GPT-2 directory}"
: "${DATA:?set DATA to the prompt/completion JSONL files (a path or a quoted glob)}"
launch train_gpt2.py \
    --checkpoint-input-dir "${CHECKPOINT}" \
    --dataset jsonl \
    --input-files "${DATA}" \
    --loss-on completion \
    --split 95,5,0 \
    --max-len 1024 \
    --optimizer AdamW \
    --learning-rate 0.00002 \
    --min-lr 0.000002 \
    --lr-schedule cosine \
    --lr-warmup 0.03 \
    --epochs 3 \
    --weight-decay 0.0 \
    --max-grad-norm 1.0 \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --batch-size 4 \
    --gradient-accumulation 8 \
    --device-iterations 1 \
    --eval-every-steps 50 \
    --save-per-epochs 1 \
    --checkpoint-output-dir "${OUTPUT:-checkpoints/finetune_instruct}" \
    "$@"
