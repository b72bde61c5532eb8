"""Custom ops library: build, load, the not-built fallback, and each op against its reference.

The tests load the library `make` built (what `make test` builds first, with the same build
function) when it is newer than every source; otherwise they build it once per session into a
temporary directory (a minute on two cores). They skip when no C++ compiler is found.
"""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2forge.ops import build as ops_build
from gpt2forge.ops import library as custom_ops
from gpt2forge.ops.build import BuildError
from gpt2forge.ops.library import LIBRARY_ENV, LIBRARY_NAME

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="no C++ compiler ($CXX or c++) to build the custom ops library",
)


@pytest.fixture(scope="session")
def ops_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The library `make` built, when it is newer than every source; else one built once per
    session from custom_ops/ into a temporary directory."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler ($CXX or c++) to build the custom ops library")
    built = custom_ops.library_path()  # this venv's: a library of another torch's ABI must not load
    sources = [*ops_build.SOURCE_DIR.iterdir(), Path(ops_build.__file__)]
    if built.is_file() and built.stat().st_mtime > max(s.stat().st_mtime for s in sources):
        return built
    return ops_build.build(tmp_path_factory.mktemp("custom_ops"), verbose=False)


@pytest.fixture
def ops(ops_library: Path, monkeypatch: pytest.MonkeyPatch):
    """`torch.ops.gpt2forge`, loaded through load_custom_ops() from the session's build."""
    monkeypatch.setenv(LIBRARY_ENV, str(ops_library))
    custom_ops.load_custom_ops.cache_clear()
    assert custom_ops.load_custom_ops()
    yield torch.ops.gpt2forge
    custom_ops.load_custom_ops.cache_clear()


@pytest.fixture
def no_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A process state in which the library has not been built."""
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "missing" / LIBRARY_NAME))
    custom_ops.load_custom_ops.cache_clear()
    yield
    custom_ops.load_custom_ops.cache_clear()


def _run_cli(*args: str, library: Path) -> subprocess.CompletedProcess:
    """`python -m gpt2forge.ops.build ARGS` in a fresh interpreter, loading `library`."""
    env = {**os.environ, LIBRARY_ENV: str(library), "PYTHONPATH": str(custom_ops.REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gpt2forge.ops.build", *args],
        cwd=custom_ops.REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_library_path_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv(LIBRARY_ENV, raising=False)
    build = custom_ops.REPO_ROOT / "build"
    for prefix, base_prefix, expected in [
        ("/repo/.venv", "/usr", build / "custom_ops"),  # the Makefile's default venv
        ("/usr", "/usr", build / "custom_ops"),  # no venv
        ("/repo/.venv-torch2.11", "/usr", build / ".venv-torch2.11" / "custom_ops"),  # another torch's ABI
    ]:
        monkeypatch.setattr(sys, "prefix", prefix)
        monkeypatch.setattr(sys, "base_prefix", base_prefix)
        assert custom_ops.library_path() == expected / LIBRARY_NAME
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "other.so"))
    assert custom_ops.library_path() == tmp_path / "other.so"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("venv", [".venv", ".venv-torch2.11"])
def test_makefile_builds_where_the_loader_looks(monkeypatch: pytest.MonkeyPatch, venv: str):
    """The Makefile's OPS_DIR and library_path() agree for the default venv and another one."""
    listing = subprocess.run(["make", "-n", "-B", f"VENV={venv}", "custom_ops"], cwd=custom_ops.REPO_ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    out_dir = re.search(r"gpt2forge\.ops\.build build --out-dir (\S+)", listing)[1]
    monkeypatch.delenv(LIBRARY_ENV, raising=False)
    monkeypatch.setattr(sys, "prefix", str(custom_ops.REPO_ROOT / venv))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    assert custom_ops.REPO_ROOT / out_dir / LIBRARY_NAME == custom_ops.library_path()


# --- build_info -------------------------------------------------------------------------------


@pytest.mark.slow
def test_build_info_reports_toolchain(ops, tmp_path: Path):
    info = ops.build_info()
    toolchain = ops_build.detect_toolchain(tmp_path)
    if toolchain.openmp:
        assert re.search(r"OpenMP yes \(\d+, max threads \d+\)", info), info
    else:
        assert "OpenMP no" in info, info
    assert ("CUDA yes" if toolchain.cuda else "CUDA no") in info, info
    assert re.search(r"(GCC|clang|MSVC) \d+", info), info
    torch_release = re.match(r"\d+\.\d+\.\d+", torch.__version__).group()
    assert f"torch {torch_release}" in info, info
    assert custom_ops.build_info() == info


# --- scaled_add_: the compiled kernel against its reference ----------------------------------


@pytest.mark.parametrize("alpha", [0.5, -1.75])
# Empty, single, odd lengths, a 3-d shape, and one long enough for the OpenMP region
# (> 2 * 32768 elements) that does not split evenly across threads.
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (1023,), (3, 5, 7), (100_003,)])
def test_scaled_add_matches_reference(ops, shape: tuple[int, ...], alpha: float):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    y = torch.randn(shape, generator=gen)
    y_before = y.clone()
    expected = custom_ops.scaled_add_reference(x.clone(), y, alpha)

    out = ops.scaled_add_(x, y, alpha)

    assert out is x  # in place
    torch.testing.assert_close(x, expected)
    assert torch.equal(y, y_before)


BAD_ARGUMENTS = {
    "float64 x": (lambda: (torch.zeros(4, dtype=torch.float64), torch.zeros(4)), TypeError),
    "int64 y": (lambda: (torch.zeros(4), torch.zeros(4, dtype=torch.int64)), TypeError),
    "shape": (lambda: (torch.zeros(2, 3), torch.zeros(3, 2)), ValueError),
    "strided x": (lambda: (torch.zeros(8)[::2], torch.zeros(4)), ValueError),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_scaled_add_rejects_bad_arguments_like_reference(ops, case: str):
    make_args, error = BAD_ARGUMENTS[case]
    with pytest.raises(error) as from_kernel:
        ops.scaled_add_(*make_args(), 1.0)
    with pytest.raises(error) as from_reference:
        custom_ops.scaled_add_reference(*make_args(), 1.0)
    assert str(from_kernel.value).splitlines()[0] == str(from_reference.value)


def test_scaled_add_dtype_message():
    with pytest.raises(TypeError, match=r"expected float32 tensors, got x float64 and y float32"):
        custom_ops.scaled_add_reference(torch.zeros(2, dtype=torch.float64), torch.zeros(2), 1.0)


@pytest.mark.slow
def test_scaled_add_routes_to_kernel_without_grad_and_reference_with_grad(
    ops, monkeypatch: pytest.MonkeyPatch
):
    reference = custom_ops.scaled_add_reference
    calls = []
    monkeypatch.setattr(
        custom_ops, "scaled_add_reference", lambda *a: calls.append(a) or reference(*a)
    )
    x, y = torch.ones(5), torch.arange(5.0)
    assert custom_ops.scaled_add_(x, y, 2.0) is x
    assert x.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]
    assert calls == []  # the compiled kernel ran

    # The kernel has no autograd formula: differentiable calls take the reference.
    leaf = torch.ones(3, requires_grad=True)
    y = torch.arange(3.0, requires_grad=True)
    out = custom_ops.scaled_add_(leaf.clone(), y, 2.0)
    out.sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(out.detach(), torch.tensor([1.0, 3.0, 5.0]))
    torch.testing.assert_close(y.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(leaf.grad, torch.ones(3))


# --- the loader ----------------------------------------------------------------------------


def test_loader_without_library_prints_one_notice_and_falls_back(
    no_library, capsys: pytest.CaptureFixture
):
    assert custom_ops.load_custom_ops() is False
    assert custom_ops.load_custom_ops() is False
    assert custom_ops.build_info() is None
    assert capsys.readouterr().err == custom_ops.NOT_BUILT_NOTICE + "\n"

    x = torch.ones(3)
    assert custom_ops.scaled_add_(x, torch.arange(3.0), 2.0) is x
    assert x.tolist() == [1.0, 3.0, 5.0]


@pytest.mark.slow
def test_unloadable_library_falls_back_with_rebuild_hint(tmp_path: Path):
    # A file that dlopen rejects stands in for a library built against another torch. Run in a
    # fresh interpreter: this one may already hold the ops from the session build.
    broken = tmp_path / LIBRARY_NAME
    broken.write_bytes(b"not a shared library")
    result = _run_cli("info", library=broken)
    assert result.returncode == 1
    notice = result.stderr.strip()
    assert len(notice.splitlines()) == 1, result.stderr
    assert f"custom ops library {broken} failed to load" in notice
    assert "using the PyTorch reference implementations" in notice
    assert "make clean && make" in notice


@pytest.mark.slow
def test_cli_info_loads_library_in_fresh_process(ops_library: Path):
    result = _run_cli("info", library=ops_library)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{ops_library}: gpt2forge_ops: ")
    assert "OpenMP" in result.stdout


# --- atomic build and clean ------------------------------------------------------------------


@pytest.mark.slow
@needs_compiler
def test_failed_link_keeps_previous_library_and_no_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A stand-in compiler that compiles normally but, when linking, writes half a library to its
    # -o path and dies: what a killed or failing linker leaves behind.
    real_cxx = shutil.which(os.environ.get("CXX", "c++"))
    fake_cxx = tmp_path / "cxx"
    fake_cxx.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -shared "*)\n'
        '  while [ $# -gt 0 ]; do [ "$1" = "-o" ] && printf partial > "$2"; shift; done\n'
        "  exit 1;;\n"
        "esac\n"
        f'exec "{real_cxx}" "$@"\n'
    )
    fake_cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake_cxx))
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text("int gpt2forge_tiny() { return 1; }\n")
    out = tmp_path / "out"
    out.mkdir()
    previous = out / LIBRARY_NAME
    previous.write_bytes(b"previous library")

    with pytest.raises(BuildError, match=f"linking {LIBRARY_NAME}"):
        ops_build.build(out, verbose=False, source_dir=src)

    assert previous.read_bytes() == b"previous library"
    assert list(out.iterdir()) == [previous]  # the scratch directory is gone too


@pytest.mark.slow
@needs_compiler
def test_compile_error_names_the_source_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.cpp").write_text("int broken( {\n")
    out = tmp_path / "out"

    with pytest.raises(BuildError, match=r"broken\.cpp \(exit \d+\) failed"):
        ops_build.build(out, verbose=False, source_dir=src)

    assert "broken.cpp" in capsys.readouterr().err  # the compiler's own message is shown
    assert list(out.iterdir()) == []


def test_clean_removes_library_and_scratch_only(tmp_path: Path):
    (tmp_path / LIBRARY_NAME).write_bytes(b"library")
    scratch = tmp_path / f"{ops_build.TEMP_PREFIX}killed"
    scratch.mkdir()
    (scratch / "build_info.cpp.o").write_bytes(b"object")
    (tmp_path / "keep.txt").write_text("not ours")

    removed = ops_build.clean(tmp_path)

    assert sorted(removed) == sorted([tmp_path / LIBRARY_NAME, scratch])
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("rows,K,N,bias", [(1, 768, 2304, True), (3, 37, 101, True), (4, 64, 9, False),
                                           (8, 3072, 96, True), (13, 40, 257, False), (16, 17, 33, True)])
@pytest.mark.slow
def test_gemv_linear_matches_f_linear(ops, rows: int, K: int, N: int, bias: bool):
    # 1, 4 and 8 rows use the 1-, 4- and 8-row AVX2 paths; 3, 13 and 16 mix them; K = 17, 37, 40
    # leave a tail after the 16-float steps.
    g = torch.Generator().manual_seed(rows * K)
    x, W = torch.randn(rows, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    torch.testing.assert_close(ops.gemv_linear(x, W, b), torch.nn.functional.linear(x, W, b), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 5, 8, 40])
def test_gemv_linear_bf16_weights_match_fp32_math_rounded_once(ops, rows: int):
    # bf16 weights are widened in registers and accumulated in fp32: the result is the fp32
    # product of the bf16 values, rounded to bf16 once (ATen's CPU bf16 matmul rounds the same way).
    g = torch.Generator().manual_seed(rows)
    x, W, b = torch.randn(rows, 771, generator=g), torch.randn(300, 771, generator=g), torch.randn(300, generator=g)
    x, W, b = x.bfloat16(), W.bfloat16(), b.bfloat16()
    y = ops.gemv_linear(x, W, b)
    assert y.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x.float(), W.float(), b.float())
    torch.testing.assert_close(y.float(), want, rtol=8e-3, atol=8e-3)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streams", [4, 8])
@pytest.mark.parametrize("rows,K,N,dtype", [(1, 768, 1000, torch.float32), (1, 771, 129, torch.float32),
                                            (1, 24, 7, torch.float32), (5, 40, 300, torch.float32),
                                            (1, 771, 300, torch.bfloat16), (1, 64, 40000, torch.float32),
                                            (3, 64, 20000, torch.bfloat16)])
def test_gemv_linear_on_several_threads_matches_f_linear(ops, threads: int, streams: int, rows: int, K: int,
                                                         N: int, dtype: torch.dtype):
    # W goes out in guided chunks to the caller and its helpers: each 1/(2 x threads) of the rows
    # left, between 64 KiB and 1.5 MiB, a multiple of the streams at batch 1; one row of x reads
    # `streams` slices of a chunk at once. N = 1000 (3 KiB rows): chunks of 250, 188, ... down to 21
    # rows; N = 40000 and 20000 (256 and 128 B rows): chunks capped at 1.5 MiB, then shrinking;
    # N = 129: a last chunk of a few rows; N = 7: fewer rows than slices; K = 771 and 24 leave a
    # tail after the 8-float steps.
    g = torch.Generator().manual_seed(N * K + rows)
    x, W, b = torch.randn(rows, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x, W, b = x.to(dtype), W.to(dtype), b.to(dtype)
    threads_before, streams_before = ops.gemv_set_threads(threads), ops.gemv_set_streams(streams)
    try:
        ys = [ops.gemv_linear(x, W, b) for _ in range(20)]
    finally:
        ops.gemv_set_threads(threads_before)
        ops.gemv_set_streams(streams_before)
    want = torch.nn.functional.linear(x.float(), W.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(ys[0].float(), want, rtol=tol, atol=tol * (K / 64) ** 0.5)
    for y in ys[1:]:  # every row is summed the same way whichever thread takes it: bit for bit
        assert torch.equal(y, ys[0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_linear_results_do_not_depend_on_threads_streams_or_prefetch(ops, dtype: torch.dtype):
    # The chunks (and so which rows fall in a chunk's streams or its remainder) change with the
    # thread and stream counts; every row's sum is taken the same way all the same, and the prefetch
    # hint changes only how W reaches the cache. N = 7, 13, 30: rows past the last multiple of 4 or 8
    # (the streams' remainder) in some settings. Three rows of x: the packed several-rows loop.
    g = torch.Generator().manual_seed(7)
    before = ops.gemv_set_threads(1), ops.gemv_set_streams(4), ops.gemv_set_prefetch(1)
    try:
        for N in (7, 13, 30, 4099):
            W = torch.randn(N, 771, generator=g).to(dtype)
            for x in (torch.randn(1, 771, generator=g).to(dtype), torch.randn(3, 771, generator=g).to(dtype)):
                ys = []
                for threads in (1, 2, 3):
                    for streams in (4, 8):
                        for prefetch in (0, 1):
                            ops.gemv_set_threads(threads)
                            ops.gemv_set_streams(streams)
                            ops.gemv_set_prefetch(prefetch)
                            ys.append(ops.gemv_linear(x, W, None))
                for y in ys[1:]:
                    assert torch.equal(y, ys[0]), f"N = {N}, {len(x)} rows"
    finally:
        ops.gemv_set_threads(before[0])
        ops.gemv_set_streams(before[1])
        ops.gemv_set_prefetch(before[2])


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the same bits alone and in a batch is a property of the AVX2 loops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lanes", [8, 16])
def test_gemv_linear_gives_a_row_the_same_bits_alone_and_in_a_batch(ops, dtype: torch.dtype, lanes: int):
    # Batches of 2-16 rows go 8, 4 and 1 rows at a time through x packed per group; every row's
    # sum is the one the batch-1 streams take (K = 771 leaves a tail after the packed steps), with
    # AVX2's 8 lanes and with AVX-512's 16 alike (each in its own order). The 16-lane loops also
    # agree with F.linear.
    from gpt2forge.generate.gemv import lane_choices
    if lanes not in lane_choices():
        pytest.skip("16 lanes need AVX-512")
    g = torch.Generator().manual_seed(3)
    x, W = torch.randn(16, 771, generator=g).to(dtype), torch.randn(300, 771, generator=g).to(dtype)
    b = torch.randn(300, generator=g).to(dtype)
    before = ops.gemv_set_lanes(lanes)
    try:
        alone = torch.cat([ops.gemv_linear(x[i:i + 1], W, b) for i in range(16)])
        for M in (2, 5, 8, 13, 16):
            assert torch.equal(ops.gemv_linear(x[:M], W, b), alone[:M]), f"{M} rows"
    finally:
        ops.gemv_set_lanes(before)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    want = torch.nn.functional.linear(x.float(), W.float(), b.float())
    torch.testing.assert_close(alone.float(), want, rtol=tol, atol=tol * 4)


@pytest.mark.slow
def test_gemv_set_streams_returns_the_previous_count_and_takes_only_4_or_8(ops):
    from gpt2forge.generate.gemv import gemv_streams
    before = ops.gemv_set_streams(8)
    try:
        assert ops.gemv_set_streams(4) == 8
        for wrong in (0, 2, 5, 16):
            with pytest.raises(RuntimeError, match="expected 4 or 8 read streams"):
                ops.gemv_set_streams(wrong)
        assert ops.gemv_set_streams(8) == 4
        with gemv_streams(4):  # the Python side: set inside the block, restored after
            assert ops.gemv_set_streams(4) == 4
        assert ops.gemv_set_streams(8) == 8
        with pytest.raises(ValueError, match="one of \\(4, 8\\), got 5"):
            gemv_streams(5)
    finally:
        ops.gemv_set_streams(before)


def test_gemv_set_lanes_takes_8_and_16_where_the_cpu_has_avx512(ops):
    from gpt2forge.generate.gemv import gemv_lanes, lane_choices
    before = ops.gemv_set_lanes(8)
    try:
        for wrong in (0, 4, 32):
            with pytest.raises(RuntimeError, match="expected 8 \\(AVX2\\) or 16 \\(AVX-512\\) lanes"):
                ops.gemv_set_lanes(wrong)
        if 16 in lane_choices():
            assert ops.gemv_set_lanes(16) == 8
            with gemv_lanes(8):
                assert ops.gemv_set_lanes(8) == 8
            assert ops.gemv_set_lanes(16) == 16
        else:
            with pytest.raises(RuntimeError, match="16 lanes need"):
                ops.gemv_set_lanes(16)
        with pytest.raises(ValueError, match="8 or 16, got 12"):
            gemv_lanes(12)
    finally:
        ops.gemv_set_lanes(before)


def test_gemv_set_prefetch_returns_the_previous_hint_and_takes_only_nta_or_t2(ops):
    from gpt2forge.generate.gemv import gemv_prefetch
    before = ops.gemv_set_prefetch(0)
    try:
        assert ops.gemv_set_prefetch(1) == 0
        for wrong in (-1, 2, 3):
            with pytest.raises(RuntimeError, match="expected 0 \\(non-temporal, prefetchnta\\) or 1"):
                ops.gemv_set_prefetch(wrong)
        with gemv_prefetch("nta"):  # the Python side: set inside the block, restored after
            assert ops.gemv_set_prefetch(0) == 0
        assert ops.gemv_set_prefetch(1) == 1
        with pytest.raises(ValueError, match="one of \\('t2', 'nta'\\), got 't0'"):
            gemv_prefetch("t0")
    finally:
        ops.gemv_set_prefetch(before)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the flush modes are x86's (MXCSR)")
def test_flush_denormals_sets_every_intra_op_thread_and_undoes(ops):
    from gpt2forge.ops.fp_mode import denormals_flushed, flush_denormals
    tiny = torch.full((1 << 20,), 1e-30)  # times 1e-10: 1e-40, a denormal; one parallel multiply on 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    before = ops.denormals_flushed()
    try:
        assert flush_denormals(False) == 2  # the caller and the other intra-op thread
        assert not ops.denormals_flushed() and torch.count_nonzero(tiny * 1e-10) == tiny.numel()
        assert flush_denormals() == 2
        assert ops.denormals_flushed()
        assert torch.count_nonzero(tiny * 1e-10) == 0  # every chunk of the multiply, whichever thread ran it
        flush_denormals(False)
        with denormals_flushed(torch.device("cpu")):  # the trainer's block: on inside, the caller's mode after
            assert torch.count_nonzero(tiny * 1e-10) == 0
        assert not ops.denormals_flushed() and torch.count_nonzero(tiny * 1e-10) == tiny.numel()
    finally:
        flush_denormals(before)
        torch.set_num_threads(threads)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: the caller's and a helper's")
def test_pool_round_trip_is_a_positive_time_and_refuses_no_rounds(ops):
    # NaN when no helper thread took part within 100 ms (a loaded machine's scheduler): five tries
    reads = [ops.pool_round_trip_ns(2000) for _ in range(5)]
    finite = [ns for ns in reads if not math.isnan(ns)]
    assert finite, reads
    assert all(0 < ns < 1e6 for ns in finite), reads  # a cache line between two cores: tens to hundreds of ns
    with pytest.raises(RuntimeError, match="expected rounds >= 1"):
        ops.pool_round_trip_ns(0)


@pytest.mark.slow
def test_gemv_set_threads_returns_the_previous_count_and_refuses_negative_ones(ops):
    before = ops.gemv_set_threads(3)
    try:
        assert ops.gemv_set_threads(2) == 3
        with pytest.raises(RuntimeError, match="thread count >= 0"):
            ops.gemv_set_threads(-1)
        assert ops.gemv_set_threads(0) == 2
    finally:
        ops.gemv_set_threads(before)


@pytest.mark.slow
def test_gemv_linear_falls_back_where_the_kernel_does_not_apply(ops, monkeypatch: pytest.MonkeyPatch):
    from gpt2forge.generate import gemv
    calls = []
    kernel = ops.gemv_linear
    monkeypatch.setattr(torch.ops.gpt2forge, "gemv_linear", lambda *a: calls.append(1) or kernel(*a))
    W = torch.randn(5, 8, requires_grad=True)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert gemv.gemv_linear(x, W).shape == (2, 3, 5) and calls == [1]  # 6 rows: the kernel
        gemv.gemv_linear(torch.randn(17, 8), W)  # prefill-sized: F.linear
        gemv.gemv_linear(x.half(), W.half())  # fp16: F.linear
    y = gemv.gemv_linear(x, W)  # gradients wanted: F.linear, differentiable
    y.sum().backward()
    assert calls == [1] and W.grad is not None


@pytest.mark.slow
def test_with_gemv_linears_shares_weights_and_leaves_the_model_alone(ops):
    from gpt2forge.generate.gemv import GemvLinear, with_gemv_linears
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    model = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)).train()
    view = with_gemv_linears(model).eval()
    assert isinstance(view.transformer.h["1"].mlp.c_fc, GemvLinear) and isinstance(view.lm_head, GemvLinear)
    assert isinstance(model.transformer.h["1"].mlp.c_fc, torch.nn.Linear) and model.training
    assert [id(p) for p in view.parameters()] == [id(p) for p in model.parameters()]
    ids = torch.randint(0, 96, (3, 1))
    with torch.no_grad():
        step = torch.compile(lambda i: view.logits(view.transformer(i)), fullgraph=True)
        torch.testing.assert_close(step(ids), model.eval().logits(model.transformer(ids)), rtol=1e-5, atol=1e-5)
    assert with_gemv_linears(model.half()) is model  # fp16: nothing to swap


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, slot: int,
                 scale: float) -> torch.Tensor:
    """The reference: SDPA over every slot under the cache's mask, in fp32."""
    from gpt2forge.generate.kv_cache import attention_mask
    mask = attention_mask(pad, torch.tensor([slot]), k.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            scale=scale)


@pytest.mark.parametrize("slot", [0, 5, 23])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_masked_sdpa(ops, slot: int, threads: int):
    # Rows with 0, 3 and 9 padding slots: at slot 5 the last row's query is padding (attends to itself).
    B, H, S, D = 3, 4, 24, 20  # D not a multiple of 8: the dot's tail
    g = torch.Generator().manual_seed(slot)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (1, S, S))
    k[:, :, slot + 1:] = float("nan")  # slots not written yet must never be read
    v[:, :, slot + 1:] = float("nan")
    pad = torch.tensor([0, 3, 9])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.decode_attention(q, k, v, pad, torch.tensor([slot]), 0.3)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (B, H, 1, D) and out.dtype == torch.float32
    torch.testing.assert_close(out, _masked_sdpa(q, k.nan_to_num(), v.nan_to_num(), pad, slot, 0.3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slot", [2, 7, 16, 44])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_head_size_64_matches_masked_sdpa(ops, slot: int, threads: int):
    # GPT-2's head size takes the AVX2 path where the CPU has it (keys scored 8 at a time, the rest
    # one by one): filled spans of 1 to 45 slots cover fewer than 8 keys, whole blocks and a tail.
    B, H, S, D = 3, 5, 48, 64
    g = torch.Generator().manual_seed(slot)
    q, k, v = (torch.randn(B, H, n, D, generator=g) * 2 for n in (1, S, S))
    k[:, :, slot + 1:] = float("nan")
    v[:, :, slot + 1:] = float("nan")
    pad = torch.tensor([0, 1, 6])
    before = ops.gemv_set_threads(threads)
    try:
        out = ops.decode_attention(q, k, v, pad, torch.tensor([slot]), 0.125)
    finally:
        ops.gemv_set_threads(before)
    torch.testing.assert_close(out, _masked_sdpa(q, k.nan_to_num(), v.nan_to_num(), pad, slot, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_decode_attention_bf16_is_fp32_math_rounded_once(ops):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 64, generator=g).bfloat16() for n in (1, 16, 16))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous query, as the model's split makes
    pad = torch.tensor([2, 0])
    out = ops.decode_attention(q, k, v, pad, torch.tensor([11]), 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _masked_sdpa(q, k, v, pad, 11, 0.125).bfloat16(), rtol=0, atol=0.008)


@pytest.mark.parametrize("case,match", [
    ("slot", "slot 8 outside the cache's 8 slots"),
    ("shape", "expected q"),
    ("dtype", "all float32 or all bfloat16"),
    ("pad", "negative padding"),
])
def test_decode_attention_refuses_bad_arguments(ops, case: str, match: str):
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    pad, slot = torch.tensor([0]), torch.tensor([3])
    if case == "slot":
        slot = torch.tensor([8])
    elif case == "shape":
        q = torch.randn(1, 2, 2, 4)
    elif case == "dtype":
        q = q.double()
    else:
        pad = torch.tensor([-1])
    with pytest.raises(RuntimeError, match=match):
        ops.decode_attention(q, k, v, pad, slot, 1.0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("V", [1, 7, 31, 32, 65, 100, 8191, 8192, 8193, 20000, 50257])
def test_argmax_rows_equals_torch_argmax(ops, V: int, threads: int):
    # Parts of 8192 values shared by the pool's threads, 32 values a step and a scalar tail. Row 0:
    # random; 1: few distinct values, so the largest repeats (the first one wins, across lanes and
    # parts); 2: all -inf; 3: the largest value twice, early and last; 4: NaNs (the first NaN wins,
    # torch's rule) after a +inf. The rows are a strided view, as the logits cut to the vocabulary are.
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V + 3, generator=g)[:, :V]
    x[1] = x[1].mul(0.7).round()
    x[2] = float("-inf")
    x[3, V // 3] = x[3, V - 1] = 100.0
    x[4, V // 2] = float("inf")
    x[4, (2 * V) // 3:] = float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.argmax_rows(x)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert ops.argmax_rows(x.contiguous()).tolist() == got.tolist()


@pytest.mark.parametrize("x", [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(6), torch.zeros(2, 0)],
                         ids=["float64", "1-d", "empty rows"])
def test_argmax_rows_refuses_what_it_does_not_take(ops, x: torch.Tensor):
    with pytest.raises(RuntimeError, match="expected a CPU float32 tensor"):
        ops.argmax_rows(x)


def test_greedy_choice_takes_the_op_for_cpu_fp32_logits_and_torch_otherwise(ops, monkeypatch: pytest.MonkeyPatch):
    from gpt2forge.generate import sampling
    calls = []
    kernel = ops.argmax_rows
    monkeypatch.setattr(torch.ops.gpt2forge, "argmax_rows", lambda x: calls.append(x.dtype) or kernel(x))
    logits = torch.randn(3, 60, generator=torch.Generator().manual_seed(0))
    greedy = sampling.SamplingConfig(greedy=True)
    want = logits[:, :50].argmax(-1).tolist()
    assert sampling.next_token(logits, greedy, 50).tolist() == want
    assert sampling.next_token(logits.bfloat16(), greedy, 50).tolist() == logits[:, :50].bfloat16().argmax(-1).tolist()
    assert calls == [torch.float32, torch.float32]  # bf16 logits are widened first
    assert sampling.argmax_rows(logits.double()).tolist() == logits.argmax(-1).tolist()  # torch's
    assert len(calls) == 2


def test_cached_lm_runs_the_decode_kernel_for_one_query_only(ops, monkeypatch: pytest.MonkeyPatch):
    from gpt2forge.generate.kv_cache import CachedLM
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    model = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    calls = []
    kernel = ops.decode_attention
    monkeypatch.setattr(torch.ops.gpt2forge, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    lm = CachedLM(model, batch_size=2, max_len=16)
    pad = torch.tensor([0, 2])
    with torch.no_grad():
        lm(torch.randint(0, 96, (2, 4)), torch.arange(4), pad)  # prefill: SDPA
        assert calls == []
        lm(torch.randint(0, 96, (2, 1)), torch.tensor([4]), pad)
    assert calls == [1, 1]  # one per layer
    assert not CachedLM(model.double(), batch_size=1, max_len=8).decode_kernel  # fp64: SDPA


@pytest.mark.parametrize("weights", [
    (0.5, 0.3, 0.2), (1, 1, 1), (0.1,) * 10, (1e-3, 1 - 1e-3), (7,), (3, 1, 4, 1, 5, 9, 2, 6, 5, 3),
])
@pytest.mark.parametrize("size", [0, 1, 2, 4099])
def test_blending_indices_op_equals_the_python_order(ops, weights, size: int):
    from gpt2forge.data import blend

    w = blend.normalize(weights)
    index, sample = ops.build_blending_indices(torch.tensor(w, dtype=torch.float64), size)
    ref_index, ref_sample = blend.blending_indices_reference(w, size)
    assert index.dtype == torch.int16 and sample.dtype == torch.int64
    assert index.numpy().tolist() == ref_index.tolist() and sample.numpy().tolist() == ref_sample.tolist()


@pytest.mark.parametrize("sizes", [(7, 3, 5), (5, 0, 2), (1,), (100, 1, 1, 37)])
def test_exhaustive_blending_indices_op_equals_the_python_order(ops, sizes):
    from gpt2forge.data import blend

    index, sample = ops.build_exhaustive_blending_indices(torch.tensor(sizes, dtype=torch.int64))
    ref_index, ref_sample = blend.exhaustive_indices_reference(sizes)
    assert index.numpy().tolist() == ref_index.tolist() and sample.numpy().tolist() == ref_sample.tolist()


@pytest.mark.parametrize("call,match", [
    (lambda o: o.build_blending_indices(torch.tensor([0.5, 0.5]), 3), "1-D float64"),
    (lambda o: o.build_blending_indices(torch.tensor([0.5, -0.5], dtype=torch.float64), 3), "weight 1 is -0.5"),
    (lambda o: o.build_blending_indices(torch.tensor([0.5, 0.5], dtype=torch.float64), -1), "size -1"),
    (lambda o: o.build_blending_indices(torch.zeros(0, dtype=torch.float64), 3), "0 corpora"),
    (lambda o: o.build_exhaustive_blending_indices(torch.tensor([3, -1])), "size 1 is -1"),
    (lambda o: o.build_exhaustive_blending_indices(torch.zeros(32768, dtype=torch.int64)), "32768 corpora"),
])
def test_blending_ops_refuse_bad_arguments(ops, call, match: str):
    with pytest.raises(ValueError, match=match):
        call(ops)


def test_blend_order_without_the_library_is_the_python_order(no_library):
    from gpt2forge.data import blend

    index, sample = blend.blending_indices([0.6, 0.4], 50)
    ref = blend.blending_indices_reference([0.6, 0.4], 50)
    assert index.tolist() == ref[0].tolist() and sample.tolist() == ref[1].tolist()
    assert blend.exhaustive_indices([3, 4])[0].tolist() == blend.exhaustive_indices_reference([3, 4])[0].tolist()


def test_dropout_mask_keeps_the_asked_share_reproducibly_on_any_thread_count(ops):
    n, threshold = 1_000_003, 3277  # p = 0.1 rounded to 15 bits
    mask = ops.dropout_mask(n, threshold, 12345)
    assert mask.dtype == torch.bool and mask.shape == (n,)
    kept = 1 - threshold / 2**15
    sd = (kept * (1 - kept) / n) ** 0.5
    assert abs(mask.double().mean().item() - kept) < 5 * sd
    # Neighbours (lanes of one word, and across words) are independent: P(both kept) = kept^2.
    both = (mask[:-1] & mask[1:]).double().mean().item()
    assert abs(both - kept**2) < 5 * (kept**2 * (1 - kept**2) / n) ** 0.5
    assert torch.equal(mask, ops.dropout_mask(n, threshold, 12345))
    assert not torch.equal(mask, ops.dropout_mask(n, threshold, 12346))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mask, ops.dropout_mask(n, threshold, 12345))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ops.dropout_mask(7, threshold, 12345), mask[:7])  # a prefix of the same stream
    assert bool(ops.dropout_mask(1000, 0, 1).all()) and not bool(ops.dropout_mask(1000, 2**15, 1).any())
    with pytest.raises(ValueError, match="threshold 32769"):
        ops.dropout_mask(10, 2**15 + 1, 1)


def test_dropout_keep_mask_draws_its_seed_from_torchs_generator(ops):
    from gpt2forge.model.dropout import dropout_keep_mask, kept_fraction

    x = torch.empty(3, 50, 70)
    torch.manual_seed(0)
    a, b = dropout_keep_mask(x, 0.1), dropout_keep_mask(x, 0.1)
    torch.manual_seed(0)
    assert torch.equal(a, dropout_keep_mask(x, 0.1)) and not torch.equal(a, b)
    assert a.shape == x.shape and abs(a.float().mean().item() - kept_fraction(0.1)) < 0.02
