#!/usr/bin/env bash
# Zero-shot evaluation of a GPT-2 checkpoint (ours or a Hugging Face GPT-2 directory).
#
#   bash tasks/run_evaluate.sh wiki|lmbd [CHECKPOINT [DATA]] [extra flags...]
#
# CHECKPOINT and DATA may also come from $CHECKPOINT_PATH and $DATA_PATH. Default DATA: the cached
# wiki.test.tokens or lambada_test.jsonl that `make eval-data` (gpt2forge-fetch-data) puts in
# $GPT2FORGE_EVAL_DATA or ~/.cache/gpt2forge/eval-data.
# Protocol settings (environment): SEQ_LEN (the model's n_positions: 1024 for GPT-2), STRIDE (32,
# wiki: the reference's --overlapping-eval), STRICT (false, lmbd), BATCH_SIZE (8), PRECISION (auto),
# TOKENIZER_TYPE (0), OUTPUT_JSON (results/<task>.json). Extra flags go to the Python script unchanged.
set -euo pipefail

usage() {
    echo "usage: bash tasks/run_evaluate.sh wiki|lmbd [CHECKPOINT [DATA]] [flags...]" \
         "(or set CHECKPOINT_PATH / DATA_PATH)" >&2
    exit 2
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

[ $# -ge 1 ] || usage
TASK="$1"; shift
case "$TASK" in
    wiki) SCRIPT=evaluate_wiki.py; SET=wikitext ;;
    lmbd) SCRIPT=evaluate_lambada.py; SET=lambada ;;
    *) echo "error: dataset should be 'wiki' or 'lmbd' (got '$TASK')" >&2; usage ;;
esac

CHECKPOINT="${CHECKPOINT_PATH:-}"
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then CHECKPOINT="$1"; shift; fi
DATA="${DATA_PATH:-}"
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then DATA="$1"; shift; fi
if [ -z "$CHECKPOINT" ]; then echo "error: no checkpoint (argument 2 or \$CHECKPOINT_PATH)" >&2; usage; fi
if [ -z "$DATA" ]; then  # the cached set, or the one-line message naming the fetch command (exit 2)
    DATA="$(cd "$ROOT" && "$PYTHON" -m gpt2forge.evaluation.fetch path "$SET")" || exit 2
fi

OUTPUT_JSON="${OUTPUT_JSON:-results/$TASK.json}"
ARGS=(--checkpoint-input-dir "$CHECKPOINT" --valid-data "$DATA"
      --batch-size "${BATCH_SIZE:-8}" --precision "${PRECISION:-auto}" --tokenizer-type "${TOKENIZER_TYPE:-0}"
      --output-json "$OUTPUT_JSON")
# Without SEQ_LEN the script reads the model's whole context (1024 for GPT-2, 128 for `make train`'s model).
if [ -n "${SEQ_LEN:-}" ]; then ARGS+=(--seq-length "$SEQ_LEN"); fi
if [ "$TASK" = wiki ]; then
    ARGS+=(--overlapping-eval "${STRIDE:-32}")
else
    ARGS+=(--strict-lambada "${STRICT:-false}")
fi
exec "$PYTHON" "$ROOT/tasks/$SCRIPT" "${ARGS[@]}" "$@"
