"""manifest.json: what each stage of data/prepare_corpus.py did, and whether it must run again.

One manifest per output folder (the one-machine run's, the merge's, and one per shard task of a
sharded run, gpt2forge.preprocess.sharded). A stage's record holds documents and characters in and
out, removals by rule, examples, its settings, the size and mtime of its inputs and the sizes of
its outputs. A stage is complete when its record matches: same settings, inputs unchanged, outputs
present at their recorded sizes; `Manifest.run` then skips it. A stage that re-runs rewrites its
output, so every stage after it sees a changed input and re-runs too. The file is rewritten
atomically after each stage, so a killed run loses at most the stage it was in. A run holds its
folder (`hold_folder`: a lock on `manifest.lock`, released when the process ends, however it ends),
so a second run started on the same folder stops at once instead of deleting the first one's
temporaries and writing over its files.
"""

from __future__ import annotations

import contextlib
import glob
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from gpt2forge.core.errors import UsageError
from gpt2forge.core.file_lock import exclusive
from gpt2forge.preprocess.jsonl import atomic_json

FORMAT = "gpt2forge-prepare-manifest"
VERSION = 1


def _signature(paths: list[Path]) -> dict:
    """{path: {size, mtime_ns}} of stage inputs: a rewritten input invalidates the stages after it."""
    out = {}
    for p in paths:
        st = Path(p).stat()
        out[str(Path(p).resolve())] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def remove_stale_temporaries(paths: list[Path]) -> None:
    """Delete the temporary siblings of `paths` that a killed run left: `.<name>.tmp-<pid>`
    (atomic_jsonl) and `.<name>.<random>.tmp` (atomic_file: the shuffle, the fingerprints, the .bin/.idx writer).
    SIGKILL runs no cleanup, so without this each killed stage would leave a copy of its output
    behind, a corpus-sized file at scale. Hence one run per output folder at a time."""
    for path in paths:
        for tmp in path.parent.glob(f".{glob.escape(path.name)}.*"):
            if tmp.name.endswith(".tmp") or ".tmp-" in tmp.name:
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def hold_folder(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder/manifest.lock` while the block runs (the kernel drops it when the
    process ends, SIGKILL included, so no stale lock is left). Raises a UsageError naming the holder
    when another run has it. On a file system without locks it warns and runs the block unlocked."""
    path = folder / "manifest.lock"

    def refuse(holder: str) -> None:
        raise UsageError(f"{folder}: another prepare_corpus.py run is working in this folder ({holder or 'a process'} "
                         f"holds {path.name}); wait for it to end or stop it, then rerun")

    with exclusive(path, if_held=refuse, sign=True) as locked:
        if not locked:
            print(f"warning: {folder}: its file system has no file locks; nothing stops a second run in this "
                  "folder, so start one at a time", file=sys.stderr)
        yield


def _plain(obj) -> object:
    """`obj` as it reads back from JSON (tuples -> lists), so settings compare equal after a reload."""
    return json.loads(json.dumps(obj))


def _line(name: str, r: dict) -> str:
    rules = ", ".join(f"{k} {v}" for k, v in sorted(r.get("removed", {}).items())) or "none"
    return (f"{name}: kept {r['docs_out']} of {r['docs_in']} documents ({r['chars_out']} of {r['chars_in']} "
            f"characters); removed: {rules}; {r['seconds']:.2f} s")


class Manifest:
    """manifest.json in `out_dir`: loaded at start, rewritten atomically after each stage.

    `order` names the stages in the order they run (re-running one drops the records after it);
    `may_empty`: a stage may keep no document (a shard task's part can be all boilerplate), where
    otherwise that stops the run with a UsageError.
    """

    def __init__(self, out_dir: Path, settings: dict, overwrite: bool, order: tuple[str, ...],
                 may_empty: bool = False):
        self.path = out_dir / "manifest.json"
        self.overwrite = overwrite
        self.order = order
        self.may_empty = may_empty
        old = {}
        if self.path.is_file() and not overwrite:
            try:
                old = json.loads(self.path.read_text(encoding="utf-8"))
            except ValueError:
                old = {}  # a damaged manifest only costs a re-run
        self.stages: dict = old.get("stages", {}) if old.get("format") == FORMAT else {}
        self.settings = _plain(settings)
        self.skipped: list[str] = []

    def save(self) -> None:
        removed = Counter()
        for record in self.stages.values():
            removed.update(record.get("removed", {}))
        atomic_json(self.path, {"format": FORMAT, "version": VERSION, "settings": self.settings,
                                "removed_by_rule": dict(removed), "stages": self.stages})

    def redo_reason(self, name: str, inputs: list[Path], outputs: list[Path], settings: dict) -> str:
        """Why stage `name` must run ("" when its record matches: same settings, inputs unchanged,
        outputs present at their recorded sizes)."""
        prev = self.stages.get(name)
        sizes = {str(p.resolve()): p.stat().st_size for p in outputs if p.is_file()}
        if self.overwrite or not prev:
            return "--overwrite" if self.overwrite else "no record"
        if prev.get("settings") != _plain(settings):
            return "its record has other settings"
        if prev.get("inputs") != _signature(inputs):
            return "an input changed since its record (size or modification time)"
        if prev.get("outputs") != sizes or len(sizes) != len(outputs):
            return "an output is missing or not at its recorded size"
        return ""

    def complete(self, name: str, inputs: list[Path], outputs: list[Path], settings: dict) -> bool:
        return not self.redo_reason(name, inputs, outputs, settings)

    def run(self, name: str, inputs: list[Path], outputs: list[Path], settings: dict,
            work: Callable[[], dict]) -> dict:
        """The stage's record: the saved one when complete, else `work()`'s, saved."""
        reason = self.redo_reason(name, inputs, outputs, settings)
        if not reason:
            print(f"{name}: complete ({', '.join(p.name for p in outputs) or 'no file of its own'}); skipping")
            self.skipped.append(name)
            return self.stages[name]
        if name in self.stages:
            print(f"{name}: running again: {reason}")
        for later in self.order[self.order.index(name):]:  # they all re-run after this one: drop their old records
            self.stages.pop(later, None)
        remove_stale_temporaries([*outputs, self.path])
        start = time.perf_counter()
        record = work()
        record.update(settings=_plain(settings), inputs=_signature(inputs),
                      seconds=round(time.perf_counter() - start, 3),
                      outputs={str(p.resolve()): p.stat().st_size for p in outputs})
        self.stages[name] = record
        self.save()
        print(_line(name, record))
        if not record["docs_out"] and not self.may_empty:
            raise UsageError(f"{name} removed every document ({_line(name, record)}); nothing is left for the "
                             "next stage: check the input and the settings (e.g. --lang, --min-tokens)")
        return record
