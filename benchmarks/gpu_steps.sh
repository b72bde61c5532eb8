# Shared by benchmarks/gpu_check.sh and gpu_measure.sh (sourced, never run): the work folder, the
# step runner with its per-step limit and the run's budget, and the summary written to $OUT when
# each step ends (steps that run side by side included). The caller sets NAME (of its results) and BUDGET (its default, seconds), cd's to the
# repository's root, and sources this with its own arguments.
ROOT=$PWD
DEVICE=cuda
DRY=0
while [ $# -gt 0 ]; do
    case $1 in
    --dry-run) DRY=1 ;;
    --device) DEVICE=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    *) echo "error: unknown argument $1; use --dry-run, --device cuda|cpu, --budget SECONDS" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/$NAME.XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor  # one cache for every step: the same shapes compile once
START=$SECONDS

finish() {  # the summary and the logs into $OUT (after every step, so a cut-short run keeps them)
    # Steps run side by side: one writer at a time (flock where the machine has it), each file
    # written aside and renamed into place, so a reader never sees half of one.
    if command -v flock > /dev/null; then
        { flock 9; write_summary; } 9> "$WORK/.summary.lock"
    else
        write_summary
    fi
}

write_summary() {
    "$PY" - "$LOGS" "$OUT/$NAME.json" "$DEVICE" "$((SECONDS - START))" <<'EOF'
import json, os, pathlib, sys
logs, out, device, seconds = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
steps = {}
for status in sorted(logs.glob("*.status")):
    name = status.stem
    rc, secs = status.read_text().split()
    log = logs / f"{name}.log"
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
    steps[name] = {"status": "ok" if rc == "0" else ("timeout" if rc in ("124", "137") else
                   ("skipped" if rc == "skip" else "failed")), "rc": rc, "seconds": int(secs), "tail": tail}
with open(out + ".part", "w") as f:
    json.dump({"device": device, "seconds": seconds, "steps": steps}, f, indent=1)
os.replace(out + ".part", out)
EOF
    tar -czf "$OUT/${NAME}_logs.tar.gz.part" -C "$WORK" logs 2>/dev/null && \
        mv "$OUT/${NAME}_logs.tar.gz.part" "$OUT/${NAME}_logs.tar.gz"
}

step() {  # step NAME LIMIT CMD...: run CMD under LIMIT seconds (less if the budget is short), log it
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$DRY" = 1 ]; then
        echo "[$name, ${limit}s] $*"
        return 0
    fi
    if [ "$left" -lt 20 ]; then
        echo "skipped: $left s of the budget left" > "$LOGS/$name.log"
        echo "skip 0" > "$LOGS/$name.status"
        echo "== $name: skipped ($left s left)"
        finish
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "$rc $((SECONDS - t0))" > "$LOGS/$name.status"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    finish
    return $rc
}

