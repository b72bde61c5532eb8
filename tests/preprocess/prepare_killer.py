"""Runs data/prepare_corpus.py and kills it with SIGKILL inside one stage (test_prepare_killed.py).

    python tests/preprocess/prepare_killer.py STAGE TARGET N -- <prepare_corpus.py's arguments>

Once prepare_corpus enters STAGE (`Manifest.run` with that name), the N-th call of TARGET (a dotted
path to a function or method the stage calls, e.g. `os.replace` or
`gpt2forge.preprocess.jsonl.JsonlWriter.write`) sends this process SIGKILL before the call runs: no
`finally` block, no exit handler runs, as when the out-of-memory killer or a lost node ends a run.

TARGET may also name a function that opens files as a context manager, then `:write`
(`gpt2forge.preprocess.dedup.atomic_file:write`): the N-th `write` into any file the stage opens
through that name is the call that kills, for writers that copy bytes into a file object.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def resolve(target: str) -> tuple[object, str]:
    """(the object holding the attribute, its name) for a dotted path: the longest importable
    module prefix, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ValueError(f"{target}: no importable module in it")


def arm(stage: str, target: str, call: int) -> None:
    from gpt2forge.preprocess import prepare
    state = {"armed": False, "calls": 0}
    run = prepare.Manifest.run

    def entering(self, name, *args, **kwargs):
        state["armed"] = name == stage
        return run(self, name, *args, **kwargs)

    def counted(original):
        def killing(*args, **kwargs):
            if state["armed"]:
                state["calls"] += 1
                if state["calls"] == call:
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return killing

    target, _, method = target.partition(":")
    owner, name = resolve(target)
    original = getattr(owner, name)
    if method == "write":
        @contextlib.contextmanager
        def opening(*args, **kwargs):
            with original(*args, **kwargs) as f:
                yield Writes(f, counted(f.write))
        setattr(owner, name, opening)
    elif method:
        raise ValueError(f"{target}:{method}: only ':write' is known")
    else:
        setattr(owner, name, counted(original))
    prepare.Manifest.run = entering


class Writes:
    """A file object whose `write` is the given function; everything else is the file's."""

    def __init__(self, f, write):
        self._f, self.write = f, write

    def __getattr__(self, name):
        return getattr(self._f, name)


def main() -> None:
    stage, target, call, sep, *argv = sys.argv[1:]
    if sep != "--":
        raise SystemExit("usage: prepare_killer.py STAGE TARGET N -- <prepare_corpus.py arguments>")
    arm(stage, target, int(call))
    sys.argv = [str(ROOT / "data" / "prepare_corpus.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
