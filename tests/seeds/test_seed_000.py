"""Seed 000 (a Turkish GPT-2 project's README, after Megatron-DeepSpeed's) as its users type it: each
command line of the seed, copied as written into the tables below, runs here or ends in the one line that
names the replacement.

Only the paths are swapped (the corpus, the vocabulary files, the prefixes, the checkpoint folder: small
files in tmp_path; `tools/` is `data/` here, `SCRIPTS`) and the sizes shrunk (`SHRINK`: a 2-layer model, 3
iterations, one worker). The commands run in this process, through the files that stand for the seed's.

Left out, with the reason: the git clone / pip / apex / deepspeed installs; `wget` and `xz -d` (nothing is
downloaded: the rows use local files); the `deepspeed --num_gpus N` launcher itself (docs/megatron.md: use
torchrun; `pretrain_gpt.py` runs as written under `python`); the SLURM/`torch.distributed.launch`
multi-node block (tests/cluster).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shlex
from pathlib import Path

import pytest

from gpt2forge.text.tokenizer import asset_dir

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "tools/preprocess_data.py": ("data/preprocess_data.py", "main"),
    "tools/merge_preprocessed_data.py": ("data/merge_preprocessed_data.py", "main"),
    "tools/preprocess_data_many_cores.py": ("data/preprocess_data_many_cores.py", "main"),
    "pretrain_gpt.py": ("pretrain_gpt.py", "megatron_main"),
}
"""The seed's script -> (the file here, its entry function)."""

PREPROCESS = """python tools/preprocess_data.py \\
    --input my-corpus.json \\
    --output-prefix my-gpt2 \\
    --vocab gpt2-vocab.json \\
    --dataset-impl mmap \\
    --tokenizer-type GPT2BPETokenizer \\
    --merge-file gpt2-merges.txt \\
    --append-eod \\
    --workers 8"""

MERGE = """python tools/merge_preprocessed_data.py \\
    --datasets \\
    meg-gpt2-oscar-en-500-p1_text_document \\
    meg-gpt2-oscar-en-500-p2_text_document \\
    meg-gpt2-oscar-en-500-p3_text_document \\
    --output-prefix meg-gpt2_oscar_text_document"""

QUICK_PREPROCESS = """python tools/preprocess_data.py \\
    --input oscar-1GB.jsonl \\
    --output-prefix my-gpt2 \\
    --vocab gpt2-vocab.json \\
    --dataset-impl mmap \\
    --tokenizer-type GPT2BPETokenizer \\
    --merge-file gpt2-merges.txt \\
    --append-eod \\
    --workers 8"""

HF_TOKENIZER = ("python tools/preprocess_data.py --input ~/c4_en_train.jsonl --output-prefix c4_en_train "
                "--dataset-impl mmap --tokenizer-type PretrainedFromHF --tokenizer-name-or-path t5-small --workers 30 "
                "--append-eod")

GPT_ARGS = """ \\
    --num-layers 24 \\
    --hidden-size 1024 \\
    --num-attention-heads 16 \\
    --seq-length 1024 \\
    --max-position-embeddings 1024 \\
    --micro-batch-size 4 \\
    --global-batch-size 8 \\
    --lr 0.00015 \\
    --train-iters 500000 \\
    --lr-decay-iters 320000 \\
    --lr-decay-style cosine \\
    --vocab-file $VOCAB_FILE \\
    --merge-file $MERGE_FILE \\
    --lr-warmup-fraction .01 \\
    --fp16 \\
    """
OUTPUT_ARGS = """ \\
    --log-interval 10 \\
    --save-interval 500 \\
    --eval-interval 100 \\
    --eval-iters 10 \\
    --checkpoint-activations \\
    """
DATA_ARGS = """ \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --data-path $DATA_PATH \\
    """
PRETRAIN = f"python pretrain_gpt.py {GPT_ARGS} {OUTPUT_ARGS} {DATA_ARGS}"
"""CMD="pretrain_gpt.py $GPT_ARGS $OUTPUT_ARGS $DATA_ARGS", run by `python` (the seed's `$LAUNCHER $CMD`)."""

SHRINK = {"--num-layers 24": "--num-layers 2", "--hidden-size 1024": "--hidden-size 64",
          "--num-attention-heads 16": "--num-attention-heads 4", "--seq-length 1024": "--seq-length 32",
          "--max-position-embeddings 1024": "--max-position-embeddings 64",
          "--micro-batch-size 4": "--micro-batch-size 1",
          "--global-batch-size 8": "--global-batch-size 2", "--train-iters 500000": "--train-iters 3",
          "--lr-decay-iters 320000": "--lr-decay-iters 3", "--log-interval 10": "--log-interval 1",
          "--save-interval 500": "--save-interval 3", "--eval-interval 100": "--eval-interval 3",
          "--eval-iters 10": "--eval-iters 1 --num-workers 0", "--workers 8": "--workers 1",
          "--workers 30": "--workers 1"}
"""The seed's sizes -> test sizes; every other flag stays as written."""

WORDS = ("bu proje türkçe için bir dil modeli eğitir ve her gün yeni metinler okur while the model learns "
         "from news stories books and forum posts about weather football and cooking").split()


def write_corpus(path: Path, docs: int, seed: int) -> Path:
    """Loose JSON as the seed shows it: {"src", "text", "type", "id", "title"} per line."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(docs):
            text = " ".join(WORDS[(seed * 13 + i * 7 + k * 3) % len(WORDS)] for k in range(50))
            f.write(json.dumps({"src": "www.nvidia.com", "text": text, "type": "Eng", "id": str(i),
                                "title": f"Part {i}"}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """The seed's names -> local files (corpora written here; prefixes and checkpoints land in the folder)."""
    tmp = tmp_path_factory.mktemp("seed000")
    for k, name in enumerate(("my-corpus.json", "oscar-1GB.jsonl", "c4_en_train.jsonl")):
        write_corpus(tmp / name, 200 if k == 0 else 20, k)
    names = {"~/c4_en_train.jsonl": "c4_en_train.jsonl", "gpt2-vocab.json": str(asset_dir() / "vocab.json"),
             "gpt2-merges.txt": str(asset_dir() / "merges.txt"), "$VOCAB_FILE": str(asset_dir() / "vocab.json"),
             "$MERGE_FILE": str(asset_dir() / "merges.txt"), "$CHECKPOINT_PATH": "checkpoints/gpt2",
             "$DATA_PATH": "my-gpt2_text_document"}
    for part in (1, 2, 3):  # the chunks MERGE joins, each preprocessed as the seed says
        write_corpus(tmp / f"p{part}.json", 10, part)
        code, _, err = run(local(PREPROCESS.replace("my-corpus.json", f"p{part}.json").replace(
            "my-gpt2", f"meg-gpt2-oscar-en-500-p{part}"), names, tmp), tmp)
        assert code == 0, err
    return {**names, "<dir>": str(tmp)}


def local(command: str, names: dict[str, str], folder: Path) -> str:
    """`command` with its sizes shrunk and the seed's names swapped for `names` (relative ones in `folder`)."""
    for old, new in {**SHRINK, **names}.items():
        command = command.replace(old, new)
    return command


def run(command: str, folder: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run a `python SCRIPT ...` line in this process, in `folder`: (exit code, stdout, stderr)."""
    argv = shlex.split(command.replace("\\\n", " "))
    path, entry = SCRIPTS[argv[1]]
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = getattr(module, entry)(argv[2:])
        except SystemExit as exc:  # argparse
            code = exc.code
    return code, out.getvalue(), err.getvalue()


# (id, the seed's command, what it must do: "ok" + files it leaves / words in stdout, or "error" + words)
ROWS = [
    ("preprocess", PREPROCESS, ("ok", "my-gpt2_text_document.bin", "my-gpt2_text_document.idx")),
    ("merge", MERGE, ("ok", "meg-gpt2_oscar_text_document.bin", "meg-gpt2_oscar_text_document.idx")),
    ("quick-preprocess", QUICK_PREPROCESS.replace("my-gpt2", "quick-gpt2"), ("ok", "quick-gpt2_text_document.idx")),
    ("preprocess-many-cores", PREPROCESS.replace("preprocess_data.py", "preprocess_data_many_cores.py").replace(
        "my-gpt2", "many-gpt2"), ("ok", "many-gpt2_text_document.bin", "many-gpt2_text_document.idx")),
    ("hf-tokenizer-from-the-hub", HF_TOKENIZER, ("error", "--tokenizer-name-or-path t5-small", "save_pretrained")),
    ("hf-tokenizer-local-folder", HF_TOKENIZER.replace("t5-small", str(asset_dir())),
     ("ok", "c4_en_train_text_document.idx")),
]


@pytest.mark.parametrize("command, expected", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_seed_000_data_command(paths, command, expected):
    folder = Path(paths["<dir>"])
    code, out, err = run(local(command, paths, folder), folder)
    kind, *needles = expected
    if kind == "error":
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("notice:")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert all(n in lines[0] for n in needles), lines[0]
    else:
        assert code == 0, err
        assert all((folder / n).is_file() for n in needles), sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("env", [{}, {"MASTER_ADDR": "localhost", "MASTER_PORT": "9994", "RANK": "0",
                                      "LOCAL_RANK": "0"}], ids=["python", "emulated-distributed"])
@pytest.mark.slow
def test_seed_000_pretraining(paths, tmp_path, monkeypatch, env):
    """The seed's GPT_ARGS, OUTPUT_ARGS and DATA_ARGS on the prefix `preprocess` writes, fp16 included, run
    by `python` as written and with the seed's single-GPU emulation of a distributed environment."""
    folder = Path(paths["<dir>"])
    code, _, err = run(local(PREPROCESS, paths, folder), folder)
    assert code == 0, err
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    names = {**paths, "$CHECKPOINT_PATH": str(tmp_path / "checkpoints" / "gpt2")}
    code, out, err = run(local(PRETRAIN, names, folder), folder)
    assert code == 0, err
    assert f" iteration {3:8d}/{3:8d} |" in out and "validation loss at iteration 3" in out
    assert (tmp_path / "checkpoints" / "gpt2").is_dir()
