"""Seed 001 (Megatron-LM's older README) as its users type it: each GPT-2 command line of the seed, copied
as written into the tables below, runs here or ends in the one line that names the replacement.

Only the paths are swapped (`<gpt2_345_path>`, `checkpoints/gpt2_345m`, `cache`, the data: small files in
tmp_path) and the sizes shrunk (`SHRINK`: a 2-layer model, a few iterations, `--device cpu`). The seed's
scripts are run through the files that stand for them (`SCRIPTS`: `scripts/run_gpt2_eval.py` is
`tasks/run_gpt2_eval.py`), in this process.

Left out, with the reason: the virtualenv/pip set-up; `pretrain_bert.py` (BERT is not trained here);
`bash scripts/*_distributed.sh` and `*_model_parallel.sh` (launch scripts; torchrun runs are
tests/cluster's); `bash scripts/generate_text.sh` (interactive; tasks/run_text_generator.sh).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "pretrain_gpt2.py": ("pretrain_gpt2.py", "megatron_main"),
    "scripts/run_gpt2_eval.py": ("tasks/run_gpt2_eval.py", "run_gpt2_eval_main"),
    "tasks/evaluate_wiki.py": ("tasks/evaluate_wiki.py", "wiki_main"),
    "tasks/evaluate_lambada.py": ("tasks/evaluate_lambada.py", "lambada_main"),
    "scripts/split_json.py": ("data/split_json.py", "main"),
}
"""The seed's script -> (the file here, its entry function)."""

GPT2_PRETRAINING = """python pretrain_gpt2.py \\
       --num-layers 24 \\
       --hidden-size 1024 \\
       --num-attention-heads 16 \\
       --batch-size 8 \\
       --seq-length 1024 \\
       --max-position-embeddings 1024 \\
       --train-iters 320000 \\
       --save checkpoints/gpt2_345m \\
       --load checkpoints/gpt2_345m \\
       --resume-dataloader \\
       --train-data wikipedia \\
       --lazy-loader \\
       --tokenizer-type GPT2BPETokenizer \\
       --cache-dir cache \\
       --split 949,50,1 \\
       --distributed-backend nccl \\
       --lr 0.00015 \\
       --lr-decay-style cosine \\
       --weight-decay 1e-2 \\
       --clip-grad 1.0 \\
       --warmup .01 \\
       --checkpoint-activations \\
       --fp16"""

WIKITEXT = """python scripts/run_gpt2_eval.py \\
  --model-parallel-size 1 \\
  --num-layers 24 \\
  --hidden-size 1024 \\
  --num-attention-heads 16 \\
  --model-path <gpt2_345_path> \\
  --data-path <wikitext_tokens_test_path> \\
  --batch-size 16 \\
  --cache-dir cache"""

LAMBADA = """python scripts/run_gpt2_eval.py \\
  --model-parallel-size 1 \\
  --num-layers 24 \\
  --hidden-size 1024 \\
  --num-attention-heads 16 \\
  --model-path <gpt2_345_path> \\
  --data-path <lambada_test_path> \\
  --batch-size 16 \\
  --cloze-eval \\
  --cache-dir cache"""

WEBTEXT = """python scripts/run_gpt2_eval.py \\
  --model-parallel-size 1 \\
  --num-layers 24 \\
  --hidden-size 1024 \\
  --num-attention-heads 16 \\
  --model-path <gpt2_345_path> \\
  --data-path <webtext_test_path> \\
  --batch-size 16 \\
  --eval-iters 5000 \\
  --webtext-eval \\
  --cache-dir cache"""

SHAPE = {"--num-layers 24": "--num-layers 2", "--hidden-size 1024": "--hidden-size 64",
         "--num-attention-heads 16": "--num-attention-heads 4"}
SHRINK = {**SHAPE, "--batch-size 8": "--batch-size 2", "--seq-length 1024": "--seq-length 32",
          "--max-position-embeddings 1024": "--max-position-embeddings 64",
          "--train-iters 320000": "--train-iters 3 --log-interval 1 --eval-interval 3 --eval-iters 1 --num-workers 0",
          "--batch-size 16": "--batch-size 4", "--eval-iters 5000": "--eval-iters 2"}
"""The seed's sizes -> test sizes (the model, the run, the batches); every other flag stays as written."""

WORDS = ("the river town kept its old mill running through every winter while farmers carried grain "
         "across the stone bridge and children counted boats under a grey sky").split()


def _document(i: int, n: int = 60) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n)) + f" story {i}."


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The seed's placeholders -> small local files, and a checkpoint trained by the seed's own command."""
    tmp = tmp_path_factory.mktemp("seed001")
    loose = {name: tmp / f"{name}.json" for name in ("wikipedia", "valid", "test", "webtext")}
    for k, path in enumerate(loose.values()):
        docs = range(60 if k == 0 else 8)
        path.write_text("".join(json.dumps({"text": _document(100 * k + i)}) + "\n" for i in docs))
    wiki = tmp / "wiki.test.tokens"
    wiki.write_text("".join(f" = Section {i} = \n \n {_document(i, 40)} @-@ like , it ran . \n" for i in range(4)))
    lambada = tmp / "lambada_test.jsonl"
    lambada.write_text("".join(json.dumps({"text": _document(i, 30)}) + "\n" for i in range(6)))
    paths = {"checkpoints/gpt2_345m": tmp / "gpt2_345m", "<gpt2_345_path>": tmp / "gpt2_345m", "<cache>": tmp / "cache",
             "<wikitext_tokens_test_path>": wiki, "<lambada_test_path>": lambada,
             "<webtext_test_path>": loose["webtext"], **{f"<{k}>": v for k, v in loose.items()}}
    code, _, err = run(local(GPT2_PRETRAINING.replace("wikipedia", "<wikipedia>"), paths))
    assert code == 0, err  # the checkpoint the evaluation rows read
    return paths


def local(command: str, paths: dict[str, Path], shrink: dict[str, str] = SHRINK) -> str:
    """`command` with the seed's paths swapped for `paths` and its sizes for `shrink`'s."""
    command = command.replace("--cache-dir cache", "--cache-dir <cache>")
    for old, new in {**shrink, **{k: str(v) for k, v in paths.items()}}.items():
        command = command.replace(old, new)
    return command + " --device cpu" * ("run_gpt2_eval" in command or "tasks/" in command)


def run(command: str) -> tuple[int, str, str]:
    """Run a `python SCRIPT ...` line in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    argv = shlex.split(command.replace("\\\n", " "))
    path, entry = SCRIPTS[argv[1]]
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = getattr(module, entry)(argv[2:])
        except SystemExit as exc:  # argparse
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("notice:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), lines[0]


# (id, the seed's command, the paths/sizes used, what it must do: "ok" + words in stdout, or "error" + words)
ROWS = [
    ("gpt2-as-written", GPT2_PRETRAINING, {}, ("error", "--train-data wikipedia", "corpora.py",
                                                "pass the loose JSON file itself")),
    ("gpt2-valid-test-data", GPT2_PRETRAINING.replace(
        "--train-data wikipedia", "--train-data <wikipedia> --valid-data <valid> --test-data <test>").replace(
        "--split 949,50,1", "--split 95,5").replace("checkpoints/gpt2_345m", "<valid_run>"), SHRINK,
     ("ok", "validation loss at iteration 3", "validation loss at iteration 3 on test set")),
    ("wikitext", WIKITEXT, SHRINK, ("ok", "adjusted ppl", "stride 32")),
    ("lambada", LAMBADA, SHRINK, ("ok", "avg accuracy", "non-strict (last token)")),
    ("webtext", WEBTEXT, SHRINK, ("ok", "8 windows", "stride 64", "(PARTIAL)")),
    ("wikitext-shape-as-written", WIKITEXT, {"--batch-size 16": "--batch-size 4"},
     ("error", "--num-layers 24 (the checkpoint has n_layer 2)", "--hidden-size 1024", "drop these flags")),
    ("evaluate_wiki-megatron-flags", WIKITEXT.replace("scripts/run_gpt2_eval.py", "tasks/evaluate_wiki.py"), SHRINK,
     ("ok", "adjusted ppl", "stride 64")),
    ("evaluate_lambada-megatron-flags", LAMBADA.replace("scripts/run_gpt2_eval.py", "tasks/evaluate_lambada.py"),
     SHRINK, ("ok", "avg accuracy")),
    ("evaluate_wiki-cloze-eval", LAMBADA.replace("scripts/run_gpt2_eval.py", "tasks/evaluate_wiki.py"), SHRINK,
     ("error", "--cloze-eval is LAMBADA", "tasks/evaluate_lambada.py")),
]


@pytest.mark.slow
@pytest.mark.parametrize("command, shrink, expected", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_seed_001_command(files, tmp_path, command, shrink, expected):
    paths = {**files, "<valid_run>": tmp_path / "valid_run"}
    code, out, err = run(local(command, paths, shrink))
    kind, *needles = expected
    if kind == "error":
        one_line_error(code, err, *needles)
    else:
        assert code == 0, err
        assert all(n in out for n in needles), out[-3000:]
    if "--valid-data" in command:  # Megatron's meaning: --train-data keeps its --split share, the others are whole
        corpora = [line for line in out.splitlines() if line.startswith("mmap ") and " documents, " in line]
        assert len(corpora) == 3 and "60 documents" in corpora[0] and "--split 95,5: train [0, 57)" in corpora[0]
        assert all("8 documents" in line and "--split" not in line for line in corpora[1:])


@pytest.mark.slow
def test_shipped_run_gpt2_eval_script_starts():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tasks" / "run_gpt2_eval.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--cloze-eval" in proc.stdout and "evaluate_wiki.py" in proc.stdout


def test_split_json_gives_fixed_files_for_train_valid_and_test_data(files, tmp_path):
    """The seed's `./scripts/split_json.py` (its flags, a seeded shuffle): dev and test rounded up, train the
    rest, every input line in exactly one output, a `.map` naming where each came from."""
    inputs = [str(files["<wikipedia>"]), str(files["<valid>"])]
    command = f"python scripts/split_json.py --input_files {' '.join(inputs)} --output_dir {tmp_path / 'splits'} " \
              "--test_percent 0.1 0.05"
    code, out, err = run(command)
    assert code == 0, err
    lines = [line for p in inputs for line in Path(p).read_text().splitlines()]  # 60 + 8
    split = {n: (tmp_path / "splits" / f"{n}.json").read_text().splitlines() for n in ("train", "dev", "test")}
    assert [len(v) for v in split.values()] == [57, 7, 4] and sorted(sum(split.values(), [])) == sorted(lines)
    mapping = (tmp_path / "splits" / "dev.json.map").read_text().splitlines()
    assert mapping[0] == "file\tline #" and len(mapping) == 8
    f, n = map(int, mapping[1].split("\t"))
    assert Path(inputs[f]).read_text().splitlines()[n] == split["dev"][0]
    code, _, err = run(command + " --test_percent 0.6 0.5 --overwrite")
    one_line_error(code, err, "--test_percent 0.6 0.5", "take all 68 lines")


def test_run_gpt2_eval_picks_the_task_and_megatrons_settings_as_its_script_did():
    from gpt2forge.core.errors import UsageError
    from gpt2forge.evaluation.megatron_eval import dispatch

    assert dispatch(["--data-path", "w"]) == ("wiki", ["--data-path", "w", "--overlapping-eval", "32"])
    assert dispatch(["--overlapping-eval", "8"]) == ("wiki", ["--overlapping-eval", "8"])
    assert dispatch(["--cloze-eval", "--eval-iters", "5", "--strict-lambada"]) == \
        ("lambada", ["--cloze-eval", "--strict-lambada"])  # Megatron ran --eval-iters only for webtext
    assert dispatch(["--strict-lambada", "--eval-iters=3"]) == ("wiki", ["--overlapping-eval", "32"])
    assert dispatch(["--webtext-eval", "--eval-iters", "5"]) == ("wiki", ["--webtext-eval", "--eval-iters", "5"])
    with pytest.raises(UsageError, match="exclude each other"):
        dispatch(["--webtext-eval", "--cloze-eval"])
