#!/usr/bin/env bash
# The CUDA checks and benchmarks in one go, for a GPU machine whose python3 already holds a CUDA
# torch (no virtual environment, nothing downloaded: the GPT-2 BPE files in gpt2forge/assets/ must
# be there, e.g. copied from a machine where `make` ran). Logs and JSON go to $OUT (default
# gpu_results/). Each phase fits in about ten minutes on one H100:
#
#   bash benchmarks/gpu_session.sh tests    # environment, custom ops build, tests/test_cuda.py
#   bash benchmarks/gpu_session.sh train    # training tokens/s + MFU vs transformers, GPT-2 small T=1024
#   bash benchmarks/gpu_session.sh ops      # LM-head op and whole-step memory, generation latency
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

run() {  # run NAME CMD...: the command's output to the console and $OUT/NAME.log
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

case "${1:-tests}" in
tests)
    run env "$PY" -m gpt2forge.tools.machine_report
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.csv"
    run ops_build "$PY" -m gpt2forge.ops.build build --out-dir build/custom_ops
    run test_cuda "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py
    run test_plan "$PY" train_gpt2.py --plan --device cuda --model gpt2-xl --max-len 1024 --batch-size 8 \
        --recompute-checkpoint-every-layer true
    ;;
train)
    run train_bf16 "$PY" benchmarks/train_throughput.py --device cuda --precisions bf16 --model gpt2 \
        --batch-size 16 --seq-len 1024 --steps 20 --warmup 3 --json "$OUT/train_bf16.json"
    ;;
ops)
    run lm_head_op "$PY" benchmarks/lm_head_memory.py op --device cuda --tokens 16384 --repeats 5
    run lm_head_op_bf16 "$PY" benchmarks/lm_head_memory.py op --device cuda --tokens 16384 --repeats 5 \
        --precision bf16
    run lm_head_train "$PY" benchmarks/lm_head_memory.py train --device cuda --batch-size 16 --seq-len 1024 \
        --precision bf16
    run generation "$PY" benchmarks/generation_latency.py --device cuda --json "$OUT/generation.json"
    ;;
*)
    echo "usage: $0 tests|train|ops" >&2
    exit 2
    ;;
esac
