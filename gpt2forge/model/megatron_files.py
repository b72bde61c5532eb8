"""Megatron-LM checkpoint directories, and reading their files without running anything in them.

    <dir>/latest_checkpointed_iteration.txt        the iteration, or `release`
    <dir>/iter_0000500/mp_rank_00/model_optim_rng.pt      one file per tensor-parallel rank,
    <dir>/iter_0000500/mp_rank_01_002/model_optim_rng.pt  `_PPP` with pipeline stages

Files are read with `torch.load(weights_only=True)` and an explicit allowlist (`SAFE_GLOBALS`): an
argparse Namespace, numpy's RNG arrays, and Megatron's enums and configs through stand-in classes
registered under Megatron's names (Megatron itself is never imported). A file holding any other
global is refused with one line: nothing in it runs. What the files hold becomes a GPT-2 of this
package in gpt2forge.model.megatron_checkpoint.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import signal
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2forge.core.errors import UsageError, one_line, refused_part

TRACKER = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
SHARD_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
KNOWN_VERSIONS = (0.0, 1.0, 2.0, 3.0)


class MegatronObject:
    """What one of Megatron's enums or config objects becomes when read here: its pickled value
    and state, kept as data. No Megatron code is imported or run."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}{self.args}"


MEGATRON_CLASSES = (
    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.CudaGraphModule", "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope", "megatron.core.transformer.enums.LayerType",
    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState", "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.model.enums.ModelType", "megatron.model.enums.AttnMaskType", "megatron.model.enums.AttnType",
    "megatron.model.enums.LayerType", "megatron.model.enums.PositionEmbeddingType",
)


def _stand_in(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    return type(name, (MegatronObject,), {"__module__": module, "__qualname__": name})


def _numpy_globals() -> list:
    """numpy's RNG state arrays (`np_rng_state`), under numpy 1's and numpy 2's module names."""
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    found = [np.ndarray, np.dtype, (reconstruct, "numpy.core.multiarray._reconstruct"),
             (reconstruct, "numpy._core.multiarray._reconstruct")]
    return found + [np.dtypes.UInt32DType] if hasattr(np, "dtypes") else found


SAFE_GLOBALS: list = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals, io.BytesIO,
                      torch.Generator, *_numpy_globals(), *((_stand_in(q), q) for q in MEGATRON_CLASSES)]
"""What a Megatron-LM checkpoint may hold besides tensors and builtins: its args Namespace, paths and
signals in the args, Transformer Engine's extra state (BytesIO), RNG states and Megatron's enums."""


def _global_name(g: Any) -> str:
    return g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"


ALLOWED_NAMES = frozenset(map(_global_name, SAFE_GLOBALS)) | {"torch._C.Generator"}


# -- the directory ---------------------------------------------------------------------------------


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True for a Megatron-LM `--save` directory (it has latest_checkpointed_iteration.txt) or one
    of its `iter_NNNNNNN/` / `release/` directories (it has mp_rank_* directories)."""
    p = Path(path)
    if (p / TRACKER).is_file():
        return True
    return p.is_dir() and not (p / "config.json").exists() and any(
        SHARD_DIR.fullmatch(d.name) and d.is_dir() for d in p.iterdir())


def iteration_dir(path: str | Path, iteration: int | None = None) -> Path:
    """The `iter_NNNNNNN/` (or `release/`) directory to read: `iteration`, else the tracker's."""
    p = Path(path)
    if iteration is None and not (p / TRACKER).is_file():
        if p.is_dir() and any(SHARD_DIR.fullmatch(d.name) for d in p.iterdir()):
            return p
        raise UsageError(f"{p}: no {TRACKER} (not a Megatron-LM checkpoint directory); pass the --save directory "
                         "of a Megatron-LM run or one of its iter_NNNNNNN/ directories")
    if iteration is None:
        text = (p / TRACKER).read_text().strip()
        if text != "release" and not text.isdigit():
            raise UsageError(f"{p / TRACKER}: holds {text[:40]!r}, not an iteration or 'release'; write the "
                             "iteration to load into it")
        name = "release" if text == "release" else f"iter_{int(text):07d}"
    else:
        name = f"iter_{iteration:07d}"
    found = p / name
    if not found.is_dir():
        held = sorted(d.name for d in p.iterdir() if d.name.startswith(("iter_", "release")))
        raise UsageError(f"{found}: not found (this directory holds {', '.join(held[-4:]) or 'no iterations'}); "
                         "copy the whole iteration directory or name an iteration that is there")
    if not any(SHARD_DIR.fullmatch(d.name) for d in found.iterdir()):
        if (found / ".metadata").is_file() or (found / "common.pt").is_file():
            raise UsageError(f"{found}: a torch_dist (distributed) checkpoint; convert it to Megatron's torch "
                             "format first: run Megatron-LM with --ckpt-convert-format torch --ckpt-convert-save DIR")
        raise UsageError(f"{found}: no mp_rank_XX/ directories; the checkpoint is incomplete")
    return found


def read_shard(path: Path) -> dict[str, Any]:
    """One model_optim_rng.pt, read without running anything in it (weights-only, SAFE_GLOBALS).

    Raises UsageError (one line naming the file) when it is missing, holds a global outside the
    allowlist, or is damaged."""
    if not path.is_file():
        raise UsageError(f"{path}: missing; a Megatron checkpoint needs one file per tensor- and pipeline-parallel "
                         "rank: copy the whole iteration directory")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 -- a legacy (non-zip) file: the weights-only load below still guards it
        unsafe = []
    refused = sorted(set(unsafe) - ALLOWED_NAMES)
    if refused:
        raise UsageError(f"{path}: holds the global {refused[0]}, which a Megatron-LM checkpoint does not; it was "
                         "not loaded and nothing in it ran; re-save the model with Megatron-LM")
    with torch.serialization.safe_globals(SAFE_GLOBALS), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:  # files of torch < 1.6 (no zip) cannot be memory-mapped
                if "mmap" not in str(exc):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UsageError(f"{path}: not a Megatron-LM checkpoint ({refused_part(exc)}); it was not loaded and "
                             "nothing in it ran") from None
        except Exception as exc:  # noqa: BLE001 -- a damaged file fails in many ways inside torch.load
            raise UsageError(f"{path}: cannot read ({one_line(exc)}); the file is damaged, copy it again") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UsageError(f"{path}: holds no 'model' state dict; pass a Megatron-LM model_optim_rng.pt checkpoint")
    return state


def shard_paths(it_dir: Path, args: Any) -> list[list[Path]]:
    """[pipeline stage][tensor rank] -> model_optim_rng.pt, as Megatron's get_checkpoint_name names them."""
    tp = int(getattr(args, "tensor_model_parallel_size", None) or getattr(args, "model_parallel_size", None) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
    return [[it_dir / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}") / SHARD_FILE
             for t in range(tp)] for p in range(pp)]


def _first_shard(it_dir: Path) -> Path:
    """Tensor rank 0's file of the first pipeline stage (the one that says how many there are)."""
    for name in ("mp_rank_00", "mp_rank_00_000"):
        if (it_dir / name).is_dir():
            return it_dir / name / SHARD_FILE
    return it_dir / "mp_rank_00" / SHARD_FILE  # absent: read_shard says so
