"""Seed 004: the reference's own README (Graphcore's PyTorch GPT-2 for the IPU). Each of its command
lines runs here as written, or gives the one line that names its replacement.

A table row is the README's line; sizes shrink by flags appended after it (the last value of a flag
wins): a 32-wide model of the line's depth, 32 tokens, gradient accumulation 1 (times the replicas
one process stands in for), one step, --device cpu.
Paths are temporary files. Not run here: `pip install`, `make` (tests/ops build the custom ops),
`python3 -m pytest`, `./data/wikipedia_download.sh` (the network; its data comes in as an extracted
AA/wiki_00 file), `./data/wikipedia_extract.sh` (run on a tiny dump in tests/preprocess/test_preprocess.py)
and `bash tasks/run_text_generator.sh` (tests/evaluation/test_evaluation.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2forge.cli import generate_main, train_main

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step \d+ of epoch \d+, loss: \S+, acc: \S+, lr: \S+, throughput: \S+ samples/sec", re.M)

QUICK_START = """--model gpt2 --max-len 1024 --layers-per-ipu 0 4 4 4 --matmul-proportion 0.15 0.15 0.15 0.15
    --ipus-per-replica 4 --replication-factor 1 --epochs 3 --gradient-accumulation 512 --device-iterations 1
    --batch-size 1 --enable-sequence-serialized True --remap-logit True --embedding-serialization-factor 4
    --recompute-checkpoint-every-layer True --enable-half-partials True --train-path 'generated'
    --compile-only False"""
SMALL = """--model gpt2 --max-len 1024 --optimizer AdamW --learning-rate 0.00015 --lr-schedule cosine
    --lr-warmup 0.01 --layers-per-ipu 0 4 4 4 --matmul-proportion 0.15 0.15 0.15 0.15 --ipus-per-replica 4
    --replication-factor 4 --epochs 20 --gradient-accumulation 2048 --device-iterations 8 --batch-size 1
    --enable-sequence-serialized True --remap-logit True --embedding-serialization-factor 4
    --recompute-checkpoint-every-layer True --enable-half-partials True --train-path 'generated'
    --replicated-tensor-sharding True --compile-only False"""
MEDIUM = """--model gpt2-medium --max-len 1024 --optimizer AdamW --learning-rate 0.00015 --lr-schedule cosine
    --lr-warmup 0.01 --layers-per-ipu 0 3 3 3 3 4 4 4 --matmul-proportion 0.30 0.15 0.15 0.15 0.15 0.15 0.15 0.15
    --ipus-per-replica 8 --replication-factor 2 --epochs 20 --gradient-accumulation 4096 --device-iterations 8
    --batch-size 1 --enable-sequence-serialized True --remap-logit True --embedding-serialization-factor 4
    --recompute-checkpoint-every-layer True --enable-half-partials True --train-path 'generated'
    --replicated-tensor-sharding True --compile-only False"""
LARGE_512 = """--model gpt2-large --max-len 512 --optimizer AdamW --learning-rate 0.00015 --lr-schedule cosine
    --lr-warmup 0.01 --layers-per-ipu 1 5 5 5 5 5 5 5 --matmul-proportion 0.15 0.12 0.15 0.15 0.15 0.15 0.15 0.15
    --ipus-per-replica 8 --replication-factor 2 --epochs 20 --gradient-accumulation 4096 --device-iterations 8
    --batch-size 1 --enable-sequence-serialized True --remap-logit True --embedding-serialization-factor 8
    --recompute-checkpoint-every-layer True --enable-half-partials True --train-path 'generated'
    --replicated-tensor-sharding True --compile-only False"""
LARGE_1024 = """--model gpt2-large --max-len 1024 --optimizer AdamW --learning-rate 0.00015 --lr-schedule cosine
    --lr-warmup 0.01 --layers-per-ipu 0 2 2 2 2 2 2 2 2 3 3 3 3 3 3 2
    --matmul-proportion 0.2 0.15 0.2 0.2 0.2 0.15 0.15 0.2 0.2 0.15 0.2 0.2 0.2 0.15 0.15 0.2
    --ipus-per-replica 16 --replication-factor 1 --epochs 20 --gradient-accumulation 8192 --device-iterations 8
    --batch-size 1 --enable-sequence-serialized True --remap-logit True --embedding-serialization-factor 4
    --recompute-checkpoint-every-layer True --enable-half-partials True --train-path 'generated'
    --replicated-tensor-sharding False --compile-only False"""
TRAINING_LINES = {"quick start": QUICK_START, "GPT2-small": SMALL, "GPT2-medium": MEDIUM,
                  "GPT2-large (SL=512)": LARGE_512, "GPT2-large (SL=1024)": LARGE_1024}
"""`python train_gpt2.py ...` in the README's sections."""


def shrink(config: Path, layers: int) -> list[str]:
    return ["--model-config", str(config), "--num-layers", str(layers), "--max-len", "32", "--gradient-accumulation",
            "1", "--device-iterations", "1", "--training-steps", "1", "--num-workers", "0", "--device", "cpu"]


def layers_of(line: str) -> int:
    argv = shlex.split(line)
    counts = argv[argv.index("--layers-per-ipu") + 1:argv.index("--matmul-proportion")]
    return sum(map(int, counts))


def script_main(path: str):
    """The `main` of a script in data/ (run in this process: no interpreter start per row)."""
    return runpy.run_path(str(ROOT / path), run_name="seed_004")["main"]


@pytest.fixture()
def tiny(make_tiny_config) -> Path:
    """A 32-wide GPT-2 with GPT-2's vocabulary (the README's data is GPT-2 BPE)."""
    return make_tiny_config(vocab_size=50257, n_positions=32)


@pytest.mark.parametrize("name", TRAINING_LINES)
def test_readme_training_lines_run(name, tiny, capsys):
    line = TRAINING_LINES[name]
    assert train_main([*shlex.split(line), *shrink(tiny, layers_of(line))]) == 0
    out = capsys.readouterr().out
    assert len(STEP.findall(out)) == 1, out[-2000:]
    assert "Embedding --> stage 0" in out and f"Layer {layers_of(line) - 1:<2} --> stage" in out


@pytest.mark.slow
def test_run_script_runs_as_written_with_extra_flags(tiny):
    """`bash run/pretraining_small.sh` (torchrun through run/launch.sh), flags appended as the script allows."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(["bash", "run/pretraining_small.sh", *shrink(tiny, 12)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(STEP.findall(proc.stdout)) == 1


STAND_INS = [
    (["bash", "run/pretraining_large_poprun.sh"],
     "error: run/pretraining_large_poprun.sh: PopRun is replaced by torchrun; on every node run NNODES=<nodes> "
     "NODE_RANK=<0..nodes-1> MASTER_ADDR=<node 0 host> bash run/pretraining_large_multinode.sh"),
    ([sys.executable, "-m", "examples_utils", "benchmark", "--spec", "benchmarks.yml"],
     "error: examples_utils benchmark is Graphcore's runner; here it is `python -m gpt2forge.benchmark_runner --spec "
     "benchmarks.yml` (docs/benchmarks.md)"),
    ([sys.executable, "-m", "examples_utils", "benchmark", "--spec", "benchmarks.yml", "--benchmark", "gpt2_cpu"],
     "here it is `python -m gpt2forge.benchmark_runner --spec benchmarks.yml --benchmark gpt2_cpu`"),
    ([sys.executable, "-m", "examples_utils", "benchmark", "--spec", "benchmarks.yml", "--profile"],
     "here it is `python -m gpt2forge.benchmark_runner --spec benchmarks.yml --profile`"),
]


@pytest.mark.parametrize("argv,line", STAND_INS, ids=["poprun", "benchmark", "benchmark NAME", "profile"])
def test_reference_names_that_went_say_where_in_one_line(argv, line):
    """Issue 46 item 10: `bash run/pretraining_large_poprun.sh` and `python3 -m examples_utils benchmark`
    (the reference's names) were 'No such file' and 'No module named examples_utils'."""
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and line in proc.stderr, proc.stderr


def test_the_named_replacements_exist_and_take_those_flags():
    from gpt2forge.benchmark_runner.cli import build_parser

    args = build_parser().parse_args(["--spec", "benchmarks.yml", "--benchmark", "gpt2_cpu", "--profile"])
    assert args.spec == ["benchmarks.yml"] and args.profile
    assert (ROOT / "run" / "pretraining_large_multinode.sh").is_file() and (ROOT / "benchmarks.yml").is_file()


WIKI_DOC = ('<doc id="{i}" url="https://en.wikipedia.org/wiki?curid={i}" title="Article {i}">\nArticle {i}\n\n'
            "{body}\n</doc>\n")
"""One article as WikiExtractor writes it into AA/wiki_00."""


@pytest.mark.slow
def test_data_paths_of_the_readme_train(tiny, tmp_path, monkeypatch, capsys):
    """Generate pretraining data (WikiExtractor's output -> .pkl), the TFRecord and the Megatron
    dataset sections, each then trained on with the README's flags."""
    extracted = tmp_path / "extracted" / "AA"
    extracted.mkdir(parents=True)
    body = " ".join(f"The module number {n} defines a class and returns its value." for n in range(40))
    (extracted / "wiki_00").write_text("".join(WIKI_DOC.format(i=i, body=body) for i in range(12)))
    out = tmp_path / "preprocessed"
    main = script_main("data/wikipedia_preprocess.py")
    assert main(["--input-file-path", str(tmp_path / "extracted"), "--output-file-path", str(out)]) == 0
    [pkl] = out.glob("*.pkl")
    run = shrink(tiny, 2)

    assert train_main(["--train-path", str(pkl), *run]) == 0  # "passing path to processed data files"
    # TFRecord: `cd <chosen-folder-for-preprocessed-files>; mkdir tfrecords; python write_into_tfrecord.py`,
    # then `for f in *.tfrecord; do python3 -m tfrecord.tools.tfrecord2idx $f `basename $f .tfrecord`.index; done`
    monkeypatch.chdir(out)
    (out / "tfrecords").mkdir()
    assert script_main("data/write_into_tfrecord.py")([]) == 0
    for f in sorted((out / "tfrecords").glob("*.tfrecord")):
        subprocess.run([sys.executable, "-m", "tfrecord.tools.tfrecord2idx", f.name, f"{f.stem}.index"],
                       cwd=f.parent, check=True, capture_output=True, timeout=60)
    assert train_main(["--train-path", "tfrecord", "--tfrecord-path", str(out / "tfrecords" / "*.tfrecord"),
                       *run]) == 0
    # Megatron dataset: my-gpt2_text_document.{bin,idx} (preprocess_data.py), `--train-path dynamic`.
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Article {i}. {body}"}) + "\n" for i in range(12)))
    preprocess = script_main("data/preprocess_data.py")
    assert preprocess(["--input", str(corpus), "--output-prefix", str(tmp_path / "my-gpt2"), "--tokenizer-type",
                       "GPT2BPETokenizer", "--append-eod", "--workers", "1"]) == 0
    assert train_main(["--train-path", "dynamic", "--data-prefix", str(tmp_path / "my-gpt2_text_document"),
                       *run]) == 0
    assert len(STEP.findall(capsys.readouterr().out)) == 3


@pytest.fixture()
def hf_folder(tmp_path) -> Path:
    """A tiny Hugging Face GPT-2 folder in place of the hub's `gpt2`."""
    transformers = pytest.importorskip("transformers", reason="writes the Hugging Face folder")
    import torch

    from gpt2forge.text.tokenizer import asset_dir

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=320, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    transformers.GPT2TokenizerFast.from_pretrained(str(asset_dir())).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_evaluation_lines_run(hf_folder, tmp_path):
    """`bash tasks/run_evaluate.sh wiki` and `... lmbd`, the checkpoint and data given as the script's
    environment says (the README's lines name neither)."""
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(" = Article = \n\n The module defines a class , and returns its value . \n" * 30)
    lambada = tmp_path / "lambada_test.jsonl"
    lambada.write_text("".join(json.dumps({"text": f"the module defines a class and returns its value {w}"}) + "\n"
                               for w in ("value", "class", "module")))
    env = {**os.environ, "CHECKPOINT_PATH": str(hf_folder), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
           "SEQ_LEN": "64"}
    for task, data, metric in (("wiki", wiki, "adjusted ppl: "), ("lmbd", lambada, "avg accuracy: ")):
        proc = subprocess.run(["bash", str(ROOT / "tasks" / "run_evaluate.sh"), task], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env={**env, "DATA_PATH": str(data)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert metric in proc.stdout and (tmp_path / "results" / f"{task}.json").is_file(), proc.stdout[-2000:]


@pytest.mark.slow
def test_text_generation_line_runs(hf_folder, monkeypatch, capsys):
    """`python text_generate_gpt2.py --model-name-or-path gpt2 --fp16 true --single-ipu true
    --poptorch-loop true --output-len 256` (the hub name swapped for a local folder), interactive: one
    prompt, then an empty line ends it. (`bash tasks/run_text_generator.sh` runs in
    tests/evaluation/test_evaluation.py.)"""
    monkeypatch.setattr("sys.stdin", io.StringIO("My name is \n\n"))
    argv = ["--model-name-or-path", str(hf_folder), "--fp16", "true", "--single-ipu", "true", "--poptorch-loop",
            "true", "--output-len", "256"]
    assert generate_main(argv) == 0
    assert "My name is" in capsys.readouterr().out
