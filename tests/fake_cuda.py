"""A recording stand-in for the CUDA runtime, so that the CUDA-only branches of gpt2forge run on the
CPU for their arguments and control flow (tests/*/test_cuda_branches_*.py).

The `fake_cuda` fixture makes `torch.cuda` answer as a machine with GPUs would (names, memory,
compute capability, bf16 support by torch's rule, random states, peak memory), keeps the `torch.backends` matmul
flags in a namespace of its own, and records every call in `fake_cuda.calls`, a list of
`(name, args, kwargs)`:

    def test_synchronize(fake_cuda):
        synchronize(torch.device("cuda", 1))
        assert fake_cuda.called("synchronize") == [((torch.device("cuda", 1),), {})]

What it answers is its attributes (`names`, `total_memory`, `free_memory`, `capability`, ...), read at
each call, so a test sets them before the code under test runs. `torch.distributed.init_process_group`
is recorded too; with `real_group = True` it then forms a real gloo group of one process (an
in-process store) for code that goes on to use it, destroyed after the test.

Tensors still live on the CPU: nothing here makes a CUDA tensor. A test whose code would move a
tensor to a CUDA device patches that boundary itself (a recording DataLoader, a stand-in parameter).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

GiB = 2**30

MATMUL_DEFAULTS = {"allow_tf32": False, "allow_fp16_reduced_precision_reduction": True,
                   "allow_bf16_reduced_precision_reduction": True}
"""torch's defaults of torch.backends.cuda.matmul's flags, as a CUDA build reads them on a GPU (the
fake starts from them): reduced-precision reductions are allowed unless a run turns them off."""

CUDNN_DEFAULTS = {"allow_tf32": True}
"""torch's documented default of torch.backends.cudnn.allow_tf32."""

_REAL_INIT_PROCESS_GROUP = dist.init_process_group


class _Flags:
    """A torch.backends flag namespace (`torch.backends.cuda.matmul`, `torch.backends.cudnn`) whose
    flags live here: setting one is recorded as `<prefix>.<flag>` and never reaches torch's global
    state; other attributes are the real namespace's."""

    def __init__(self, fake: FakeCuda, prefix: str, real, values: dict):
        object.__setattr__(self, "_fake", fake)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "values", dict(values))

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "values")
        return values[name] if name in values else getattr(object.__getattribute__(self, "_real"), name)

    def __setattr__(self, name: str, value) -> None:
        self._fake.record(f"{self._prefix}.{name}", value)
        self.values[name] = value


class _Generators:
    """`torch.cuda.default_generators`: one CPU torch.Generator per fake GPU, made on first use."""

    def __init__(self, fake: FakeCuda):
        self.fake = fake
        self.made: dict[int, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self.fake.names)

    def __getitem__(self, i: int) -> torch.Generator:
        if not 0 <= i < len(self):
            raise IndexError(f"default_generators[{i}]: {len(self)} fake GPU(s)")
        return self.made.setdefault(i, torch.Generator())


class FakeCuda:
    """What the fake CUDA runtime answers (its attributes) and every call made to it (`calls`)."""

    def __init__(self) -> None:
        self.names = ["NVIDIA H100 80GB HBM3"]
        """The GPUs' names, one per device: device_count() is its length."""
        self.total_memory = 80 * GiB
        self.free_memory = 70 * GiB
        """What mem_get_info() says is free on every device (bytes)."""
        self.reserved, self.allocated = 0, 0
        """memory_reserved() / memory_allocated() (bytes): the caching allocator's view."""
        self.peak = 3 * GiB
        """max_memory_allocated() (bytes)."""
        self.capability: tuple[int, int] | list[tuple[int, int]] = (9, 0)
        """The compute capability of every GPU, or a list of one per GPU."""
        self.multi_processor_count = 132
        self.bf16_tensors = True
        """Whether a bf16 tensor can be made on the GPUs (torch's probe behind is_bf16_supported's
        emulation answer): true on every GPU a CUDA build of torch runs on."""
        self.arch_list = ["sm_80", "sm_86", "sm_90"]
        """get_arch_list(): the architectures torch was built for."""
        self.current = 0
        """current_device(); set_device() changes it."""
        self.real_group = False
        """init_process_group() also forms a real gloo group of one process."""
        self.calls: list[tuple[str, tuple, dict]] = []
        self.rng_states: dict[int, torch.Tensor] = {}
        self.generators = _Generators(self)

    def record(self, name: str, *args, **kwargs) -> None:
        self.calls.append((name, args, kwargs))

    def called(self, name: str) -> list[tuple[tuple, dict]]:
        """(args, kwargs) of each call of `name`, in order."""
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]

    def index(self, device=None, optional: bool = True) -> int:
        """The GPU index torch would take from `device` (None, an int, "cuda:N", a torch.device).
        `optional=False` refuses a CUDA device without an index, as torch.cuda.set_device does."""
        if device is None:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            if device.index is None and not optional:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            device = self.current if device.index is None else device.index
        if not 0 <= device < len(self.names):
            raise RuntimeError(f"CUDA error: invalid device ordinal {device} ({len(self.names)} fake GPU(s))")
        return device

    def capability_of(self, i: int) -> tuple[int, int]:
        return self.capability[i] if isinstance(self.capability, list) else self.capability

    def rng_state(self, i: int) -> torch.Tensor:
        """The random state of GPU i: 16 bytes (seed, offset), distinct per GPU until set."""
        return self.rng_states.setdefault(i, torch.full((16,), i + 1, dtype=torch.uint8))

    def properties(self, device=None) -> types.SimpleNamespace:
        """torch.cuda.get_device_properties: what gpt2forge reads of them."""
        i = self.index(device)
        major, minor = self.capability_of(i)
        return types.SimpleNamespace(name=self.names[i], total_memory=self.total_memory, major=major, minor=minor,
                                     multi_processor_count=self.multi_processor_count)

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        """torch.cuda.is_bf16_supported's rule (torch/cuda/__init__.py): the current GPU at compute
        capability 8.0 or newer has bf16; an older one has it only `including_emulation` (the
        default), when a bf16 tensor can be made there, which on a V100 or T4 it can."""
        if self.capability_of(self.current)[0] >= 8:
            return True
        return including_emulation and self.bf16_tensors

    def set_device(self, device) -> None:
        self.current = self.index(device, optional=False)

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.rng_state(self.index(device)).clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.rng_states[self.index(device)] = state.clone()

    def init_process_group(self, backend=None, **kwargs) -> None:
        """Refuses a device_id without an index, as torch does; then forms a real gloo group of one
        process when `real_group` is set (else only the call is recorded)."""
        device_id = kwargs.get("device_id")
        if isinstance(device_id, torch.device) and device_id.index is None:
            raise ValueError("Please use a device_id with index.")
        if self.real_group:
            _REAL_INIT_PROCESS_GROUP("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def answers(self) -> dict[str, Callable]:
        """torch.cuda's functions as this fake answers them, by name."""

        def per_device(value: Callable[[], object]) -> Callable:
            """The answer to a query that takes a device: the device is checked, value() returned."""
            def answer(device=None):
                self.index(device)
                return value()
            return answer

        return {
            "is_available": lambda: True,
            "device_count": lambda: len(self.names),
            "current_device": lambda: self.current,
            "set_device": self.set_device,
            "get_device_name": lambda device=None: self.names[self.index(device)],
            "get_device_properties": self.properties,
            "get_device_capability": lambda device=None: self.capability_of(self.index(device)),
            "get_arch_list": lambda: list(self.arch_list),
            "is_bf16_supported": self.is_bf16_supported,
            "synchronize": per_device(lambda: None),
            "max_memory_allocated": per_device(lambda: self.peak),
            "reset_peak_memory_stats": per_device(lambda: None),
            "memory_reserved": per_device(lambda: self.reserved),
            "memory_allocated": per_device(lambda: self.allocated),
            "mem_get_info": per_device(lambda: (self.free_memory, self.total_memory)),
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "is_current_stream_capturing": lambda: False,  # torch.optim asks before each step
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
        }

    def recorded(self, name: str, answer: Callable) -> Callable:
        """`answer`, recording each call as `name`."""
        def call(*args, **kwargs):
            self.record(name, *args, **kwargs)
            return answer(*args, **kwargs)
        return call

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Patch torch.cuda, torch.backends, torch.version.cuda, Tensor.pin_memory and
        torch.distributed.init_process_group; monkeypatch undoes it all after the test."""
        for name, answer in self.answers().items():
            monkeypatch.setattr(torch.cuda, name, self.recorded(name, answer))
        monkeypatch.setattr(torch.cuda, "default_generators", self.generators)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.backends.cuda, "matmul",
                            _Flags(self, "backends.cuda.matmul", torch.backends.cuda.matmul, MATMUL_DEFAULTS))
        monkeypatch.setattr(torch.backends, "cudnn",
                            _Flags(self, "backends.cudnn", torch.backends.cudnn, CUDNN_DEFAULTS))
        # Pinned host memory needs a CUDA runtime: a pinned copy is a plain copy here.
        monkeypatch.setattr(torch.Tensor, "pin_memory", self.recorded("Tensor.pin_memory", lambda t, *a: t.clone()))
        monkeypatch.setattr(dist, "init_process_group", self.recorded("init_process_group", self.init_process_group))


@pytest.fixture()
def fake_cuda(monkeypatch):
    """A FakeCuda installed for the test: one H100 (80 GiB, sm 9.0, native bf16), its calls recorded."""
    initialized = dist.is_available() and dist.is_initialized()
    fake = FakeCuda()
    fake.install(monkeypatch)
    yield fake
    if not initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
