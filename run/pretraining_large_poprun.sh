#!/usr/bin/env bash
# Stand-in: the reference's PopRun launch of gpt2-large over an IPU Pod has no PopRun here; several nodes run
# through torchrun with run/pretraining_large_multinode.sh (docs/parallel.md, "Several nodes").
echo "error: run/pretraining_large_poprun.sh: PopRun is replaced by torchrun; on every node run NNODES=<nodes>" \
     "NODE_RANK=<0..nodes-1> MASTER_ADDR=<node 0 host> bash run/pretraining_large_multinode.sh" >&2
exit 2
