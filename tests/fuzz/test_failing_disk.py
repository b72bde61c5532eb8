"""Every writer on a failing disk: one line naming the path, exit code 2, nothing that looks complete.

The disk "fills up" through RLIMIT_FSIZE set in the child process (SIGXFSZ ignored, so a write past
the limit fails with EFBIG, as a full disk fails with ENOSPC): each writer runs as its user runs it,
the whole program, and after the failure its output folder holds neither a complete-looking output
nor a temporary file.
"""

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def limited(limit_bytes: int):
    def set_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return set_limit


def run(args: list[str], limit: int, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          preexec_fn=limited(limit))


def corpus_jsonl(path: Path, docs: int = 400) -> Path:
    path.write_text("".join(json.dumps({"text": f"Document {i}: " + "the sea and the ship sail on. " * 20})
                            + "\n" for i in range(docs)))
    return path


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, path_part: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("error:") and path_part in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_preprocess_data_bin_idx(tmp_path):
    src = corpus_jsonl(tmp_path / "in.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    proc = run([str(ROOT / "data" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
                str(out / "c"), "--append-eod", "--workers", "1"], 20_000, tmp_path)
    assert_one_line_exit_2(proc, str(out))
    assert leftovers(out) == []


def test_write_into_tfrecord(tmp_path):
    src = corpus_jsonl(tmp_path / "in.jsonl")
    subprocess.run([sys.executable, str(ROOT / "data" / "preprocess_data.py"), "--input", str(src),
                    "--output-prefix", str(tmp_path / "c"), "--append-eod", "--workers", "1"], check=True,
                   capture_output=True, timeout=300)
    out = tmp_path / "tf"
    proc = run([str(ROOT / "data" / "write_into_tfrecord.py"), "--input-file-path", str(tmp_path / "c_text_document"),
                "--output-file-path", str(out), "--seq-length", "16"], 4_000, tmp_path)
    assert_one_line_exit_2(proc, str(out))
    assert out.is_dir(), "the writer failed before its folder: the disk limit was never reached"
    assert leftovers(out) == []


def test_train_tokenizer_files(tmp_path):
    src = corpus_jsonl(tmp_path / "in.jsonl")
    out = tmp_path / "tok"
    proc = run([str(ROOT / "data" / "train_tokenizer.py"), "--input", str(src), "--vocab-size", "400",
                "--output-dir", str(out)], 2_000, tmp_path)
    assert_one_line_exit_2(proc, str(out))
    assert out.is_dir(), "the trainer failed before its folder: the disk limit was never reached"
    assert not any(name.startswith(".") or name.endswith(".tmp") for name in leftovers(out)), leftovers(out)
    assert not (out / "tokenizer.json").exists() and not (out / "merges.txt").exists()


def test_cleanup_dataset_jsonl(tmp_path):
    src = corpus_jsonl(tmp_path / "in.jsonl")
    out = tmp_path / "clean"
    out.mkdir()
    proc = run([str(ROOT / "data" / "cleanup_dataset.py"), str(src), str(out / "clean.json"), "--lang", "any",
                "--min-tokens", "0", "--workers", "0"], 30_000, tmp_path)
    assert_one_line_exit_2(proc, str(out))
    assert leftovers(out) == []
