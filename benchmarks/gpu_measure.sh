#!/usr/bin/env bash
# The GPU figures, each against a peer in the same run on the same GPU (about 5 minutes on one
# H200), one after the other so that no two share the GPU while timed. Same requirements and flags
# as gpu_check.sh (--dry-run, --device, --budget); results in $OUT/gpu_measure.json and
# gpu_measure_logs.tar.gz (with each benchmark's own JSON).
#
#   train_bf16      GPT-2 small, B=16, T=1024, bf16, compiled, the default LM loss: tokens/s and MFU
#                   (against the matmul peak read in the run; MFU* against the data sheet) next to
#                   transformers.GPT2LMHeadModel (SDPA) compiled with fused AdamW; then 2 steps of
#                   each under torch.profiler (logs/profile/*.txt: kernels by time, graph breaks)
#   lm_head_op      the fused LM-head loss at N=8192, V=50,304, C=768 (bf16, then fp32): time, peak
#                   memory and the loss and gradient norms against the full-logits path
#   decode_bf16     generation at batch 1 and 8, bf16, CUDA graphs, against transformers' generate and
#                   the floor of the memory bandwidth read in the same run
#   train_bf16_fused_loss   train_bf16 with --lm-loss fused (the chunked LM head + loss)
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=gpu_measure BUDGET=560
source benchmarks/gpu_steps.sh

if [ "$DEVICE" = cpu ]; then  # a rehearsal of the flags at small sizes
    TRAIN_SIZE=(--model test --batch-size 1 --seq-len 64 --steps 2 --warmup 1)
    DECODE_SIZE=(--model test --batch-sizes 1 --new-tokens 8 --rounds 1)
    OP_SIZE=(--tokens 512)
else
    TRAIN_SIZE=(--model gpt2 --batch-size 16 --seq-len 1024 --steps 8 --warmup 3)
    DECODE_SIZE=(--model gpt2 --batch-sizes 1,8 --new-tokens 128 --rounds 3)
    OP_SIZE=(--tokens 8192)
fi
echo "gpu_measure: device $DEVICE, budget ${BUDGET}s, logs in $LOGS, results in $OUT"
# The profile of 2 more steps per arm (kernel tables, launches, graph breaks) lands in the logs.
step train_bf16 200 "$PY" benchmarks/train_throughput.py --device "$DEVICE" --precisions bf16 "${TRAIN_SIZE[@]}" \
    --transformers-compiled --include-emulated --json "$LOGS/train_bf16.json" --profile "$LOGS/profile"
[ "$DRY" = 1 ] || finish
step lm_head_op 120 bash -c "$(printf '%q ' "$PY" benchmarks/lm_head_memory.py op --device "$DEVICE" \
    "${OP_SIZE[@]}" --vocab 50304 --embd 768 --repeats 5 --precision bf16) && \
    $(printf '%q ' "$PY" benchmarks/lm_head_memory.py op --device "$DEVICE" "${OP_SIZE[@]}" --vocab 50304 \
    --embd 768 --repeats 5)"
[ "$DRY" = 1 ] || finish
step decode_bf16 90 "$PY" benchmarks/generation_latency.py --device "$DEVICE" --precisions bf16 "${DECODE_SIZE[@]}" \
    --hf-threads default --json "$LOGS/decode_bf16.json"
[ "$DRY" = 1 ] || finish
# The same training with the fused loss: what the chunked LM head costs or saves inside a whole step.
step train_bf16_fused_loss 150 "$PY" benchmarks/train_throughput.py --device "$DEVICE" --precisions bf16 \
    "${TRAIN_SIZE[@]}" --lm-loss fused --transformers-compiled --include-emulated --json "$LOGS/train_bf16_fused.json"
[ "$DRY" = 1 ] && exit 0
finish
echo "gpu_measure: $((SECONDS - START)) s; summary $OUT/gpu_measure.json"
