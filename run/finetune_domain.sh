#!/usr/bin/env bash
# Continued pretraining on a domain corpus (nanoGPT's finetune_shakespeare.py; Megatron's continued
# pretraining): start from the weights of CHECKPOINT, one of our checkpoints or any local Hugging Face
# GPT-2 directory (save_pretrained output), with a new AdamW state and schedule; cosine decay to --min-lr
# over --train-samples, warm-up and decay counted in samples as Megatron counts them; no dropout.
#
#   python data/preprocess_data.py --input domain.jsonl --output-prefix data/domain --append-eod
#   CHECKPOINT=path/to/gpt2 DATA=data/domain_text_document bash run/finetune_domain.sh
#
# DATA is a PREFIX of PREFIX.bin/.idx (or a blend 'W1 PREFIX1 W2 PREFIX2'; DATASET=jsonl or text reads
# raw files instead); OUTPUT (default checkpoints/finetune_domain) receives the checkpoints, each of
# which records its parent. Extra flags pass through, e.g. --train-samples 3200 --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
source run/launch.sh  # torchrun: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR
: "${CHECKPOINT:?set CHECKPOINT to our checkpoint or a Hugging Face GPT-2 directory}"
: "${DATA:?set DATA to the domain corpus (PREFIX of PREFIX.bin/.idx from data/preprocess_data.py)}"
# shellcheck disable=SC2086  # DATA may be a weighted blend: several words
launch train_gpt2.py \
    --checkpoint-input-dir "${CHECKPOINT}" \
    --dataset "${DATASET:-mmap}" \
    --input-files ${DATA} \
    --split 949,50,1 \
    --max-len 1024 \
    --optimizer AdamW \
    --learning-rate 0.00003 \
    --min-lr 0.000003 \
    --lr-schedule cosine \
    --lr-warmup-samples 320 \
    --train-samples 32000 \
    --weight-decay 0.1 \
    --max-grad-norm 1.0 \
    --hidden-dropout 0.0 \
    --attention-dropout 0.0 \
    --batch-size 4 \
    --gradient-accumulation 8 \
    --device-iterations 1 \
    --eval-every-steps 100 \
    --save-per-steps 250 \
    --keep-checkpoints 2 \
    --checkpoint-output-dir "${OUTPUT:-checkpoints/finetune_domain}" \
    "$@"
