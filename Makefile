# Quick start: `make train` (set up if needed, pretrain a small GPT-2 on the embedded corpus) and
# `make test` (lint, then the whole suite; `make test-fast` leaves out the tests marked slow). Bare `make`
# builds the custom ops library (the first target, as in the reference).
#
# CUDA users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" train
# Another torch and Python, in a venv of its own (the default .venv is untouched):
#   make test PYTHON_SYS=python3.12 TORCH_SPEC=torch==2.11.0 VENV=.venv-torch2.11
PYTHON_SYS ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
# The library is built against one torch's ABI, so each venv has its own: build/custom_ops for .venv,
# build/<venv name>/custom_ops for another (gpt2forge.ops.library.library_path derives the same from the interpreter).
OPS_DIR    := build/$(if $(filter .venv,$(notdir $(VENV))),,$(notdir $(VENV))/)custom_ops
OPS_LIB    := $(OPS_DIR)/gpt2forge_ops.so
OPS_SRC    := $(wildcard custom_ops/*.cpp custom_ops/*.cu custom_ops/*.h)
VOCAB      := gpt2forge/assets/gpt2.tiktoken
CORPUS     := build/stdlib_docs.pkl
CKPT_DIR   ?= checkpoints/mini

# The main job: a 4-layer GPT-2 (GPT-2 BPE, 128 tokens of context) on the Python standard library's
# documentation, a few minutes on 2 CPU cores. Muon for the blocks' matrices at the peak LR 3e-3, AdamW
# for the rest at 1.2e-2: the recipe sweeps against nanoGPT chose (docs/benchmarks.md, learning per second).
# auto: bf16 or fp32, whichever a probe measured faster on this CPU (gpt2forge.core.precision; the
# start-up line says which and why). The compiled step is cached in build/compile_cache across runs.
PRECISION  ?= auto
TRAIN_ARGS ?= --model-config config/config_mini.json --dataset pickle --input-files $(CORPUS) \
	--max-len 128 --stride 128 --val-num 64 --batch-size 8 --gradient-accumulation 1 \
	--device-iterations 1 --training-steps 300 --optimizer Muon --learning-rate 1.2e-2 --muon-learning-rate 3e-3 \
	--lr-schedule cosine --lr-warmup-steps 20 --weight-decay 0.1 --max-grad-norm 1.0 \
	--precision $(PRECISION) --torch-compile true --executable-cache-dir build/compile_cache \
	--num-workers 0 --log-steps 20 --eval-every-steps 150 \
	--checkpoint-output-dir $(CKPT_DIR) --save-per-steps 150 --sample-tokens 60 --sample-prompt "The module"

.PHONY: all custom_ops setup train lint test test-fast chaos fuzz bench class-check eval-data clean distclean

all: custom_ops

custom_ops: $(OPS_LIB)

$(OPS_LIB): $(STAMP) $(OPS_SRC) gpt2forge/ops/build.py
	$(PY) -m gpt2forge.ops.build build --out-dir $(@D)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -r requirements.txt
	# Megatron-Core: the oracle of the data, schedule and document-mask tests (its wheel declares
	# Python >= 3.12 and heavy dependencies; the dataset code runs on 3.11 with torch and numpy alone).
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2 || \
		echo "megatron-core not installed: the tests that compare with it will skip"
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(VOCAB): $(STAMP)
	$(PY) -m gpt2forge.text.vocab

setup: $(STAMP) $(VOCAB) $(OPS_LIB)

$(CORPUS): $(STAMP) $(VOCAB)
	$(PY) data/build_default_corpus.py --output $@

train: setup $(CORPUS)
	$(PY) train_gpt2.py $(TRAIN_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

# The whole suite, the layout and end-to-end tests included: what CI runs (.ci/run), 10 minutes of pytest on 2 cores.
# PYTEST_ARGS: more pytest arguments (CI's second leg: -m "not data_only").
PYTEST_ARGS ?=
test: setup lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Leaves out the tests marked slow (over 3 s: torchrun, compiled graphs, end-to-end runs of shipped scripts).
# Budget: 2 minutes on 2 cores of every CPU class; its pytest ends with the tier's total and cases over 3 s
# (tests/conftest.py). 2-core AVX-512 EPYC (avx512_bf16, no AMX), 2026-11-30, fresh checkout, at ff2c5ec + the
# netns case moved to the full suite: 98 s wall for `make test-fast` (`time make test-fast`, load 0.8 at the
# start), 1,271 passed (at ef3297e, the first run after setup: 115 s). The AVX2-only EPYC is not measured since
# it took 498 s (before the split of 2026-11-29). The AVX2 class's kernels forced on this machine
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 GPT2FORGE_OPS_ISA=avx2: bf16
# matmuls emulated, as on that class), 2026-11-30 at ef3297e: pytest -m "not slow" 99 s wall, 1,272 passed.
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow"

# Multi-node launches and faults on a cluster of network namespaces built on this machine (tests/cluster,
# docs/multinode.md): the parity cases and every fault case; needs root (skipped otherwise). make test runs
# the harness, one parity case and one fault case.
chaos: setup
	GPT2FORGE_CHAOS=1 $(PY) -m pytest -q tests/cluster

# Long fuzz run of every input format (tests/fuzz): make fuzz N=100000; prints cases and failures per format,
# each failure with the seed that reproduces it; then every train_gpt2.py flag with bad values, each a short run.
N ?= 10000
fuzz: setup
	$(PY) tests/fuzz/run.py --cases $(N)
	$(PY) tests/fuzz/flags.py --run

# WikiText and LAMBADA test sets from the Hugging Face hub into ~/.cache/gpt2forge/eval-data (sha256 checked);
# EVAL_DATA_ARGS="--from DIR" imports local copies instead.
EVAL_DATA_ARGS ?=
eval-data: $(STAMP)
	$(PY) -m gpt2forge.evaluation.fetch all $(EVAL_DATA_ARGS)

# make bench BENCH=<benchmark, variant or group> (groups: cpu, cpu-host, cuda, all; see benchmarks.yml)
BENCH      ?= cpu
BENCH_ARGS ?=
bench: setup
	$(PY) -m gpt2forge.benchmark_runner --spec benchmarks.yml --benchmark $(BENCH) $(BENCH_ARGS)

# This CPU's class (from its flags) checked in minutes: decode against the same-run bandwidth floor, training against
# transformers, the fused LM-head op against the plain one; the record goes to build/class_check.jsonl and the output says
# which of docs/benchmarks.md's figures for the class it contradicts (benchmarks/class_check.py; about 6 minutes on 2 cores).
# make class-check CLASS_CHECK_ARGS="--checks decode --wait-quiet 120"
class-check: setup
	$(PY) benchmarks/class_check.py $(CLASS_CHECK_ARGS)

clean:
	test -x $(PY) && $(PY) -m gpt2forge.ops.build clean --out-dir $(OPS_DIR) || rm -f $(OPS_LIB)

distclean: clean
	rm -rf $(VENV) build gpt2forge/assets
