"""Evaluation data a user can get: fetch, check and cache WikiText and LAMBADA (`gpt2forge-fetch-data`).

    gpt2forge-fetch-data all                 # from the Hugging Face hub, into the cache
    gpt2forge-fetch-data wikitext --out DIR  # somewhere else
    gpt2forge-fetch-data all --from DIR      # import local copies (no network)
    gpt2forge-fetch-data path lambada        # print where a set's file is (exit 2 when missing)

Sets and their public homes (the ones lm-evaluation-harness and `datasets` users load by name):
- `wikitext`: the WikiText test split, raw (`wiki.test.raw`; the same articles in WikiText-2 and
  WikiText-103) and WikiText-2 tokenized (`wiki.test.tokens`, `wiki.valid.tokens`: rare words as
  `<unk>`), from the hub dataset `Salesforce/wikitext` (parquet, one row per line of the original
  file, blank lines as empty rows: written back in the original layout, blank lines as " \\n").
- `lambada`: OpenAI's processed LAMBADA test set (5,153 passages, `{"text": ...}` per line: the
  target is the last word), as lm-evaluation-harness's `lambada_openai` uses it, from the hub
  dataset `EleutherAI/lambada_openai`.

Every file is checked by the sha256 recorded here (those of the files the project's tests import)
before it is moved into place, atomically: a cache file is always complete and right.

The cache: `--out DIR`, else `$GPT2FORGE_EVAL_DATA`, else `$XDG_CACHE_HOME/gpt2forge/eval-data`
(`~/.cache/gpt2forge/eval-data`). `tasks/run_evaluate.sh`, the evaluation scripts and the benchmarks
take their default files from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError, cli_main

ENV_VAR = "GPT2FORGE_EVAL_DATA"


@dataclasses.dataclass(frozen=True)
class EvalFile:
    """One file of a set: where it lives in the cache, its checksum and its public home."""

    path: str
    """Relative path in the cache (and in a `--from` folder)."""
    sha256: str
    repo: str
    """Hugging Face hub dataset holding it."""
    remote: str
    """File in that repository."""
    parquet_lines: bool = False
    """The remote is a parquet table of the file's lines (the `datasets` layout), not the file itself."""


SETS: dict[str, tuple[EvalFile, ...]] = {
    "wikitext": (
        EvalFile("wikitext/wiki.test.tokens", "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
                 "Salesforce/wikitext", "wikitext-2-v1/test-00000-of-00001.parquet", parquet_lines=True),
        EvalFile("wikitext/wiki.test.raw", "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
                 "Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet", parquet_lines=True),
        EvalFile("wikitext/wiki.valid.tokens", "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
                 "Salesforce/wikitext", "wikitext-2-v1/validation-00000-of-00001.parquet", parquet_lines=True),
    ),
    "lambada": (
        EvalFile("lambada/lambada_test.jsonl", "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226",
                 "EleutherAI/lambada_openai", "data/lambada_test.jsonl"),
    ),
}
"""Set name -> its files."""

DEFAULT_FILES = {"wikitext": "wikitext/wiki.test.tokens", "lambada": "lambada/lambada_test.jsonl"}
"""The file `path SET` prints: what `tasks/run_evaluate.sh wiki|lmbd` evaluates by default."""


def cache_dir(out: str | None = None) -> Path:
    """Where the sets live: `out`, else $GPT2FORGE_EVAL_DATA, else the user's cache folder."""
    if out:
        return Path(out)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gpt2forge" / "eval-data"


def parquet_lines_to_text(parquet: Path) -> bytes:
    """The original text file from `datasets`' one-row-per-line table (blank lines are empty rows)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading the hub's parquet files needs pyarrow: pip install pyarrow (or import local "
                         "copies with --from DIR)") from None
    rows = pq.read_table(parquet, columns=["text"]).column("text").to_pylist()
    return "".join(row if row else " \n" for row in rows).encode("utf-8")


def missing_message(names: list[str], where: Path) -> str:
    """One line: which files are missing, where they go and the command that gets them."""
    return (f"evaluation data missing: {', '.join(names)} (looked in {where}); fetch it with "
            f"`gpt2forge-fetch-data all` (or `make eval-data`), or import local copies with "
            f"`gpt2forge-fetch-data all --from DIR`")


def default_file(set_name: str, out: str | None = None) -> Path:
    """The cached default file of `set_name`, checked to exist (UsageError naming the fix when not)."""
    root = cache_dir(out)
    path = root / DEFAULT_FILES[set_name]
    if not path.is_file():
        raise UsageError(missing_message([DEFAULT_FILES[set_name]], root))
    return path


def _install(data: Path, spec: EvalFile, root: Path, origin: str) -> None:
    """Check `data`'s checksum, then move a copy into the cache atomically."""
    got = file_sha256(data)
    if got != spec.sha256:
        raise UsageError(f"{origin}: sha256 {got[:16]}... is not the expected {spec.sha256[:16]}... of "
                         f"{spec.path}; the file is a different version or damaged (fetch it again, or use "
                         "the original file)")
    target = root / spec.path
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(data, tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _from_local(spec: EvalFile, source: Path) -> Path:
    """The local copy of `spec` under `source` (its cache layout, or the bare file name)."""
    for candidate in (source / spec.path, source / Path(spec.path).name):
        if candidate.is_file():
            return candidate
    raise UsageError(f"--from {source}: no {spec.path} (nor {Path(spec.path).name}) there; give the folder "
                     "holding the evaluation files")


def _from_hub(spec: EvalFile, scratch: Path, download: Callable[..., str]) -> Path:
    """Download `spec` from the hub into `scratch` (in the original format); UsageError when offline."""
    try:
        remote = Path(download(repo_id=spec.repo, filename=spec.remote, repo_type="dataset"))
    except Exception as exc:  # the hub client raises many types for "cannot reach it"
        raise UsageError(f"cannot download {spec.remote} from the hub dataset {spec.repo} ({type(exc).__name__}); "
                         f"offline? {missing_message([spec.path], scratch.parent)}") from None
    if not spec.parquet_lines:
        return remote
    local = scratch / Path(spec.path).name
    local.write_bytes(parquet_lines_to_text(remote))
    return local


def fetch(set_names: list[str], out: str | None = None, source: str | None = None,
          download: Callable[..., str] | None = None) -> list[Path]:
    """Put the files of `set_names` into the cache (skipping those already there and right).

    `source`: a local folder to import from instead of the hub; `download`: the hub client's
    `hf_hub_download` (injectable for tests). Returns the cached paths."""
    root = cache_dir(out)
    done = []
    for spec in (s for name in set_names for s in SETS[name]):
        target = root / spec.path
        if target.is_file() and file_sha256(target) == spec.sha256:
            print(f"{target}: present and checked")
        elif source is not None:
            local = _from_local(spec, Path(source))
            _install(local, spec, root, str(local))
            print(f"{target}: imported from {source}, sha256 checked")
        else:
            if download is None:
                from huggingface_hub import hf_hub_download as download
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as scratch:
                _install(_from_hub(spec, Path(scratch), download), spec, root, f"{spec.repo}/{spec.remote}")
            print(f"{target}: downloaded from {spec.repo}, sha256 checked")
        done.append(target)
    return done


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpt2forge-fetch-data", description=__doc__.split("\n\n")[0])
    p.add_argument("set", choices=[*SETS, "all", "path"], help="a set, all of them, or `path SET`")
    p.add_argument("path_set", nargs="?", choices=list(SETS), help="with `path`: the set whose default file to print")
    p.add_argument("--out", default=None, help=f"cache folder (default: ${ENV_VAR}, else ~/.cache/gpt2forge/eval-data)")
    p.add_argument("--from", dest="source", default=None, help="import local copies from this folder (no network)")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.set == "path":
        if args.path_set is None:
            raise UsageError("`path` needs a set: gpt2forge-fetch-data path wikitext|lambada")
        print(default_file(args.path_set, args.out))
        return 0
    if args.source is not None and not Path(args.source).is_dir():
        raise UsageError(f"--from {args.source}: not a folder")
    fetch(list(SETS) if args.set == "all" else [args.set], args.out, args.source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
