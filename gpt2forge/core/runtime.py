"""Left over from the split of this module into `device`, `compilation` and `memory`: it re-exports
the names that modules under other work in flight still import from here (gpt2forge/train/batches.py:
`loader_workers`; gpt2forge/tools/inference.py: `maybe_compile`, `resolve_device`, `synchronize`).
Delete it once they import from `device` and `compilation` (issue 55 item 4).
"""

from gpt2forge.core.compilation import maybe_compile
from gpt2forge.core.device import loader_workers, resolve_device, synchronize

__all__ = ["loader_workers", "maybe_compile", "resolve_device", "synchronize"]
