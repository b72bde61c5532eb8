#!/bin/bash
# Seed 002's pretrain.pbs (../shared/reference/seeds/002_*.txt), as a user runs gpt2forge with it:
# the launch part verbatim; the Polaris lines (#PBS resources, module loads, the venv) left out,
# OPTIONS from the command line, train_gpt2.py for `-m llm.trainers.gpt`, and OMP_NUM_THREADS from
# $OMP_THREADS (default 8 as in the seed; the tests pass 1: 2 processes share a 2-core node).
# tests/cluster/test_launch_styles.py runs it on namespaced nodes with a stand-in mpiexec.
OPTIONS="$*"

# Figure out training environment based on PBS_NODEFILE existence
if [[ -z "${PBS_NODEFILE}" ]]; then
    RANKS=$HOSTNAME
    NNODES=1
else
    PRIMARY_RANK=$(head -n 1 $PBS_NODEFILE)
    RANKS=$(tr '\n' ' ' < $PBS_NODEFILE)
    NNODES=$(< $PBS_NODEFILE wc -l)
    cat $PBS_NODEFILE
fi

# torchrun launch configuration
LAUNCHER="torchrun "
LAUNCHER+="--nnodes=$NNODES --nproc_per_node=auto --max_restarts 0 "
if [[ "$NNODES" -eq 1 ]]; then
    LAUNCHER+="--standalone "
else
    LAUNCHER+="--rdzv_backend=c10d --rdzv_endpoint=$PRIMARY_RANK"
fi

# Training script and parameters
CMD="$LAUNCHER train_gpt2.py $OPTIONS"
echo "Training Command: $CMD"

mpiexec --hostfile $PBS_NODEFILE -np $NNODES --env OMP_NUM_THREADS=${OMP_THREADS:-8} --cpu-bind none $CMD
