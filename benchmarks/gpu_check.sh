#!/usr/bin/env bash
# Every CUDA path of gpt2forge, checked in one command on a GPU machine (about 9 minutes on one
# H100). Uses the machine's own python3 and torch: nothing is installed and nothing is downloaded.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine; logs and a JSON summary under $OUT
#   bash benchmarks/gpu_check.sh --dry-run   # print the steps it would run, run none
#   bash benchmarks/gpu_check.sh --device cpu --budget 900
#                                            # the same steps on the CPU at the same sizes: a rehearsal
#                                            # of the flags and imports in a venv of the GPU's versions
#
# What it needs there: the repository, the GPT-2 BPE files in gpt2forge/assets/ (made by `make` here;
# copy them along), and python3 with torch >= 2.11, numpy, safetensors, tiktoken, tokenizers, tqdm,
# pyyaml, regex, pytest and pytest-timeout (the GPU machines' image has them all; a package it lacks
# travels as a wheel: `pip download --no-deps --only-binary=:all: --python-version 3.12 NAME==VER`,
# then `pip install --no-index --no-deps --target DIR *.whl` there and PYTHONPATH=DIR).
#
# Steps: env, imports, the custom-ops build and the memory plan run one after the other; then,
# side by side (they check, they do not time): the CUDA tests (every test marked cuda, no -x, a timeout per test);
# compiled bf16 training on packed documents (FlexAttention), saved, resumed, then generation
# (eager against CUDA graphs, greedy; seeded sampling twice) and the evaluation CLI (WikiText
# perplexity) on that checkpoint; GPT-Neo's sliding-window attention (FlexAttention) trained with
# a sample, then K-FAC, then two --deterministic runs that must repeat; dropout with recomputation
# under the profiler; fp16 with dynamic loss scaling; --offload full. Last, alone on the GPU: a
# batch far too large must end in the one-line out-of-memory error with exit code 2 (CUDA only).
# Each step has its own time limit and the whole run a budget (--budget, seconds): a step that
# does not fit what is left is skipped and says so. $OUT gets gpu_check.json (every step: status,
# seconds, the log's last lines) and gpu_check_logs.tar.gz (every log), both rewritten when each
# step ends, so a run cut short still leaves what it found.
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=gpu_check BUDGET=540
source benchmarks/gpu_steps.sh  # parses --dry-run, --device, --budget; defines step and finish

# A 4-layer GPT-2 with the real vocabulary and T=256: two 128-token FlexAttention blocks per row.
cat > "$WORK/model.json" <<'EOF'
{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 256, "n_embd": 256, "n_layer": 4, "n_head": 4,
 "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
 "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "bos_token_id": 50256, "eos_token_id": 50256,
 "tie_word_embeddings": true}
EOF
# GPT-Neo's layout at the same size: local (128-token window) and global layers alternating.
cat > "$WORK/neo.json" <<'EOF'
{"model_type": "gpt_neo", "vocab_size": 50257, "max_position_embeddings": 256, "hidden_size": 256,
 "num_layers": 4, "num_heads": 4, "attention_types": [[["global", "local"], 2]], "window_size": 128,
 "activation_function": "gelu_new", "resid_dropout": 0.0, "embed_dropout": 0.0, "attention_dropout": 0.0,
 "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "bos_token_id": 50256, "eos_token_id": 50256,
 "tie_word_embeddings": true}
EOF
RUN=(--dataset generated --max-len 256 --batch-size 8 --gradient-accumulation 1 --device-iterations 1
     --num-workers 0 --optimizer AdamW --learning-rate 1e-3 --lr-warmup-steps 2 --log-steps 1 --device "$DEVICE"
     --torch-compile true)
TRAIN=("$PY" train_gpt2.py --model-config "$WORK/model.json" "${RUN[@]}")
NEO=("$PY" train_gpt2.py --model-config "$WORK/neo.json" "${RUN[@]}")
PACKED=(--reset-position-ids true --reset-attention-mask true --eod-mask-loss true)
printf 'The history of\nIn 1905, the\n' > "$WORK/prompts.txt"
for i in $(seq 60); do  # a WikiText-shaped file for the evaluation CLI
    printf ' = Section %s = \n The city @-@ state grew , and in 1905 its port was the largest in the region .\n' "$i"
done > "$WORK/wiki.txt"
GEN=$(printf '%q ' "$PY" text_generate_gpt2.py --model-name-or-path "$WORK/ckpt" --prompt-file "$WORK/prompts.txt" \
      --json --batch-size 2 --input-len 16 --output-len 24 --device "$DEVICE")  # one string: a bash -c script's

chain_packed_training() {  # train and save, resume, then generate from the checkpoint
    step train_bf16_packed 200 "${TRAIN[@]}" --precision bf16 "${PACKED[@]}" --training-steps 12 \
        --checkpoint-output-dir "$WORK/ckpt" --save-per-steps 6 --sample-tokens 16 --sample-prompt "The" || return
    step resume_bf16_packed 150 "${TRAIN[@]}" --precision bf16 "${PACKED[@]}" --training-steps 12 \
        --checkpoint-input-dir "$WORK/ckpt/step_6" --resume-training-from-checkpoint true \
        --checkpoint-output-dir "$WORK/ckpt_resumed" --save-per-steps 6 || return
    step losses_after_resume 30 "$PY" - "$LOGS/train_bf16_packed.log" "$LOGS/resume_bf16_packed.log" <<'EOF' || return
import re, sys
def losses(path):  # (epoch, step in epoch) -> loss
    text = open(path).read()
    return {(int(m[2]), int(m[1])): float(m[3]) for m in re.finditer(r"^step (\d+) of epoch (\d+), loss: (\S+),", text, re.M)}
first, resumed = losses(sys.argv[1]), losses(sys.argv[2])
common = sorted(set(first) & set(resumed))
print("(epoch, step)  first  resumed")
for s in common:
    print(s, first[s], resumed[s])
assert first and common and common[-1] == max(first), f"the last step is not in both runs: {sorted(first)} / {sorted(resumed)}"
worst = max(abs(first[s] - resumed[s]) for s in common)
assert worst < 0.02, f"the resumed run parts from the first by {worst:.4f}"
print(f"resumed steps {common}: largest difference {worst:.5f}")
EOF
    step generate_eager_vs_graphs 150 bash -c "
        set -e
        $GEN --bf16 --greedy > '$WORK/eager.txt'
        $GEN --bf16 --greedy --poptorch-loop > '$WORK/graphs.txt'
        $GEN --bf16 --poptorch-loop --seed 7 --topk 40 > '$WORK/sample1.txt'
        $GEN --bf16 --poptorch-loop --seed 7 --topk 40 > '$WORK/sample2.txt'
        for f in eager graphs sample1 sample2; do echo \"--- \$f\"; cat '$WORK'/\$f.txt; done
        cmp '$WORK/eager.txt' '$WORK/graphs.txt' || { echo 'CUDA-graph decode differs from eager'; exit 1; }
        cmp '$WORK/sample1.txt' '$WORK/sample2.txt' || { echo 'seeded sampling differs between runs'; exit 1; }
        echo 'greedy: CUDA graphs == eager; seeded sampling repeats'" || return
    step evaluate_wiki 120 "$PY" tasks/evaluate_wiki.py --checkpoint-input-dir "$WORK/ckpt" \
        --valid-data "$WORK/wiki.txt" --seq-length 256 --batch-size 4 --bf16 --device "$DEVICE" --no-progress \
        --output-json "$WORK/eval.json"
}

chain_neo_kfac_deterministic() {  # GPT-Neo's window, K-FAC, then determinism: one after the other
    step train_gpt_neo_window 200 "${NEO[@]}" --precision bf16 "${PACKED[@]}" --training-steps 8 \
        --sample-tokens 16 --sample-prompt "The"
    step train_kfac 200 "${TRAIN[@]}" --precision bf16 --kfac true --kfac-factor-update-steps 1 \
        --kfac-inv-update-steps 2 --training-steps 6
    local det
    det=$(printf '%q ' "${TRAIN[@]}" --precision bf16 --deterministic true --hidden-dropout 0.1 \
          --attention-dropout 0.1 --training-steps 6)
    step train_deterministic_repeats 240 bash -c "
        set -e
        $det > '$WORK/det1.log' 2>&1 || { tail -20 '$WORK/det1.log'; exit 1; }
        $det > '$WORK/det2.log' 2>&1 || { tail -20 '$WORK/det2.log'; exit 1; }
        for i in 1 2; do grep -oE '(loss|grad norm): [^,]+' '$WORK/det'\$i.log > '$WORK/det'\$i.numbers || true; done
        paste '$WORK/det1.numbers' '$WORK/det2.numbers'
        [ -s '$WORK/det1.numbers' ] || { echo 'no step lines'; exit 1; }
        cmp '$WORK/det1.numbers' '$WORK/det2.numbers' || { echo '--deterministic true: the runs differ'; exit 1; }
        echo '--deterministic true: two runs, the same losses and gradient norms'"
}

echo "gpu_check: device $DEVICE, budget ${BUDGET}s, logs in $LOGS, results in $OUT"
step env 60 bash -c "$PY -m gpt2forge.tools.machine_report; nvidia-smi || true; $PY -m pip list 2>/dev/null \
    | grep -iE '^(torch|triton|numpy|safetensors|tiktoken|tokenizers|transformers|pytest|pytest-timeout) '"
step imports 90 "$PY" - <<'EOF'
import importlib, pathlib, traceback
failed = []
for path in sorted(pathlib.Path("gpt2forge").rglob("*.py")):
    if path.stem == "__main__":
        continue  # importing it runs it
    name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    try:
        importlib.import_module(name)
    except Exception as exc:  # a missing package or an API this torch lacks
        failed.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
print(f"{len(failed)} module(s) failed to import")
raise SystemExit(1 if failed else 0)
EOF
step ops_build 150 bash -c "$PY -m gpt2forge.ops.build build --out-dir build/custom_ops && \
    $PY -c 'from gpt2forge.ops import library; print(library.build_info())'"
step memory_plan 60 "$PY" train_gpt2.py --plan --device "$DEVICE" --model gpt2-xl --max-len 1024 --batch-size 8 \
    --recompute-checkpoint-every-layer true

# Side by side from here: each step checks, none times.
CUDA_TESTS=$(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort | tr '\n' ' ')
step cuda_tests 400 "$PY" -m pytest -p no:xdist -p no:cacheprovider -m cuda -rA --timeout 200 \
    --junitxml "$LOGS/cuda_tests.xml" $CUDA_TESTS &
chain_packed_training &
chain_neo_kfac_deterministic &
step train_dropout_recompute_profiled 200 "${TRAIN[@]}" --precision bf16 --training-steps 8 \
    --hidden-dropout 0.1 --attention-dropout 0.1 --recompute-checkpoint-every-layer true \
    --profile-steps 5:6 --profile-dir "$WORK/profile" &
step train_fp16_dynamic_scaling 200 "${TRAIN[@]}" --precision fp16 --auto-loss-scaling true \
    --initial-loss-scale 65536 --training-steps 12 &
step train_offload_full 200 "${TRAIN[@]}" --precision bf16 --torch-compile false --offload full \
    --training-steps 6 &
wait
# Alone on the GPU (it fills it): far too large a batch (its logits alone would take hundreds of GiB)
# must end in one `error:` line naming the out-of-memory, exit code 2, no traceback. Not on the CPU,
# whose memory it would take.
oom=$(printf '%q ' "${TRAIN[@]}" --torch-compile false --precision bf16 --batch-size 8192 --training-steps 1)
if [ "$DEVICE" != cpu ] || [ "$DRY" = 1 ]; then
    step oom_one_line_error 150 bash -c "
        $oom > '$WORK/oom.out' 2> '$WORK/oom.err'
        rc=\$?
        tail -5 '$WORK/oom.err'
        [ \$rc = 2 ] || { echo \"exit code \$rc, not 2\"; exit 1; }
        ! grep -q Traceback '$WORK/oom.err' || { echo 'a traceback, not one line'; exit 1; }
        [ \$(grep -c '^error: ' '$WORK/oom.err') = 1 ] && grep -qi 'out of memory' '$WORK/oom.err' \
            || { echo 'no one-line out-of-memory error'; exit 1; }
        echo 'out of memory: one line, exit code 2'"
fi
[ "$DRY" = 1 ] && exit 0
cp "$WORK/profile"/*.txt "$LOGS/" 2>/dev/null
finish
echo "gpu_check: $((SECONDS - START)) s; summary $OUT/gpu_check.json"
"$PY" -c "import json,sys; s=json.load(open(sys.argv[1]))['steps']; \
[print(f'{k:34s} {v[\"status\"]:8s} {v[\"seconds\"]:4d} s') for k,v in s.items()]; \
sys.exit(any(v['status'] != 'ok' for v in s.values()))" "$OUT/gpu_check.json"
