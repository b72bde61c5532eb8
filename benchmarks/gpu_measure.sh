#!/usr/bin/env bash
# The GPU figures, each against a peer in the same run on the same GPU (about 9 minutes on one
# H200), one after the other so that no two share the GPU while timed. Same requirements and flags
# as gpu_check.sh (--dry-run, --device, --budget); results in $OUT/gpu_measure.json and
# gpu_measure_logs.tar.gz (with each benchmark's own JSON).
#
#   train_bf16      GPT-2 small, B=16, T=1024, bf16, compiled, the default LM loss: tokens/s and MFU
#                   (MFU* against the data sheet, the target's basis; MFU against the peak read in the run) next to
#                   transformers.GPT2LMHeadModel (SDPA) compiled with fused AdamW; then 2 steps of
#                   each under torch.profiler (logs/profile/*.txt: kernels by time, graph breaks)
#   lm_head_op      the fused LM-head loss at N=8192, V=50,304, C=768 (bf16, then fp32): time, peak
#                   memory and the loss and gradient norms against the full-logits path
#   decode_bf16     generation at batch 1 and 8, bf16, CUDA graphs, against transformers' generate and
#                   the floor of the memory bandwidth read in the same run
#   offload_full_gpt2_medium, _large, _xl
#                   train_gpt2.py --offload full (one-process ZeRO-3, parameters, gradients and Adam
#                   in pinned host memory) at B=1, T=1024, bf16, smallest first: the largest that
#                   trains is the last ok; each gives tokens/s (median of the steps after the first),
#                   the step line's peak GPU memory and the process's peak resident host memory
#                   (logs/offload_full_*.json)
#   train_bf16_fused_loss   train_bf16 with --lm-loss fused (the chunked LM head + loss)
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=gpu_measure BUDGET=560
source benchmarks/gpu_steps.sh

if [ "$DEVICE" = cpu ]; then  # a rehearsal of the flags at small sizes
    TRAIN_SIZE=(--model test --batch-size 1 --seq-len 64 --steps 2 --warmup 1)
    DECODE_SIZE=(--model test --batch-sizes 1 --new-tokens 8 --rounds 1)
    OP_SIZE=(--tokens 512)
    OFFLOAD_SIZE=(--max-len 64 --training-steps 3)
    OFFLOAD_MODELS=(test)
else
    TRAIN_SIZE=(--model gpt2 --batch-size 16 --seq-len 1024 --steps 8 --warmup 3)
    DECODE_SIZE=(--model gpt2 --batch-sizes 1,8 --new-tokens 128 --rounds 3)
    OP_SIZE=(--tokens 8192)
    OFFLOAD_SIZE=(--max-len 1024 --training-steps 6)
    OFFLOAD_MODELS=(gpt2-medium gpt2-large gpt2-xl)
fi
# Runs a training command, echoing its log; then writes what its step lines and the kernel say:
# tokens/s (median after the first step), peak GPU memory (the step lines' largest), the peak
# resident host memory of the process (getrusage of the children), and the exit code.
cat > "$WORK/measure_run.py" <<'EOF'
import json, re, resource, statistics, subprocess, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.time()
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines = []
for line in proc.stdout:
    print(line, end="", flush=True)
    lines.append(line)
rc = proc.wait()
steps = [(float(m[1]), float(m[2])) for m in
         re.finditer(r"tokens/s: ([\d.]+).*?peak memory: ([\d.]+) GiB", "".join(lines))]
timed = steps[1:] or steps  # the first step includes the warm-up
result = {"command": cmd, "rc": rc, "seconds": round(time.time() - t0, 1), "steps": len(steps),
          "tokens_per_s": statistics.median(t for t, _ in timed) if timed else None,
          "peak_gpu_gib": max((p for _, p in steps), default=None),
          "peak_host_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}
json.dump(result, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "command"}))
sys.exit(rc if rc else (0 if steps else 1))
EOF
echo "gpu_measure: device $DEVICE, budget ${BUDGET}s, logs in $LOGS, results in $OUT"
# The profile of 2 more steps per arm (kernel tables, launches, graph breaks) lands in the logs.
step train_bf16 200 "$PY" benchmarks/train_throughput.py --device "$DEVICE" --precisions bf16 "${TRAIN_SIZE[@]}" \
    --transformers-compiled --include-emulated --json "$LOGS/train_bf16.json" --profile "$LOGS/profile"
step lm_head_op 120 bash -c "$(printf '%q ' "$PY" benchmarks/lm_head_memory.py op --device "$DEVICE" \
    "${OP_SIZE[@]}" --vocab 50304 --embd 768 --repeats 5 --precision bf16) && \
    $(printf '%q ' "$PY" benchmarks/lm_head_memory.py op --device "$DEVICE" "${OP_SIZE[@]}" --vocab 50304 \
    --embd 768 --repeats 5)"
step decode_bf16 90 "$PY" benchmarks/generation_latency.py --device "$DEVICE" --precisions bf16 "${DECODE_SIZE[@]}" \
    --hf-threads default --json "$LOGS/decode_bf16.json"
# The largest GPT-2 that --offload full trains on this GPU: smallest first, until one fails.
for model in "${OFFLOAD_MODELS[@]}"; do
    name=offload_full_${model//-/_}
    step "$name" 200 "$PY" "$WORK/measure_run.py" "$LOGS/$name.json" "$PY" train_gpt2.py --model "$model" \
        "${OFFLOAD_SIZE[@]}" --dataset generated --batch-size 1 --gradient-accumulation 1 --device-iterations 1 \
        --num-workers 0 --optimizer AdamW --learning-rate 1e-4 --lr-warmup-steps 1 --log-steps 1 --precision bf16 \
        --offload full --torch-compile false --device "$DEVICE" || [ "$DRY" = 1 ] || break
done
# The same training with the fused loss: what the chunked LM head costs or saves inside a whole step.
step train_bf16_fused_loss 150 "$PY" benchmarks/train_throughput.py --device "$DEVICE" --precisions bf16 \
    "${TRAIN_SIZE[@]}" --lm-loss fused --transformers-compiled --include-emulated --json "$LOGS/train_bf16_fused.json"
[ "$DRY" = 1 ] && exit 0
finish
echo "gpu_measure: $((SECONDS - START)) s; summary $OUT/gpu_measure.json"
