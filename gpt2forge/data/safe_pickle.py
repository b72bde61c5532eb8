"""A restricted unpickler for token-id pickles: data in, never code.

``pickle.load`` calls whatever global a file names (``os.system``, ``builtins.eval``, any class), so
loading a downloaded ``.pkl`` with it runs the file's author's code. ``safe_load`` resolves only the
few numpy globals that rebuild integer arrays and scalars; any other global is refused *before* it
is called. Lists, ints, tuples and the like need no global, so they load as plain data; checking that
the result has the expected shape (e.g. a list of documents) is the caller's job.
"""

from __future__ import annotations

import codecs
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from gpt2forge.core.errors import UsageError

try:  # numpy >= 2 names its internals numpy._core; files written by numpy 1.x say numpy.core.
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray
    from numpy.core import numeric as _numeric


class _Refused(Exception):
    """Raised inside the unpickler; ``safe_load`` turns it into a UsageError naming the file."""


def _integer_dtype(*args: Any) -> np.dtype:
    """``numpy.dtype`` as seen by pickles: only signed/unsigned integer dtypes are rebuilt."""
    dtype = np.dtype(*args)
    if dtype.kind not in "iu":
        raise _Refused(f"holds a numpy array or scalar of dtype {dtype}; token ids must be integers")
    return dtype


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as used by protocol-2 pickles to store bytes; only latin-1 is allowed."""
    if encoding.replace("-", "").replace("_", "").lower() not in ("latin1", "iso88591"):
        raise _Refused(f"uses _codecs.encode with encoding {encoding!r}; only latin-1 is allowed")
    return codecs.encode(text, "latin1")


_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _integer_dtype,
    ("_codecs", "encode"): _latin1_encode,
}
for _module in ("numpy.core", "numpy._core"):
    _ALLOWED[(f"{_module}.multiarray", "_reconstruct")] = _multiarray._reconstruct
    _ALLOWED[(f"{_module}.multiarray", "scalar")] = _multiarray.scalar
    _ALLOWED[(f"{_module}.numeric", "_frombuffer")] = _numeric._frombuffer

ALLOWED_GLOBALS = tuple(sorted(f"{m}.{n}" for m, n in _ALLOWED))
"""Every global a pickle may name (for messages and tests)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise _Refused(
                f"names the global {module}.{name}, which was refused and not run "
                "(only lists, ints and numpy integer arrays may be loaded)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("uses a persistent id, which token-id pickles never need")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def safe_load(path: str, recreate: str = "") -> Any:
    """Unpickle ``path`` admitting only plain data and numpy integer arrays/scalars.

    Args:
        path: the ``.pkl`` file.
        recreate: the command that re-creates the file, appended to every error (may be empty).

    Returns:
        The unpickled object. Only the globals in ``ALLOWED_GLOBALS`` can occur in it; numpy arrays and
        scalars have an integer dtype. Containers built without globals (list, tuple, dict, str, float)
        are not refused here: the caller checks the structure it expects.

    Raises:
        UsageError: missing or empty file, not a pickle (protocol 2 or newer), a corrupt stream, or a
            refused global (named in the message; it is never called).
    """
    hint = f"; re-create it with `{recreate}`" if recreate else ""
    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found{hint}")
    with open(path, "rb") as f:
        head = f.read(2)
        if not head:
            raise UsageError(f"{path}: file is empty{hint}")
        # Protocol >= 2 pickles open with PROTO (0x80) and the protocol number; a text file or other
        # binary format fails here with a clearer message than the unpickler's.
        if head[0] != 0x80 or len(head) < 2 or not 2 <= head[1] <= pickle.HIGHEST_PROTOCOL:
            raise UsageError(
                f"{path}: not a pickle file (expected protocol 2..{pickle.HIGHEST_PROTOCOL}, "
                f"file starts with {head!r}){hint}"
            )
        f.seek(0)
        # A corrupt BYTEARRAY8 length makes CPython's unpickler fail allocating and then print
        # "SystemError: deallocated bytearray object has exported buffers" through sys.excepthook
        # on top of the error it raises: keep the user's output to our one line.
        hook, sys.excepthook = sys.excepthook, lambda *_: None
        try:
            return _RestrictedUnpickler(f).load()
        except _Refused as exc:
            raise UsageError(f"{path}: {exc}{hint}") from None
        except Exception as exc:  # any failure to decode an untrusted file is a bad-file error
            raise UsageError(
                f"{path}: corrupt or truncated pickle ({type(exc).__name__}: {one_line(exc)}){hint}"
            ) from None
        finally:
            sys.excepthook = hook
