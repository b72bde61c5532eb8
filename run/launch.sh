# Sourced by run/pretraining_*.sh: `launch SCRIPT ARGS...` starts SCRIPT under torchrun.
#
# One node (default): torchrun --standalone --nproc_per_node $NPROC_PER_NODE (default 1; one process
# per GPU, e.g. NPROC_PER_NODE=4 for --replication-factor 4). Replicas without a process become
# gradient accumulation, so every command runs on any number of processes with the same global batch.
# Several nodes: set NNODES and MASTER_ADDR (and MASTER_PORT, default 29500) on every node, and NODE_RANK
# (0..NNODES-1) where the scheduler gives one: the nodes then meet at MASTER_ADDR:MASTER_PORT in that
# order (torchrun's static rendezvous), so rank 0, which logs and writes checkpoints, runs on node 0.
# Without NODE_RANK the rendezvous is torchrun's c10d backend, which numbers the nodes itself (rank 0
# lands on any node). Either way every node runs the same command and nodes may start in any order.
# MAX_RESTARTS=N lets torchrun restart the workers up to N times after a failure; with --auto-resume
# and --checkpoint-output-dir they continue from the latest checkpoint.
# PYTHON overrides the interpreter (default: .venv/bin/python, else python3).
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

launch() {
    local nnodes=${NNODES:-1}
    local rdzv=(--standalone)
    if [ "$nnodes" -gt 1 ]; then
        : "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host (node 0) when NNODES > 1}"
        if [ -n "${NODE_RANK:-}" ]; then
            rdzv=(--nnodes "$nnodes" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
                  --master_port "${MASTER_PORT:-29500}")
        else
            rdzv=(--nnodes "$nnodes" --rdzv_backend c10d
                  --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-gpt2forge}")
        fi
    fi
    local restarts=()
    if [ -n "${MAX_RESTARTS:-}" ]; then
        restarts=(--max_restarts "$MAX_RESTARTS")
        # Restarted workers must not share the rendezvous store: they would read the previous
        # attempt's addresses and fail to connect (pytorch/pytorch#135712).
        export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    fi
    exec "$PY" -m torch.distributed.run "${rdzv[@]}" "${restarts[@]}" --nproc_per_node "${NPROC_PER_NODE:-1}" "$@"
}
