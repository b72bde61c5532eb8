"""gpt2forge-fetch-data: import, checksum, cache, the hub path (with a stand-in client) and the messages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError
from gpt2forge.evaluation import fetch

ROOT = Path(__file__).resolve().parents[2]


def test_from_imports_checks_and_skips_when_present(tmp_path, eval_data, capsys):
    out = tmp_path / "cache"
    assert fetch.main(["all", "--from", str(eval_data), "--out", str(out)]) == 0
    for spec in (s for files in fetch.SETS.values() for s in files):
        assert file_sha256(out / spec.path) == spec.sha256 == file_sha256(eval_data / spec.path)
    assert "imported" in capsys.readouterr().out
    assert fetch.main(["all", "--from", str(eval_data), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("present and checked") == 4
    assert fetch.main(["path", "lambada", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "lambada" / "lambada_test.jsonl")


def test_a_different_file_is_refused_and_nothing_is_cached(tmp_path, capsys):
    src = tmp_path / "src" / "lambada"
    src.mkdir(parents=True)
    (src / "lambada_test.jsonl").write_text('{"text": "not the real set"}\n')
    assert fetch.main(["lambada", "--from", str(tmp_path / "src"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lambada_test.jsonl" in err and "sha256" in err
    assert not list((tmp_path / "c").rglob("*.jsonl"))


def hub_parquet(text_file: Path, parquet: Path) -> None:
    """A `datasets`-style table of `text_file`: one row per line, blank lines as empty rows."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = text_file.read_text(encoding="utf-8").splitlines(keepends=True)
    rows = [line if line.strip() else "" for line in lines]
    pq.write_table(pa.table({"text": rows}), parquet)


def test_hub_path_rebuilds_the_original_files(tmp_path, eval_data):
    stage = tmp_path / "hub"
    stage.mkdir()
    served = {}
    for spec in (s for files in fetch.SETS.values() for s in files):
        local = stage / spec.remote.replace("/", "_")
        if spec.parquet_lines:
            hub_parquet(eval_data / spec.path, local)
        else:
            local.write_bytes((eval_data / spec.path).read_bytes())
        served[(spec.repo, spec.remote)] = local

    def download(repo_id, filename, repo_type):
        assert repo_type == "dataset"
        return str(served[(repo_id, filename)])

    paths = fetch.fetch(list(fetch.SETS), out=str(tmp_path / "cache"), download=download)
    assert [file_sha256(p) for p in paths] == [s.sha256 for files in fetch.SETS.values() for s in files]


@pytest.mark.slow
def test_offline_and_missing_are_one_line_with_the_command(tmp_path, monkeypatch):
    def offline(**_):
        raise OSError("no route to host")

    with pytest.raises(UsageError, match="gpt2forge-fetch-data all") as info:
        fetch.fetch(["wikitext"], out=str(tmp_path / "c"), download=offline)
    assert "\n" not in str(info.value) and "Salesforce/wikitext" in str(info.value)
    monkeypatch.setenv(fetch.ENV_VAR, str(tmp_path / "empty"))
    proc = subprocess.run(["bash", str(ROOT / "tasks" / "run_evaluate.sh"), "wiki", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "wiki.test.tokens" in proc.stderr and "make eval-data" in proc.stderr
