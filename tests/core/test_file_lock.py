"""core.file_lock.exclusive: the one flock primitive of the text cache, the peak FLOP/s cache and
prepare_corpus.py's folder lock."""

import errno
import fcntl
import subprocess
import sys
import time

import pytest

from gpt2forge.core.file_lock import exclusive

HOLDER = """
import sys
from gpt2forge.core.file_lock import exclusive
with exclusive(sys.argv[1], sign=True):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


@pytest.fixture
def held(tmp_path):
    """A lock file held (and signed) by another process until the test ends or closes its stdin."""
    path = tmp_path / "x.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    yield path, proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_held_lock_names_its_holder_to_a_refusal(held):
    path, proc = held
    seen = []

    def refuse(holder):
        seen.append(holder)
        raise RuntimeError("busy")

    with pytest.raises(RuntimeError, match="busy"), exclusive(path, if_held=refuse):
        pytest.fail("entered a held lock")
    assert seen and seen[0].startswith(f"pid {proc.pid} on ")


def test_a_waiter_gets_the_lock_once_its_holder_ends(held):
    path, proc = held
    waited = []

    def release_soon(holder):
        waited.append(time.monotonic())
        proc.stdin.close()  # the holder ends; the kernel drops its lock

    with exclusive(path, if_held=release_soon) as locked:
        assert locked and waited
    with exclusive(path, if_held=lambda holder: pytest.fail("still held")) as locked:
        assert locked


def test_unopenable_and_lockless_files_run_the_block_unlocked(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-folder" / "x.lock"
    with pytest.raises(FileNotFoundError), exclusive(missing):
        pass
    with exclusive(missing, best_effort=True) as locked:
        assert locked is False

    def no_locks(f, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with exclusive(tmp_path / "y.lock", sign=True) as locked:
        assert locked is False
    assert (tmp_path / "y.lock").read_text() == ""  # not signed: nobody holds it
