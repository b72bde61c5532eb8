#!/usr/bin/env bash
# Text generation with a KV cache from a GPT-2 checkpoint (ours or a Hugging Face GPT-2 directory).
#
#   bash tasks/run_text_generator.sh [CHECKPOINT] [extra flags...]
#
# CHECKPOINT may also come from $CHECKPOINT_PATH (default: checkpoints/mini, what `make train` writes).
# The reference ran GPT-2 small in fp16 on one IPU with --output-len 256; here the device is
# --device auto (CUDA when visible, else CPU) and fp16 is used only on CUDA (PRECISION=fp16|bf16|fp32
# overrides). Without --prompt it is interactive (`Input: `; an empty line or EOF ends). Examples:
#   bash tasks/run_text_generator.sh checkpoints/mini --prompt "The module" --output-len 40
#   CHECKPOINT_PATH=/path/to/hf-gpt2 bash tasks/run_text_generator.sh --topk 40 --temperature 0.8
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

CHECKPOINT="${CHECKPOINT_PATH:-$ROOT/checkpoints/mini}"
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then CHECKPOINT="$1"; shift; fi
if [ ! -e "$CHECKPOINT" ]; then
    echo "error: checkpoint $CHECKPOINT not found; run \`make train\` or pass one" >&2
    echo "usage: bash tasks/run_text_generator.sh [CHECKPOINT] [--prompt TEXT] [--output-len N] [flags...]" >&2
    exit 2
fi

PRECISION_FLAGS=()
case "${PRECISION:-auto}" in
    fp16) PRECISION_FLAGS=(--fp16) ;;
    bf16) PRECISION_FLAGS=(--bf16) ;;
    fp32) ;;
    auto) if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
              PRECISION_FLAGS=(--fp16); fi ;;
    *) echo "error: PRECISION must be auto, fp32, bf16 or fp16 (got ${PRECISION})" >&2; exit 2 ;;
esac

exec "$PYTHON" "$ROOT/text_generate_gpt2.py" --model-name-or-path "$CHECKPOINT" --output-len "${OUTPUT_LEN:-256}" \
    --topk "${TOPK:-4}" "${PRECISION_FLAGS[@]}" "$@"
