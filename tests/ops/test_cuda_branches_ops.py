"""The CUDA build of the custom ops library (nvcc for .cu sources, the architecture flags, the CUDA
libraries at link time), as the commands `make` would run, on the CPU: a fake nvcc and C++ compiler
on PATH, torch.version.cuda and the GPUs from the fake CUDA runtime (tests/fake_cuda.py). Nothing is
compiled."""

import stat
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from gpt2forge.ops import build as ops_build
from gpt2forge.ops.library import LIBRARY_NAME

ARCH_80_90 = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]


def script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{text}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture()
def toolkit(fake_cuda, tmp_path, monkeypatch) -> Path:
    """A CUDA 12.8 toolkit of scripts (CUDA_HOME, as torch finds it from the nvcc on PATH) and a C++
    compiler that answers `--version` and accepts the OpenMP probe."""
    home = tmp_path / "cuda"
    script(home / "bin" / "nvcc", 'echo "Cuda compilation tools, release 12.8, V12.8.93"')
    (home / "lib64").mkdir()
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime_api.h").write_text("// the runtime's header\n")
    cxx = script(tmp_path / "bin" / "c++", 'echo "c++ (fake) 13.2.0"')
    monkeypatch.setenv("PATH", f"{home / 'bin'}:{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    return home


def build_commands(tmp_path: Path, monkeypatch, capsys) -> tuple[dict[str, list[str]], list[str], str]:
    """(compile command by source name, link command, printed summary) of a build of one .cpp and one .cu."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "op.cpp").write_text("// host op\n")
    (src / "kernel.cu").write_text("// device kernel\n")
    ran: dict[str, list[str]] = {}

    def run(steps, verbose, quiet=False):
        for what, cmd in steps:
            ran[what.removeprefix("compiling ")] = cmd
            if what.startswith("linking"):
                Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")  # the library os.replace moves into place

    monkeypatch.setattr(ops_build, "_run", run)
    ops_build.build(tmp_path / "out", verbose=False, source_dir=src)
    link = ran.pop(f"linking {LIBRARY_NAME}")
    return ran, link, capsys.readouterr().out


def test_cu_sources_are_compiled_by_nvcc_for_the_listed_architectures(toolkit, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    monkeypatch.setenv("CC", "/usr/bin/gcc-13")
    compiles, link, out = build_commands(tmp_path, monkeypatch, capsys)
    assert f"custom ops: CUDA     nvcc {toolkit}/bin/nvcc (release 12.8, V12.8.93); torch built with CUDA 12.8" in out
    assert list(compiles) == ["op.cpp", "kernel.cu"]
    nvcc = compiles["kernel.cu"]
    assert nvcc[:3] == [str(toolkit / "bin" / "nvcc"), "-ccbin", "/usr/bin/gcc-13"]
    assert nvcc[nvcc.index("-c") + 1].endswith("kernel.cu") and nvcc[nvcc.index("-o") + 1].endswith("kernel.cu.o")
    assert {"-O3", "-std=c++20", *cpp_extension.COMMON_NVCC_FLAGS, *ARCH_80_90, "-DGPT2FORGE_WITH_CUDA=1"} <= set(nvcc)
    assert nvcc[nvcc.index("--compiler-options") + 1] == "-fPIC"
    assert str(toolkit / "include") in nvcc  # -isystem: the CUDA runtime's headers
    cxx = compiles["op.cpp"]
    assert "-DGPT2FORGE_WITH_CUDA=1" in cxx and str(toolkit / "include") in cxx  # build_info.cpp reads CUDART_VERSION
    assert {"-lc10_cuda", "-ltorch_cuda", "-lcudart", f"-L{toolkit / 'lib64'}"} <= set(link)
    assert [a for a in link if a.endswith(".o")] == [str(Path(link[link.index("-o") + 1]).parent / n)
                                                     for n in ("op.cpp.o", "kernel.cu.o")]


def test_without_an_arch_list_the_visible_gpus_choose(fake_cuda, toolkit, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    fake_cuda.names = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
    fake_cuda.capability = [(9, 0), (8, 0)]
    nvcc = build_commands(tmp_path, monkeypatch, capsys)[0]["kernel.cu"]
    # both GPUs' architectures, and PTX of the newest for GPUs to come
    assert {*ARCH_80_90, "-gencode=arch=compute_90,code=compute_90"} <= set(nvcc)
    assert "-gencode=arch=compute_86,code=sm_86" not in nvcc  # built for, but not here


@pytest.mark.parametrize("arch_list", [None, "native"])
def test_no_gpu_and_no_arch_list_is_refused_with_the_fix(fake_cuda, toolkit, tmp_path, monkeypatch, capsys, arch_list):
    fake_cuda.names = []
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    if arch_list:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    with pytest.raises(ops_build.BuildError, match="no GPU visible .* set TORCH_CUDA_ARCH_LIST"):
        build_commands(tmp_path, monkeypatch, capsys)


def test_a_toolkit_of_another_major_version_builds_without_cuda(toolkit, tmp_path, monkeypatch, capsys):
    script(toolkit / "bin" / "nvcc", 'echo "Cuda compilation tools, release 13.0, V13.0.48"')
    compiles, link, out = build_commands(tmp_path, monkeypatch, capsys)
    assert "torch built with CUDA 12.8, another major version, so the library is built without CUDA and 1 .cu " \
           "source(s) are skipped (point CUDA_HOME at a CUDA 12 toolkit)" in out
    assert list(compiles) == ["op.cpp"] and "-DGPT2FORGE_WITH_CUDA=1" not in compiles["op.cpp"]
    assert "-lcudart" not in link


def test_a_cpu_torch_skips_the_cu_sources(toolkit, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.version.cuda", None)
    compiles, link, out = build_commands(tmp_path, monkeypatch, capsys)
    assert "torch is a CPU build, so 1 .cu source(s) are skipped" in out
    assert list(compiles) == ["op.cpp"] and "-lcudart" not in link


def test_nvcc_is_found_on_path_without_a_cuda_home(toolkit, tmp_path, monkeypatch):
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    found = ops_build.detect_toolchain(tmp_path)
    assert (found.nvcc, found.nvcc_version) == (str(toolkit / "bin" / "nvcc"), "release 12.8, V12.8.93")
    assert not found.cuda_mismatch
    # torch compiles CUDA code against CUDA_HOME's headers (its include_paths raise without one)
    assert not found.cuda


def test_a_cuda_home_without_the_runtime_headers_builds_without_cuda(toolkit, tmp_path, monkeypatch, capsys):
    """An nvcc wrapper script on PATH outside its toolkit: torch guesses CUDA_HOME as the wrapper's
    grandparent, which has no CUDA headers."""
    (toolkit / "include" / "cuda_runtime_api.h").unlink()
    compiles, link, out = build_commands(tmp_path, monkeypatch, capsys)
    assert f"torch's CUDA_HOME ({toolkit}) has no include/cuda_runtime_api.h, so the library is built without " \
           "CUDA and 1 .cu source(s) are skipped (set CUDA_HOME to the toolkit's root)" in out
    assert list(compiles) == ["op.cpp"] and "-DGPT2FORGE_WITH_CUDA=1" not in compiles["op.cpp"]
    assert "-lcudart" not in link
    headers = tmp_path / "cuda-include"
    script(headers / "cuda_runtime_api.h", "")
    monkeypatch.setenv("CUDA_INC_PATH", str(headers))  # torch adds it to the include paths too
    assert ops_build.detect_toolchain(tmp_path).cuda
