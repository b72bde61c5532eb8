"""Custom C++/CUDA ops: load the library, and the PyTorch references its ops must match.

One shared library, `build/custom_ops/gpt2forge_ops.so` (built by `make` through `gpt2forge.ops.build`;
another venv's is `build/<venv name>/custom_ops/`),
registers its ops as `torch.ops.gpt2forge.<name>`. `load_custom_ops()` is the one loader. Every op
has a pure-PyTorch reference with the same argument checks: it is the fallback when the library is
not built (a one-line notice says so) and the oracle of the op's parity test in
tests/ops/test_custom_ops.py. Loading never needs a compiler: the toolchain lives in `build`.

The kernels with AVX2 or AVX-512 forms take the widest their CPU runs; `GPT2FORGE_OPS_ISA` (`ISA_ENV`:
scalar, avx2 or avx512, read once per process) forces one path, and a path the CPU cannot run is
refused at load (`ops_isa()` says which path is taken; tests/ops/test_isa_paths.py runs each).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
LIBRARY_NAME = "gpt2forge_ops.so"
LIBRARY_ENV = "GPT2FORGE_OPS_LIB"
DEFAULT_VENV = ".venv"  # the Makefile's VENV
ISA_ENV = "GPT2FORGE_OPS_ISA"
ISA_PATHS = ("scalar", "avx2", "avx512")
"""The values ISA_ENV takes (custom_ops/isa.h): unset, the widest path this CPU runs."""

NOT_BUILT_NOTICE = (
    "custom ops library not built (run `make`); using the PyTorch reference implementations"
)


def library_path() -> Path:
    """Where the library is built to and loaded from: `$GPT2FORGE_OPS_LIB`, else
    `<repo>/build/custom_ops/` from the default venv `.venv` (or no venv), else
    `<repo>/build/<venv name>/custom_ops/`.

    A library is built against one torch's ABI, so a second venv (`make VENV=.venv-torch2.11`, the
    Makefile's OPS_DIR) gets a library of its own and never loads another's.
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return Path(override)
    venv = Path(sys.prefix).name if sys.prefix != sys.base_prefix else DEFAULT_VENV
    folder = REPO_ROOT / "build" if venv == DEFAULT_VENV else REPO_ROOT / "build" / venv
    return folder / "custom_ops" / LIBRARY_NAME


# ---------------------------------------------------------------------------------------------
# Load


def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ops_registered() -> bool:
    """Whether the gpt2forge ops are already registered in this process.

    A second copy of the library (another path, e.g. a test build) must not be loaded: its
    TORCH_LIBRARY block would run again, and that aborts the process instead of raising.
    """
    return hasattr(torch.ops.gpt2forge, "build_info")


@functools.cache
def load_custom_ops() -> bool:
    """Load the custom ops library once per process; return whether `torch.ops.gpt2forge` works.

    Returns False, after one notice line on stderr, when the library is absent or fails to load
    (e.g. built against another torch); callers then use the PyTorch references. Tests reset the
    cached answer with `load_custom_ops.cache_clear()`.

    Raises ValueError, in one line naming the variable and the CPU's features, when $GPT2FORGE_OPS_ISA
    asks for a path this CPU cannot run or is not a path (never another path instead), or is set for
    a library that predates it.
    """
    path = library_path()
    if not path.is_file():
        _notice(NOT_BUILT_NOTICE)
        return False
    if not _ops_registered():
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            _notice(
                f"custom ops library {path} failed to load ({reason}); using the PyTorch reference "
                "implementations (rebuild it with `make clean && make`)"
            )
            return False
    if hasattr(torch.ops.gpt2forge, "ops_isa"):
        torch.ops.gpt2forge.ops_isa()  # the library reads ISA_ENV here, once, and raises ValueError for a bad one
    elif os.environ.get(ISA_ENV):
        raise ValueError(f"{ISA_ENV} is set, but the custom ops library {path} predates it: rebuild it with `make`")
    return True


def has_op(name: str) -> bool:
    """Whether the library is loaded (load_custom_ops) and registers `torch.ops.gpt2forge.<name>`:
    a library built from older sources may lack a newer op."""
    return load_custom_ops() and hasattr(torch.ops.gpt2forge, name)


def ops_isa() -> str | None:
    """The instruction-set path the library's kernels take, one of ISA_PATHS ($GPT2FORGE_OPS_ISA,
    else the widest this CPU runs); None when the library is not loaded or predates the choice."""
    return torch.ops.gpt2forge.ops_isa() if has_op("ops_isa") else None


def build_info() -> str | None:
    """How the loaded library was built (compiler, OpenMP, CUDA, torch); None if not loaded."""
    return torch.ops.gpt2forge.build_info() if load_custom_ops() else None


# ---------------------------------------------------------------------------------------------
# Ops: the public function and its reference


def _check_scaled_add_args(x: torch.Tensor, y: torch.Tensor) -> None:
    # Same checks, exception types and messages as the C++ kernel (custom_ops/build_info.cpp).
    if x.dtype != torch.float32 or y.dtype != torch.float32:
        raise TypeError(
            "gpt2forge::scaled_add_: expected float32 tensors, got x "
            f"{str(x.dtype).removeprefix('torch.')} and y {str(y.dtype).removeprefix('torch.')}"
        )
    if x.shape != y.shape:
        raise ValueError(
            "gpt2forge::scaled_add_: x and y must have the same shape, got x "
            f"{list(x.shape)} and y {list(y.shape)}"
        )
    if not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError(
            "gpt2forge::scaled_add_: x and y must be contiguous (call .contiguous() first)"
        )


def scaled_add_reference(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """`x += alpha * y` in place, in PyTorch; returns x. The oracle of `gpt2forge::scaled_add_`.

    x, y: float32 tensors of the same shape, contiguous. Raises TypeError / ValueError otherwise.
    """
    _check_scaled_add_args(x, y)
    return x.add_(y, alpha=alpha)


def scaled_add_(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """`x += alpha * y` in place; returns x (float32, same shape, contiguous).

    Runs the compiled OpenMP kernel for CPU tensors outside autograd when the library is
    loaded, and `scaled_add_reference` otherwise (GPU tensors, tensors that require grad: the
    kernel has no autograd formula).
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    if x.device.type == "cpu" and not needs_grad and load_custom_ops():
        return torch.ops.gpt2forge.scaled_add_(x, y, alpha)
    return scaled_add_reference(x, y, alpha)
