"""The tokenized cache of raw text: a ``.bin/.idx`` built once, keyed by the inputs' content and the tokenizer.

The cache folder (``--data-cache-dir``; default ``.gpt2forge_cache/`` beside the first input file) holds,
for each set of inputs read with one set of settings (its ``NAME``: the first file's stem and a hash of
the resolved paths and settings):

- ``NAME.manifest.json``: what the current build was made from -- the settings (reader, ``--json-key``,
  record kind, tokenizer path and the sha256 of its files), per input file its path, size, mtime and
  sha256 -- and the build's prefix, sequences, tokens, largest token id and build time;
- ``NAME-KEY.bin/.idx``: the build (Megatron's indexed format), ``KEY`` a hash of the settings and of
  the inputs' content hashes, so a build's content is a function of its name;
- ``NAME.lock``: ``fcntl.flock``-ed by the process that checks and builds.

A later run reuses the build when the manifest's key equals the one of the current inputs and
tokenizer. An input whose size and mtime equal the manifest's keeps its recorded hash (not re-read):
an unchanged corpus starts without reading it. Any other input is hashed again; a changed byte or a
changed tokenizer file gives a new key, hence a rebuild under a new name (the old build is left in
place: a run that is still reading it keeps working; delete old ``NAME-*`` files when no run uses them).

Nothing half-written is ever read: the data is written under temporary names and renamed
(``indexed.IndexedWriter``), the manifest last (``core.atomic``), and a build is trusted only through
a manifest. A process that finds no matching manifest takes the lock; one started while another
builds waits for the lock (it logs that it waits), then finds the complete manifest and reuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpt2forge.core import log
from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError
from gpt2forge.core.file_lock import exclusive
from gpt2forge.data.indexed import exists
from gpt2forge.text.tokenizer import HF_FILE
from gpt2forge.text.vocab import MERGES_FILE, TIKTOKEN_SHA256, VOCAB_FILE

CACHE_FORMAT = 1
"""Bumped when the build's layout or tokenization changes, so old builds are not reused."""
DEFAULT_DIR = ".gpt2forge_cache"
TOKENIZER_FILES = (HF_FILE, VOCAB_FILE, MERGES_FILE, "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")
"""The files of a tokenizer folder whose content is its identity (other files, e.g. weights, are not)."""


def _digest(obj: object, size: int = 16) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=size).hexdigest()


def tokenizer_identity(path: str | None) -> str:
    """What the cache key records of the tokenizer: GPT-2's pinned file hash, or the sha256 of the
    tokenizer files at ``path`` (a folder's ``TOKENIZER_FILES``, or the file itself).

    Raises:
        UsageError: ``path`` holds no tokenizer file.
    """
    if path is None:
        return f"gpt2-tiktoken:{TIKTOKEN_SHA256}"
    p = Path(path)
    files = [p] if p.is_file() else [p / n for n in TOKENIZER_FILES if (p / n).is_file()]
    if not files:
        names = ", ".join(TOKENIZER_FILES[:3])
        raise UsageError(f"--tokenizer-name-or-path {path}: no tokenizer files there ({names}); "
                         "pass a local tokenizer folder, e.g. one written by data/train_tokenizer.py")
    return "files:" + _digest({f.name: file_sha256(f) for f in files})


def cache_folder(files: list[Path], cache_dir: str | None) -> Path:
    """``--data-cache-dir``, else ``.gpt2forge_cache/`` beside the first input file; created if needed.

    Raises:
        UsageError: the folder cannot be created.
    """
    folder = Path(cache_dir) if cache_dir else files[0].resolve().parent / DEFAULT_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the tokenized-data cache {folder} ({exc.strerror}); pass a writable "
                         "folder with --data-cache-dir") from None
    return folder


@dataclass(frozen=True)
class CacheSlot:
    """Where one input set's builds, manifest and lock live (module doc)."""

    folder: Path
    name: str

    @property
    def manifest_path(self) -> Path:
        return self.folder / f"{self.name}.manifest.json"

    @property
    def lock_path(self) -> Path:
        return self.folder / f"{self.name}.lock"

    def prefix(self, key: str) -> Path:
        """The build of content key ``key`` (without ``.bin``/``.idx``)."""
        return self.folder / f"{self.name}-{key[:16]}"


def cache_slot(files: list[Path], settings: dict, cache_dir: str | None) -> CacheSlot:
    """The slot of ``files`` read with ``settings`` (which must not hold content hashes)."""
    paths = [str(p.resolve()) for p in files]
    return CacheSlot(cache_folder(files, cache_dir), f"{files[0].stem}-{_digest([paths, settings], 5)}")


def read_manifest(slot: CacheSlot) -> dict:
    """The slot's manifest, or ``{}`` when there is none or it does not parse (then it is rebuilt)."""
    try:
        manifest = json.loads(slot.manifest_path.read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and manifest.get("format") == CACHE_FORMAT else {}


def file_records(files: list[Path], previous: dict) -> list[dict]:
    """Path, size, mtime and sha256 of each file; the hash comes from ``previous`` (a manifest) when
    the path, size and mtime are unchanged, else from the file's bytes."""
    known = {(r["path"], r["size"], r["mtime_ns"]): r["sha256"] for r in previous.get("files", ())
             if isinstance(r, dict) and {"path", "size", "mtime_ns", "sha256"} <= r.keys()}
    records = []
    for f in files:
        st = f.stat()  # before hashing: a file changed while it is hashed is hashed again next time
        path = str(f.resolve())
        sha = known.get((path, st.st_size, st.st_mtime_ns)) or file_sha256(f)
        records.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha})
    return records


def content_key(settings: dict, tokenizer: str, records: list[dict]) -> str:
    """The build's key: the cache format, the settings, the tokenizer's identity and the inputs'
    content hashes in order (paths and mtimes are left out: the same bytes give the same build)."""
    return _digest([CACHE_FORMAT, settings, tokenizer, [r["sha256"] for r in records]], 32)


def reusable(manifest: dict, key: str, slot: CacheSlot) -> bool:
    """True when ``manifest`` records a complete build of ``key``."""
    prefix = manifest.get("prefix")
    return manifest.get("key") == key and isinstance(prefix, str) and exists(slot.folder / prefix)


@contextlib.contextmanager
def locked(slot: CacheSlot, what: str) -> Iterator[None]:
    """Hold the slot's lock for the block, logging when another process holds it (and we wait)."""
    def wait(_holder: str) -> None:
        log.info(f"{what}: waiting for another process building {slot.folder / slot.name} (lock {slot.lock_path})")

    with exclusive(slot.lock_path, if_held=wait):
        yield


Builder = Callable[[Path], dict]
"""Writes the build at the given prefix (atomically) and returns its figures for the manifest."""


def ensure_build(files: list[Path], settings: dict, tokenizer_path: str | None, cache_dir: str | None,
                 build: Builder, what: str) -> tuple[Path, dict]:
    """The prefix of a complete build of ``files`` with ``settings``, reused or made by ``build``.

    Args:
        files: the inputs, in reading order.
        settings: what else the build depends on (reader, keys, record kind); JSON-serializable.
        tokenizer_path: ``--tokenizer-name-or-path`` (None: GPT-2).
        cache_dir: ``--data-cache-dir`` (None: beside the first file).
        build: called with the new prefix under the lock when no complete build matches.
        what: the reader's name for log lines.

    Returns:
        ``(prefix, manifest)``.
    """
    settings = {**settings, "tokenizer_path": tokenizer_path}
    slot = cache_slot(files, settings, cache_dir)
    tokenizer = tokenizer_identity(tokenizer_path)
    manifest = read_manifest(slot)
    records = file_records(files, manifest)
    key = content_key(settings, tokenizer, records)
    if not reusable(manifest, key, slot):
        with locked(slot, what):
            manifest = read_manifest(slot)  # another process may have built it while we waited
            if not reusable(manifest, key, slot):
                prefix = slot.prefix(key)
                figures = build(prefix)
                manifest = {"format": CACHE_FORMAT, "key": key, "prefix": prefix.name, "settings": settings,
                            "tokenizer": tokenizer, "files": records, **figures}
                write_atomic(slot.manifest_path, json.dumps(manifest, indent=1) + "\n")
                return prefix, manifest
    if manifest["files"] != records:  # same content, new mtimes (touched, copied): skip hashing next time
        manifest = {**manifest, "files": records}
        with contextlib.suppress(OSError):  # a read-only cache is still reusable: it just hashes again
            write_atomic(slot.manifest_path, json.dumps(manifest, indent=1) + "\n")
    prefix = slot.folder / manifest["prefix"]
    log.info(f"{what}: reusing the tokenized cache {prefix} ({manifest.get('sequences')} sequences, "
             f"{manifest.get('tokens')} tokens; inputs and tokenizer unchanged)")
    return prefix, manifest
