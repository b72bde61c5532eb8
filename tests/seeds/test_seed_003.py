"""Seed 003: Colossal-AI's "Pretrain GPT-2 on a single GPU with ZeRO" (the OpenWebText pipeline after
Megatron-LM's tools/openwebtext, then `torchrun ... train_gpt.py --config=gpt2_configs/gpt2_zero3.py
--from_torch` with `DATA=train_data.json`). Each command line runs here as the seed writes it, the
seed's `Megatron/` and `train_gpt.py` being this repository's `data/` and `train_gpt2.py`.

Paths are temporary files; the model shrinks by flags after the seed's line (a 32-wide GPT-2, 32
tokens, two steps, --device cpu). Not run: `pip install ...`, building LSH (not needed here) and the
seed's `download/download.py` (the network; its output, loose JSON, is written here by hand).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from colossal_examples import ZERO3  # tests/colossal_examples.py

from gpt2forge.cli import train_main

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step \d+ of epoch \d+, loss: \S+, acc: \S+, lr: \S+, throughput: \S+ samples/sec", re.M)

"""gpt2_configs/gpt2_zero3.py as ColossalAI-Examples ships it (the seed's snippet is tested in
tests/frontends/test_colossal.py)."""

TOPICS = ["rivers and the towns built along their banks", "the history of printing presses in Europe",
          "how bees find flowers and return to the hive", "the rules of chess and its famous openings"]


def article(topic: str, n: int) -> str:
    sentences = [f"This article number {n} is about {topic}, and sentence {k} adds a plain English detail "
                 f"that a reader can follow without trouble." for k in range(14)]
    return " ".join(sentences)


def script_main(path: str):
    """The `main` of a script in data/ (run in this process: no interpreter start per row)."""
    return runpy.run_path(str(ROOT / path), run_name="seed_003")["main"]


@pytest.mark.slow
def test_openwebtext_pipeline_as_the_seed_writes_it(tmp_path, capsys):
    urls = tmp_path / "URLs"
    urls.mkdir()
    (urls / "RS_2011-01.bz2.deduped.txt").write_text(
        "https://example.org/rivers\nhttps://www.youtube.com/watch?v=1\nhttps://example.org/a.jpg\n"
        "https://example.org/printing\nhttps://example.org/rivers\n")
    # Step 3 of "Download Data": remove blacklisted URLs.
    assert script_main("data/blacklist_urls.py")([str(urls), str(tmp_path / "clean_urls.txt")]) == 0
    assert (tmp_path / "clean_urls.txt").read_text().split() == ["https://example.org/rivers",
                                                                 "https://example.org/printing"]
    # Step 4's output (download.py fetches the pages): loose JSON, {'text': ..., 'url': ...} per line,
    # with a near copy of the first document and a short one.
    docs = [{"text": article(t, i), "url": f"https://example.org/{i}"} for i, t in enumerate(TOPICS)]
    docs.append({"text": docs[0]["text"].replace("trouble", "any trouble"), "url": "https://example.org/copy"})
    docs.append({"text": "Too short to keep.", "url": "https://example.org/short"})
    raw = tmp_path / "raw.json"
    raw.write_text("".join(json.dumps(d) + "\n" for d in docs))

    def run(script: str, *args: Path | str) -> None:
        assert script_main(f"data/{script}")([str(a) for a in args]) == 0, capsys.readouterr().err

    run("cleanup_dataset.py", raw, tmp_path / "clean.json")  # ftfy, English, >= 128 tokens
    clean = [json.loads(line) for line in (tmp_path / "clean.json").read_text().splitlines()]
    assert len(clean) == 5  # the short one is gone
    with pytest.raises(SystemExit) as exc:  # `python cleanup_fix_dataset.py --help`
        script_main("data/cleanup_fix_dataset.py")(["--help"])
    assert exc.value.code == 0 and "--tasks" in capsys.readouterr().out
    run("find_duplicates.py", "--inputs", tmp_path / "clean.json", "url", "--output", tmp_path / "stage_one.json")
    run("group_duplicate_url.py", tmp_path / "stage_one.json", tmp_path / "stage_two.json")
    run("remove_group_duplicates.py", tmp_path / "stage_two.json", tmp_path / "clean.json", tmp_path / "dedup.json")
    dedup = [json.loads(line)["url"] for line in (tmp_path / "dedup.json").read_text().splitlines()]
    assert dedup == [f"https://example.org/{i}" for i in range(4)]  # the near copy is gone
    subprocess.run(["shuf", str(tmp_path / "dedup.json"), "-o", str(tmp_path / "train_data.json")], check=True)
    assert sorted((tmp_path / "train_data.json").read_text().splitlines()) == \
        sorted((tmp_path / "dedup.json").read_text().splitlines())


@pytest.fixture()
def colossal_run(make_tiny_config, tmp_path) -> tuple[list[str], dict[str, str]]:
    """(the seed's train_gpt.py arguments with the sizes shrunk, the environment with DATA) in tmp_path."""
    (tmp_path / "gpt2_configs").mkdir()
    (tmp_path / "gpt2_configs" / "gpt2_zero3.py").write_text(ZERO3)
    data = tmp_path / "train_data.json"
    data.write_text("".join(json.dumps({"text": article(t, i), "url": str(i)}) + "\n"
                            for i, t in enumerate(TOPICS * 3)))
    tiny = make_tiny_config(vocab_size=50257, n_positions=32)
    shrink = ["--model-config", str(tiny), "--max-len", "32", "--training-steps", "2", "--device-iterations", "1",
              "--num-workers", "0", "--device", "cpu"]
    return ["--config=gpt2_configs/gpt2_zero3.py", "--from_torch", *shrink], {"DATA": str(data)}


def test_colossal_launch_runs_with_zero3_offload(colossal_run, tmp_path, monkeypatch, capsys):
    """`train_gpt.py --config=gpt2_configs/gpt2_zero3.py --from_torch` (issue 46 item 9: it ended in
    `cannot parse (JSONDecodeError)`): ZeRO-3 with every state in host memory, HybridAdam's AdamW,
    recomputation, the seed's batch of 2, DATA's loose JSON."""
    argv, env = colossal_run
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA", env["DATA"])
    assert train_main(argv) == 0
    out, err = capsys.readouterr()
    stands_for = ("--config gpt2_configs/gpt2_zero3.py (Colossal-AI's) stands for: --batch-size 2 --max-len 1024 "
                  "--epochs 60 --lr-schedule linear --lr-warmup 0.08333333333333333 --zero-stage 3 --offload full "
                  "--optimizer AdamW --learning-rate 0.00015 --weight-decay 0.01 --model gpt2 "
                  f"--recompute-checkpoint-every-layer true --dataset jsonl --input-files {env['DATA']}")
    assert stands_for in out
    assert len(STEP.findall(out)) == 2, out[-3000:]
    assert "no meaning here, ignored" not in err  # every setting of gpt2_zero3.py has a meaning here


@pytest.mark.slow
def test_colossal_launch_line_under_torchrun(colossal_run, tmp_path):
    """The seed's whole line: `torchrun --standalone --nproc_per_node=1 train_gpt.py --config=... --from_torch`."""
    argv, env = colossal_run
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           str(ROOT / "train_gpt2.py"), *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**clean, **env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(STEP.findall(proc.stdout)) == 2
