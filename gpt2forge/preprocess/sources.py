"""Raw corpus sources: WikiExtractor output, one-article-per-line text, OpenWebText archives.

Every reader streams: it yields one `(text, nbytes)` pair per document and holds one document
(or one archive, for OpenWebText) in memory at a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from gpt2forge.core.atomic import fsync_path
from gpt2forge.core.errors import UsageError
from gpt2forge.core.json_lines import json_object, string_field


def extracted_files(folder: Path) -> list[Path]:
    """WikiExtractor's output files under `folder` (`AA/wiki_00`, ...), in sorted order."""
    files = sorted(p for p in folder.rglob("wiki_*") if p.is_file())
    if not files:
        raise UsageError(f"{folder}: no WikiExtractor output (AA/wiki_00, ...) found; run "
                         f"`./data/wikipedia_extract.sh <dump> {folder}` first")
    return files


def _doc_text(lines: list[str]) -> str:
    # Line 0 is the title (WikiExtractor repeats it as the first line); the body's non-blank
    # lines are its paragraphs, kept one per line.
    return "\n".join(ln.strip() for ln in lines[1:] if ln.strip())


def iter_extracted(path: Path) -> Iterator[tuple[str, int]]:
    """Articles of one WikiExtractor file: `<doc ...>` blocks (default) or JSON lines (--json)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        body: list[str] | None = None
        nbytes = 0
        for n, line in enumerate(f, start=1):
            nbytes += len(line)
            if line.startswith("{"):  # --json output: one article per line
                problem, obj = json_object(line)
                if problem := problem or string_field(obj, "text"):
                    raise UsageError(f"{path}:{n}: {problem}; expected WikiExtractor's output (<doc> blocks, "
                                     "or with --json one {\"text\": ...} object per line)")
                yield obj["text"], nbytes
                nbytes = 0
            elif line.startswith("<doc"):
                body = []
            elif line.startswith("</doc>"):
                if body is not None:
                    yield _doc_text(body), nbytes
                body, nbytes = None, 0
            elif body is not None:
                body.append(line)


def iter_articles(source: Path, bar: tqdm | None = None) -> Iterator[tuple[str, int]]:
    """Articles from a WikiExtractor folder, or from a text file with one article per line."""
    if source.is_file():
        files, per_line = [source], True
    elif source.is_dir():
        files, per_line = extracted_files(source), False
    else:
        raise UsageError(f"--input-file-path {source}: no such file or folder")
    for path in files:
        if per_line:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if bar is not None:
                        bar.update(len(line))
                    yield line.rstrip("\n"), len(line)
        else:
            for text, nbytes in iter_extracted(path):
                if bar is not None:
                    bar.update(nbytes)
                yield text, nbytes


def total_bytes(source: Path) -> int:
    """Size of a file, or of all WikiExtractor files in a folder (for the progress bar)."""
    if source.is_file():
        return source.stat().st_size
    return sum(p.stat().st_size for p in extracted_files(source))


# --- OpenWebText ---------------------------------------------------------------------------------

def _archive_records(path: str) -> list[str]:
    """JSON lines `{"text", "url"}` for every file in one (xz-compressed) tar archive."""
    out = []
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                data = tar.extractfile(member).read().decode("utf-8", errors="replace")
                url = Path(member.name).name.rsplit(".", 1)[0]
                out.append(json.dumps({"text": data, "url": url}, ensure_ascii=False))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise UsageError(f"{path}: not a readable tar archive ({exc}); re-download it") from None
    return out


def openwebtext_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/extract_and_merge.py",
        description="OpenWebText: read every .xz tar archive in a folder and write one loose-JSON "
                    "line {\"text\", \"url\"} per file (files are read from the archives directly).")
    parser.add_argument("openwebtext_dir", type=Path, help="folder with the *.xz archives")
    parser.add_argument("extract_dir", type=Path, nargs="?", default=None,
                        help="accepted for the reference's command line; nothing is extracted to disk")
    parser.add_argument("--output", type=Path, default=Path("openwebtext_raw.json"),
                        help="loose JSON to write (default: ./openwebtext_raw.json)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="archives read in parallel (default: all cores)")
    parser.add_argument("--overwrite", action="store_true", help="rewrite an existing --output")
    return parser


def extract_and_merge(args: argparse.Namespace) -> int | None:
    """Write `args.output` from the archives; returns documents written (None if it existed)."""
    archives = sorted(str(p) for p in args.openwebtext_dir.glob("*.xz")) \
        if args.openwebtext_dir.is_dir() else []
    if not archives:
        raise UsageError(f"{args.openwebtext_dir}: no *.xz archives found; pass the folder of the "
                         f"OpenWebText subsets (urlsf_subset*.xz)")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.output.is_file() and not args.overwrite:
        print(f"{args.output} already exists (written atomically, so complete); nothing to do "
              f"(pass --overwrite to rewrite)")
        return None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.output.parent, prefix=f".{args.output.name}.", suffix=".tmp")
    docs = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out, \
                mp.get_context("fork").Pool(args.workers) as pool:
            for lines in tqdm(pool.imap(_archive_records, archives), total=len(archives),
                              desc="archives", unit="archive"):
                out.writelines(line + "\n" for line in lines)
                docs += len(lines)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, args.output)
        fsync_path(args.output.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {args.output}: {docs} documents from {len(archives)} archives")
    return docs
