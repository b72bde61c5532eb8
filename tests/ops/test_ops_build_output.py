"""What the custom ops build prints (issue 53): a line per compiled file, not the compiler commands;
warnings from our sources but not GCC 12's false ones from its own AVX-512 intrinsics; and for a
failed compile, the command and the compiler's output. Tiny sources, compiled for real."""

import os
import platform
import shutil
from pathlib import Path

import pytest

from gpt2forge.ops import build as ops_build
from gpt2forge.ops.build import BuildError
from gpt2forge.ops.library import LIBRARY_NAME

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                       reason="no C++ compiler ($CXX or c++) to build the custom ops library"),
]

# An AVX-512 lane sum as gemv.cpp's: GCC 12.1-12.2 warns about its own headers where the
# intrinsics are inlined (`'__Y' is used uninitialized`, GCC bug 105593).
AVX512_SUM = """\
#include <immintrin.h>
__attribute__((target("avx512f"))) float lane_sum16(__m512 v) {
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[7];
}
"""
# A helper that takes a 256-bit vector by value, as host_optim_kernels.h's: GCC notes that the ABI
# for passing one changed in GCC 4.6, and a `#pragma GCC diagnostic ignored "-Wpsabi"` does not stop it.
VECTOR_ARGUMENT = """\
#include <immintrin.h>
#pragma GCC diagnostic ignored "-Wpsabi"
struct Avx2 { using V = __m256; };
template <class O> inline typename O::V pass(int i, typename O::V p) { return i ? p : p; }
__attribute__((target("avx2"))) float first(const float* x) {
  float out[8];
  _mm256_storeu_ps(out, pass<Avx2>(1, _mm256_loadu_ps(x)));
  return out[0];
}
"""


def sources(tmp_path: Path, **files: str) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_text(text)
    return src


def test_a_line_per_file_and_no_compiler_commands(tmp_path, capsys):
    src = sources(tmp_path, **{"a.cpp": "int gpt2forge_a() { return 1; }\n",
                               "b.cpp": "int gpt2forge_b() { return 2; }\n"})
    library = ops_build.build(tmp_path / "out", source_dir=src)
    out, err = capsys.readouterr()
    steps = [line for line in out.splitlines() if not line.startswith(("custom ops: compiler ", "custom ops: OpenMP",
                                                                        "custom ops: CUDA", "custom ops: torch"))]
    assert sorted(steps[:2]) == ["custom ops: compiling a.cpp", "custom ops: compiling b.cpp"]  # in parallel
    assert steps[2:-1] == [f"custom ops: linking {LIBRARY_NAME}"]
    assert steps[-1].startswith(f"custom ops: built {library} in ") and err == ""


def test_verbose_adds_the_commands_and_quiet_drops_the_file_lines(tmp_path, capsys):
    src = sources(tmp_path, **{"a.cpp": "int gpt2forge_a() { return 1; }\n"})
    ops_build.build(tmp_path / "loud", verbose=True, source_dir=src)
    out = capsys.readouterr().out
    assert "custom ops: compiling a.cpp" in out and any(f" -c {src / 'a.cpp'} " in line for line in out.splitlines())
    ops_build.build(tmp_path / "quiet", quiet=True, source_dir=src)
    out = capsys.readouterr().out
    assert "compiling" not in out and "linking" not in out and "custom ops: built" in out
    with pytest.raises(SystemExit):
        ops_build.main(["build", "--quiet", "--verbose"])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX-512 intrinsics: x86 only")
def test_our_warnings_show_and_gccs_notes_on_its_headers_do_not(tmp_path, capsys):
    ours = "int gpt2forge_w() { int unused_here = 3; return 1; }\n"
    src = sources(tmp_path, **{"avx512_sum.cpp": AVX512_SUM, "vector_argument.cpp": VECTOR_ARGUMENT, "ours.cpp": ours})
    ops_build.build(tmp_path / "out", source_dir=src)
    out, err = capsys.readouterr()
    assert "unused_here" in err and "-Wunused-variable" in err  # ours, from -Wall
    assert "intrin.h" not in err and "__Y" not in err and "ABI" not in err
    assert " -c " not in out + err  # a warning is no reason to print the command


def test_a_failed_compile_shows_its_command_and_the_compilers_output(tmp_path, capsys):
    src = sources(tmp_path, **{"broken.cpp": "int broken( {\n", "fine.cpp": "int gpt2forge_f() { return 1; }\n"})
    with pytest.raises(BuildError, match=r"compiling broken\.cpp \(exit \d+\) failed"):
        ops_build.build(tmp_path / "out", source_dir=src)
    err = capsys.readouterr().err
    head, command = err.splitlines()[:2]
    assert head.startswith("custom ops: compiling broken.cpp failed (exit ")
    assert f" -c {src / 'broken.cpp'} " in command and " -O3 " in command and "fine.cpp" not in command
    assert "broken.cpp:1" in err and "error" in err  # the compiler's own message follows
