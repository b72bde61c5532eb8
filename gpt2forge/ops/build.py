"""Build the custom ops library: find the toolchain, compile `custom_ops/`, link, clean up.

One shared library, `build/custom_ops/gpt2forge_ops.so`, is compiled from every `custom_ops/*.cpp`
(plus `custom_ops/*.cu` when nvcc and a CUDA build of torch are both present) against the running
torch. `gpt2forge.ops.library` loads it; nothing at run time imports this module.

It prints the toolchain, a line per file it compiles (`custom ops: compiling gemv.cpp`) and the
result, and whatever the compiler says (warnings: torch's headers are -isystem, GCC 12's false
ones about its own AVX-512 intrinsics are turned off by `PRELUDE`, and GCC's note on the vector
passing ABI by -Wno-psabi); for a command that fails, the
command itself before the compiler's output. `--verbose` prints every command.

Usage (`make` runs the first):
    python -m gpt2forge.ops.build build [--out-dir DIR] [--quiet | --verbose]
    python -m gpt2forge.ops.build clean [--out-dir DIR]
    python -m gpt2forge.ops.build info
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2forge.core.errors import cli_main
from gpt2forge.ops.library import LIBRARY_ENV, LIBRARY_NAME, REPO_ROOT, build_info, library_path

SOURCE_DIR = REPO_ROOT / "custom_ops"
# Scratch directories of running (or killed) builds, next to the library they will replace.
TEMP_PREFIX = ".build-"
PRELUDE = SOURCE_DIR / "gcc_intrinsics_prelude.h"
"""Included ahead of every C++ source (-include), whatever the source folder: it turns off GCC 12's
false warnings about its own AVX-512 intrinsics (the header says why)."""


class BuildError(RuntimeError):
    """The library could not be built: no compiler, or a source failed to compile or link."""


@dataclass(frozen=True)
class Toolchain:
    """What `build()` found on this machine."""

    cxx: str
    """Absolute path of the C++ compiler ($CXX, else `c++`, as torch's own extension builder)."""
    cxx_version: str
    """First line of `cxx --version`."""
    openmp: bool
    """Whether `cxx -fopenmp` compiles and links a program that includes <omp.h>."""
    nvcc: str | None
    """Path of nvcc (from torch's CUDA_HOME, else $PATH), None when not found."""
    nvcc_version: str | None
    """The `release X.Y, VX.Y.Z` part of `nvcc --version`."""
    cuda_home: str | None = None
    """The toolkit torch compiles against (torch.utils.cpp_extension.CUDA_HOME: $CUDA_HOME, else
    guessed from the nvcc on $PATH)."""
    cuda_headers: bool = False
    """Whether the CUDA runtime's header (cuda_runtime_api.h) is in `cuda_home`/include or
    $CUDA_INC_PATH. An nvcc on $PATH that is a wrapper script outside its toolkit (/usr/local/bin/nvcc
    running /usr/local/cuda/bin/nvcc) makes torch guess a CUDA_HOME without it."""

    @property
    def cuda(self) -> bool:
        """Whether .cu sources can be built: nvcc found, torch is a CUDA build, both have one
        CUDA major version (the library links the toolkit's libcudart, which must be the one
        torch loads; torch's own extension builder refuses a mismatch too), and the toolkit torch
        compiles against has the runtime's headers."""
        return (self.nvcc is not None and torch.version.cuda is not None and not self.cuda_mismatch
                and self.cuda_headers)

    @property
    def cuda_mismatch(self) -> bool:
        """Whether nvcc's CUDA major version is known and differs from torch's."""
        nvcc = re.match(r"release (\d+)\.", self.nvcc_version or "")
        torch_cuda = torch.version.cuda
        return nvcc is not None and torch_cuda is not None and nvcc[1] != torch_cuda.split(".")[0]


def _first_line(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0] if lines else "unknown version"


def detect_toolchain(scratch_dir: Path) -> Toolchain:
    """Find the C++ compiler, probe it for OpenMP (in `scratch_dir`), and look for nvcc.

    Raises BuildError when no C++ compiler is found.
    """
    from torch.utils.cpp_extension import CUDA_HOME, get_cxx_compiler

    cxx = shutil.which(get_cxx_compiler())
    if cxx is None:
        raise BuildError(
            f"no C++ compiler found (looked for `{get_cxx_compiler()}`); install g++ or clang++, "
            "or point $CXX at one"
        )
    probe = scratch_dir / "openmp_probe.cpp"
    probe.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    openmp = subprocess.run(
        [cxx, "-fopenmp", str(probe), "-o", str(scratch_dir / "openmp_probe")],
        capture_output=True, check=False,
    ).returncode == 0

    nvcc = None
    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc")
    nvcc = nvcc or shutil.which("nvcc")
    nvcc_version = None
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        nvcc_version = next(
            (line.split(", ", 1)[1] for line in out.stdout.splitlines() if "release" in line),
            "unknown version",
        )
    include_dirs = [Path(CUDA_HOME) / "include"] if CUDA_HOME else []
    include_dirs += [Path(os.environ["CUDA_INC_PATH"])] if os.environ.get("CUDA_INC_PATH") else []
    # torch's include_paths("cuda") raise without a CUDA_HOME, whatever $CUDA_INC_PATH says
    cuda_headers = bool(CUDA_HOME) and any((d / "cuda_runtime_api.h").is_file() for d in include_dirs)
    return Toolchain(cxx, _first_line([cxx, "--version"]), openmp, nvcc, nvcc_version, CUDA_HOME, cuda_headers)


def _describe(tc: Toolchain, n_cu: int) -> list[str]:
    """The lines `build()` prints before compiling."""
    if tc.nvcc is None:
        cuda = "not found (no nvcc)"
    else:
        cuda = f"nvcc {tc.nvcc} ({tc.nvcc_version})"
        if torch.version.cuda is None:
            cuda += "; torch is a CPU build"
            cuda += f", so {n_cu} .cu source(s) are skipped" if n_cu else ""
        elif tc.cuda_mismatch:
            skipped = f" and {n_cu} .cu source(s) are skipped" if n_cu else ""
            cuda += (f"; torch built with CUDA {torch.version.cuda}, another major version, so the library is built "
                     f"without CUDA{skipped} (point CUDA_HOME at a CUDA {torch.version.cuda.split('.')[0]} toolkit)")
        elif not tc.cuda_headers:
            skipped = f" and {n_cu} .cu source(s) are skipped" if n_cu else ""
            cuda += (f"; torch's CUDA_HOME ({tc.cuda_home or 'not set'}) has no include/cuda_runtime_api.h, so the "
                     f"library is built without CUDA{skipped} (set CUDA_HOME to the toolkit's root)")
        else:
            cuda += f"; torch built with CUDA {torch.version.cuda}"
    return [
        f"compiler {tc.cxx} ({tc.cxx_version})",
        f"OpenMP   {'yes (-fopenmp)' if tc.openmp else 'no (the kernels run single-threaded)'}",
        f"CUDA     {cuda}",
        f"torch    {torch.__version__} ({Path(torch.__file__).parent})",
    ]


def _cuda_arch_flags() -> list[str]:
    from torch.utils import cpp_extension

    # torch reads the visible GPUs for an unset list and for "native"; with none it fails obscurely.
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "native") in ("", "native") and torch.cuda.device_count() == 0:
        raise BuildError(
            "no GPU visible to choose the CUDA architectures for; set TORCH_CUDA_ARCH_LIST "
            "(e.g. TORCH_CUDA_ARCH_LIST='8.0;9.0') and run `make` again"
        )
    return cpp_extension._get_cuda_arch_flags()  # torch's TORCH_CUDA_ARCH_LIST parser


def _commands(
    tc: Toolchain, sources: list[Path], source_dir: Path, scratch: Path, library: Path
) -> tuple[list[tuple[Path, list[str]]], list[str]]:
    """The compile command of each source, and the link command that writes `library`."""
    from torch.utils import cpp_extension

    device = "cuda" if tc.cuda else "cpu"
    system_includes = [*cpp_extension.include_paths(device), sysconfig.get_path("include")]
    includes = [f"-I{source_dir}"] + [a for p in system_includes for a in ("-isystem", p)]
    defines = ["-DGPT2FORGE_WITH_CUDA=1"] if tc.cuda else []
    # No -march=native: the library must run on every machine that shares this checkout.
    # -fno-trapping-math: no kernel reads floating-point exception flags, and without it GCC keeps a
    # compare-and-select (std::max in exp_nonpositive) as a branch in the AVX2 clones, which leaves
    # their loops scalar (the AVX-512 clones select with masks either way). It reorders nothing: the
    # results are the same bits.
    # -Wno-psabi: GCC notes, wherever a helper takes a 256-bit vector by value, that the ABI for
    # passing one changed in GCC 4.6; our helpers are inlined and never cross an ABI boundary, and a
    # `#pragma GCC diagnostic` does not reach that note (host_optim_kernels.h has one).
    cxx_flags = ["-O3", "-fPIC", "-std=c++20", "-Wall", "-Wno-psabi", "-fno-trapping-math", "-include", str(PRELUDE)]
    cxx_flags += ["-fopenmp"] if tc.openmp else ["-Wno-unknown-pragmas"]

    compiles = []
    for src in sources:
        obj = scratch / f"{src.name}.o"  # foo.cpp.o and foo.cu.o may coexist
        if src.suffix == ".cu":
            assert tc.nvcc is not None
            host = ["-ccbin", os.environ["CC"]] if "CC" in os.environ else []
            cmd = [tc.nvcc, *host, "-c", str(src), "-o", str(obj), "-O3", "-std=c++20",
                   "--compiler-options", "-fPIC", *cpp_extension.COMMON_NVCC_FLAGS,
                   *_cuda_arch_flags(), *includes, *defines]
        else:
            cmd = [tc.cxx, "-c", str(src), "-o", str(obj), *cxx_flags, *includes, *defines]
        compiles.append((src, cmd))

    libs = ["-lc10", "-ltorch_cpu", "-ltorch"]
    if tc.cuda:
        libs += ["-lc10_cuda", "-ltorch_cuda", "-lcudart"]
    link = [tc.cxx, "-shared", *(str(scratch / f"{s.name}.o") for s in sources), "-o",
            str(library), *(f"-L{p}" for p in cpp_extension.library_paths(device)), *libs]
    link += ["-fopenmp"] if tc.openmp else []
    return compiles, link


def _run(steps: list[tuple[str, list[str]]], verbose: bool, quiet: bool = False) -> None:
    """Run the commands in parallel (one per CPU core), each `(what, command)` announced by a line
    `custom ops: {what}` as it starts (not when `quiet`; with its command when `verbose`). What a
    command prints goes to stderr; a failed command's output comes after the command itself.
    Raises BuildError naming each failure."""
    def run(step: tuple[str, list[str]]) -> subprocess.CompletedProcess:
        what, cmd = step
        if verbose:
            print(f"custom ops: {what}\n{shlex.join(cmd)}", flush=True)
        elif not quiet:
            print(f"custom ops: {what}", flush=True)
        return subprocess.run(cmd, capture_output=True, text=True, check=False)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(run, steps))
    failed = []
    for (what, cmd), result in zip(steps, results):
        output = (result.stdout + result.stderr).strip()
        if result.returncode:
            failed.append(f"{what} (exit {result.returncode})")
            print(f"custom ops: {what} failed (exit {result.returncode}):\n{shlex.join(cmd)}", file=sys.stderr)
        if output:
            print(output, file=sys.stderr, flush=True)
    if failed:
        raise BuildError(f"{', '.join(failed)} failed; the command and the compiler output are above")


def build(out_dir: Path | None = None, verbose: bool = False, *, quiet: bool = False,
          source_dir: Path | None = None) -> Path:
    """Compile the custom ops library; return its path.

    Args:
        out_dir: where `gpt2forge_ops.so` goes; default: the directory of `library_path()`.
        verbose: print each compiler command too.
        quiet: no line per file (the toolchain summary, warnings, failures and the result always print).
        source_dir: the sources' directory, default `<repo>/custom_ops` (tests point it elsewhere).

    The library is linked inside a scratch directory next to its destination and moved into
    place with os.replace, so a failed or killed build never leaves a partial library, and a
    process that has the old one loaded keeps a valid mapping. A killed build may leave its
    `.build-*` scratch directory behind; `clean` removes those.

    Raises BuildError when there is no compiler or a command fails.
    """
    started = time.perf_counter()
    source_dir = Path(source_dir or SOURCE_DIR).resolve()
    target = (Path(out_dir) / LIBRARY_NAME if out_dir is not None else library_path()).resolve()
    cpp = sorted(source_dir.glob("*.cpp"))
    cu = sorted(source_dir.glob("*.cu"))
    if not cpp:
        raise BuildError(f"no *.cpp sources in {source_dir}")
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent))
    try:
        tc = detect_toolchain(scratch)
        for line in _describe(tc, len(cu)):
            print(f"custom ops: {line}", flush=True)
        sources = cpp + (cu if tc.cuda else [])
        compiles, link = _commands(tc, sources, source_dir, scratch, scratch / LIBRARY_NAME)
        _run([(f"compiling {src.name}", cmd) for src, cmd in compiles], verbose, quiet)
        _run([(f"linking {LIBRARY_NAME}", link)], verbose, quiet)
        os.replace(scratch / LIBRARY_NAME, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"custom ops: built {target} in {time.perf_counter() - started:.1f} s", flush=True)
    return target


def clean(out_dir: Path | None = None) -> list[Path]:
    """Remove the library and any scratch directories left beside it; return what was removed.

    Only those paths: with $GPT2FORGE_OPS_LIB pointing elsewhere, nothing else in that
    directory is touched.
    """
    target = Path(out_dir) / LIBRARY_NAME if out_dir is not None else library_path()
    removed = sorted(target.parent.glob(f"{TEMP_PREFIX}*")) if target.parent.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if target.exists():
        target.unlink()
        removed.append(target)
    return removed


@cli_main
def main(argv: list[str] | None = None) -> int:
    """`python -m gpt2forge.ops.build {build,clean,info}`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m gpt2forge.ops.build",
        description="Build, remove or describe the gpt2forge custom ops library.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("build", "compile custom_ops/*.cpp (and *.cu with nvcc + CUDA torch) into the library"),
        ("clean", "remove the library and leftover build scratch directories"),
    ]:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--out-dir", type=Path, default=None,
                         help=f"directory of {LIBRARY_NAME} (default: that of "
                              f"${LIBRARY_ENV}, else build/custom_ops, or build/<venv name>/custom_ops "
                              "for a venv other than .venv)")
        if name == "build":
            output = sub.add_mutually_exclusive_group()
            output.add_argument("--quiet", action="store_true",
                                help="no line per compiled file: the toolchain summary, warnings, failures and the "
                                     "result only")
            output.add_argument("--verbose", action="store_true",
                                help="print each compiler command (a failed one's is always printed, with the "
                                     "compiler's output)")
    commands.add_parser("info", help="load the library and print how it was built")
    args = parser.parse_args(argv)

    if args.command == "build":
        try:
            build(args.out_dir, verbose=args.verbose, quiet=args.quiet)
        except BuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    elif args.command == "clean":
        for path in clean(args.out_dir):
            print(f"removed {path}")
    else:
        info = build_info()
        if info is None:
            return 1
        print(f"{library_path()}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
