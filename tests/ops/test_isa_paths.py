"""Each instruction-set path of the custom ops, forced by GPT2FORGE_OPS_ISA, against the scalar path and the
PyTorch references, on inputs where every path must agree (issue 57): a path that turns wrong, or falls back to
another, on one CPU class shows on any machine that can run it.

The paths each op has (custom_ops/isa.h chooses; GCC on x86-64, other compilers build the scalar form of the
clones alone):
- gemv_linear (gemv.cpp), hence the decode step's matmuls: scalar (dots_portable), AVX2 (8 lanes:
  stream_dots_avx2, packed_dots_avx2), AVX-512 (16 lanes, taken after gemv_set_lanes(16), which only the
  avx512 path accepts).
- decode_attention (decode_attention.cpp): attend_one as baseline and AVX2 clones, and attend64_avx2 for
  head size 64. No AVX-512 form: the avx512 path runs the AVX2 one.
- DecodeModel.step (decode_step.cpp): the two above, and gelu_tanh one value at a time or gelu_tanh_avx2.
- argmax_rows (argmax.cpp): scan_portable, scan_avx2 (on parts of a row of 64 values or more).
- lm_head_ce (lm_head_ce.cpp): row_max, exp_sum, scale, round_to_bf16 and widen_bf16 as baseline, AVX2 and
  AVX-512 clones (the matmuls are ATen's, the same on every path).
- minhash_signatures (minhash.cpp): rows_scalar, rows_avx2 (4 lanes, the 64-bit product from 32-bit ones) and
  rows_avx512 (8 lanes; AVX512DQ too).
- adamw_step_, lamb_step_ and their multi-tensor forms, one set of range kernels (host_optim_kernels.h):
  Scalar, Avx2, Avx512.
The other ops (build_info, scaled_add_, blend_index, sample_index, dropout_mask, the fp modes) have one path.

The variable is read once per process, so each path runs in a child process (tests/ops/isa_path_outputs.py, which
also builds the inputs), which saves the ops' outputs on fixed inputs; the tests compare them. Inputs: odd sizes
whose tails no vector width divides, zeros, large magnitudes, NaN and inf where the op defines the result (gemv,
argmax; attention's unwritten slots hold NaN, which must never be read). Tolerances are error bounds of fp32 sums
taken in another order (U = 2^-24 per operation; a bound is derived beside each check), so a path must match the
exact (float64) reference within them, and any two paths within twice them. Exact results (argmax, NaN and inf
positions, a bf16 copy of the parameters) must be equal. A path this CPU cannot run is skipped, and the library
must refuse it. Speed is not tested here: a path that is slower on one class is the per-class benchmark's to catch.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import isa_path_outputs as cases
import pytest
import torch

from gpt2forge.ops import library as custom_ops
from gpt2forge.ops.library import ISA_ENV, ISA_PATHS

U = 2.0 ** -24  # fp32's unit roundoff
TINY = 2e-38  # exp_nonpositive's floor, exp(-87), and fp32's underflow: an absolute error of an exp below them
BF16_U = 2.0 ** -8  # bf16's
pytestmark = pytest.mark.slow  # a child process per path, each importing torch: half a minute on two cores


# ---------------------------------------------------------------------------------------------------------
# The exact results (float64) and the bounds the fp32 kernels must stay within


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    """|got - want| <= bound wherever want is finite; NaN and inf (with its sign) exactly where want has them."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at other positions"
    inf = want.isinf()
    same_inf = torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf])
    assert same_inf, f"{what}: inf elsewhere, or with another sign"
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(want)
    bad = want.isfinite() & ~((got - want).abs() <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {want.numel()} values beyond the bound, e.g. "
                           f"{got[bad][0].item()!r} for {want[bad][0].item()!r} (bound {bound[bad][0].item():.3g})")


def rounded_to_bf16(want: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The bound after the fp32 result is rounded once to bf16 (a relative BF16_U of the value)."""
    return bound + BF16_U * (want.abs() + bound)


@functools.cache
def gemv_references() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    refs = {}
    for name, (x, w, b) in cases.gemv_inputs().items():
        x64, w64, b64 = x.double(), w.double(), b.double()
        want = x64 @ w64.T + b64
        # K products and the bias summed in fp32 in any order, fused multiply-adds or not: Higham's gamma_(K+2)
        # (K + 2 roundings at most on any path of the sum) times the sum of the terms' magnitudes.
        bound = (x.shape[1] + 2) * U * (x64.abs() @ w64.abs().T + b64.abs())
        refs[name] = (want, rounded_to_bf16(want, bound) if x.dtype == torch.bfloat16 else bound)
    return refs


@functools.cache
def attention_references() -> list[tuple[torch.Tensor, torch.Tensor]]:
    refs = []
    for q, k, v, pad, slot, scale in cases.attention_inputs():
        B, H, S, D = k.shape
        want, bound = torch.empty(B, H, 1, D, dtype=torch.float64), torch.empty(B, H, 1, D, dtype=torch.float64)
        for b in range(B):
            lo = int(pad[b]) if pad[b] <= slot else slot  # a padding query attends to itself
            qb, kb, vb = q[b].double(), k[b, :, lo:slot + 1].double(), v[b, :, lo:slot + 1].double()
            n = slot + 1 - lo
            p = torch.softmax(qb @ kb.mT * scale, -1)  # (H, 1, n)
            want[b] = p @ vb
            # A score is off by delta <= (D + 2) U scale |q|.|k| (a D-term dot, then the scale); a weight
            # exp(s - max) / sum then by a factor within exp(+-2 delta) and exp_nonpositive's relative error
            # (< 2e-7) in its numerator and denominator; the n-term sums add (n + 2) U each, relative to
            # p @ |v|. Twice the first-order sum covers the higher-order terms; a weight below TINY is off by
            # TINY at most.
            delta = (D + 2) * U * scale * (qb.abs() @ kb.abs().mT).amax(-1, keepdim=True)
            bound[b] = 2 * (2 * delta + 4e-7 + (2 * n + 4) * U) * (p @ vb.abs()) + TINY * vb.abs().sum(-2, True)
        refs.append((want, rounded_to_bf16(want, bound) if q.dtype == torch.bfloat16 else bound))
    return refs


@functools.cache
def lm_head_references() -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    refs = []
    for h, w, labels, V, _, _, dtype in cases.lm_head_inputs():
        h64, W64 = h.double(), w[:V].double()
        logits = h64 @ W64.T  # (N, V)
        keep = labels != -100
        y = labels.clamp(min=0)
        lse = logits.logsumexp(1)
        loss = torch.where(keep, lse - logits.gather(1, y[:, None]).squeeze(1), 0.0)
        p = (logits - lse[:, None]).exp()
        d = (p - torch.nn.functional.one_hot(y, V)) * keep[:, None]
        gw = torch.zeros(w.shape, dtype=torch.float64)
        gw[:V] = d.T @ h64
        want = (torch.stack([loss.sum(), ((logits.argmax(1) == y) & keep).sum(), keep.sum()]), d @ W64, gw)
        # Each logit is a C-term fp32 dot, off by (C + 2) U |h|.|w|; in bf16 the inputs and the product are
        # rounded too (3 BF16_U |h|.|w|), and the softmax gradient and the weights rounded before the gradient
        # matmuls (round: 3 BF16_U relative). A row's lse and its probabilities then carry eps = 2 x the row's
        # largest logit error, + exp_nonpositive's 4e-7, + (V + 4) U for the sums; a loss, eps + rounding of
        # its own magnitude. The gradients sum p's error (and TINY) and (terms + 2) U of |d| over their products.
        magnitude = h64.abs() @ W64.abs().T
        low = dtype == torch.bfloat16
        logit_error = ((h.shape[1] + 2) * U + 3 * BF16_U * low) * magnitude.amax(1)
        eps = 2 * logit_error + 4e-7 + (V + 4) * U
        round_rel = 3 * BF16_U * low
        loss_bound = (eps + (V + 8) * U * (1 + lse.abs() + loss.abs())) * keep
        size = 2 * (eps[:, None] * p + TINY + ((V + 2) * U + round_rel) * d.abs())
        gh_bound = size @ W64.abs()
        gw_bound = torch.zeros(w.shape, dtype=torch.float64)
        gw_bound[:V] = (2 * (eps[:, None] * p + TINY + ((h.shape[0] + 2) * U + round_rel) * d.abs())).T @ h64.abs()
        stats_bound = torch.tensor([2 * loss_bound.sum() + h.shape[0] * U * loss.abs().sum(), 0.0, 0.0])
        refs.append((want, (stats_bound, gh_bound, gw_bound)))
    return refs


@functools.cache
def optim_references() -> dict[str, torch.Tensor]:
    from gpt2forge.train.optim import Lamb
    refs = {}
    for name, p0, grads in cases.optim_inputs():
        for kind, make in (("adamw", lambda ps: torch.optim.AdamW(ps, **cases.ADAMW)),
                           ("lamb", lambda ps: Lamb(ps, **cases.LAMB))):
            p = torch.nn.Parameter(p0.clone())
            opt = make([p])
            for g in grads:
                p.grad = g.float()  # bf16 and fp16 gradients widen exactly, as the op reads them
                opt.step()
            refs[f"{kind} {name}"] = p.detach()
    return refs


@functools.cache
def decode_references() -> dict[str, torch.Tensor]:
    refs = {}
    with torch.no_grad():
        for model in cases.decode_model():
            model = model.double()
            refs[f"decode {model.config.n_embd}"] = torch.stack([
                model.logits(model.transformer(cases.DECODE_IDS[:, :s + 1]))[:, -1, :model.config.vocab_size]
                for s in range(cases.DECODE_PROMPT, cases.DECODE_IDS.shape[1])])
    return refs


# ---------------------------------------------------------------------------------------------------------
# One child process per path

NEEDS = {"scalar": set(), "avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx2", "fma", "f16c", "avx512f"}}
"""The CPU features a path's kernels use (custom_ops/isa.cpp refuses a path whose features are missing)."""


def cpu_flags() -> set[str] | None:
    """The flags /proc/cpuinfo lists, None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def run_child(isa: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, ISA_ENV: isa, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, cases.__file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=custom_ops.REPO_ROOT)


@pytest.fixture(scope="module")
def path_outputs(tmp_path_factory: pytest.TempPathFactory):
    """path_outputs(isa): the outputs of `outputs()` on that path (the child runs once per path per module);
    skips, after checking the refusal, a path this CPU cannot run."""
    custom_ops.load_custom_ops.cache_clear()
    if not custom_ops.has_op("ops_isa"):
        pytest.skip("custom ops library not built or older than GPT2FORGE_OPS_ISA (run `make`)")
    done: dict[str, object] = {}
    folder = tmp_path_factory.mktemp("isa_paths")

    def get(isa: str) -> dict:
        if isa not in done:
            result = run_child(isa, folder / f"{isa}.pt")
            done[isa] = torch.load(folder / f"{isa}.pt") if result.returncode == 0 else result
        flags = cpu_flags()
        if isinstance(done[isa], subprocess.CompletedProcess):
            lines = done[isa].stderr.strip().splitlines() or [""]
            if flags is None or not NEEDS[isa] <= flags:
                assert lines[-1].startswith(f"ValueError: {ISA_ENV}={isa}: this CPU cannot run that path"), lines[-1]
                pytest.skip(f"this CPU cannot run the {isa} path: {lines[-1]}")
            pytest.fail(f"the {isa} path failed on a CPU that has its features: {done[isa].stderr[-3000:]}")
        assert flags is None or NEEDS[isa] <= flags, f"{isa} ran on a CPU without {NEEDS[isa] - flags}"
        return done[isa]

    return get


paths = pytest.mark.parametrize("isa", ISA_PATHS)


@paths
def test_the_forced_path_is_the_one_taken(path_outputs, isa: str):
    out = path_outputs(isa)
    assert out["isa"] == isa
    assert out["host_optim"] == {"scalar": "portable", "avx2": "avx2", "avx512": "avx512f"}[isa]
    assert out["lanes"] == ([8, 16] if isa == "avx512" else [8])  # 16 lanes are AVX-512's only


def test_a_value_that_is_not_a_path_is_refused_in_one_line(path_outputs):
    load = "from gpt2forge.ops.library import load_custom_ops; load_custom_ops()"
    result = subprocess.run([sys.executable, "-c", load], env={**os.environ, ISA_ENV: "avx-2"}, capture_output=True,
                            text=True, timeout=300, cwd=custom_ops.REPO_ROOT)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"ValueError: {ISA_ENV}=avx-2 is not a path of the custom ops: use scalar, avx2 or avx512")


@paths
def test_gemv_linear(path_outputs, isa: str):
    out, scalar = path_outputs(isa), path_outputs("scalar")
    for width in out["lanes"]:
        for name, (want, bound) in gemv_references().items():
            got = out[f"gemv {width} {name}"]
            assert_within(got, want, bound, f"{isa} gemv {width} lanes, {name}")
            assert_within(got, scalar[f"gemv 8 {name}"], 2 * bound, f"{isa} against scalar gemv, {name}")


@paths
def test_decode_attention(path_outputs, isa: str):
    out, scalar = path_outputs(isa), path_outputs("scalar")
    for i, (want, bound) in enumerate(attention_references()):
        assert_within(out[f"attention {i}"], want, bound, f"{isa} attention {cases.ATTENTION_CASES[i]}")
        assert_within(out[f"attention {i}"], scalar[f"attention {i}"], 2 * bound, f"{isa} against scalar, {i}")


@paths
def test_argmax_rows_is_torch_argmax(path_outputs, isa: str):
    out = path_outputs(isa)
    for V, x in cases.argmax_inputs().items():
        assert torch.equal(out[f"argmax {V}"], x.argmax(-1)), f"{isa} argmax, V={V}: {out[f'argmax {V}']}"


def minhash_reference(hashes: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each signature row from its definition, in Python integers: min over x of (a x + b) mod 2^64, top 32 bits
    (all-ones for a document without shingles), as int32 bits."""
    u = [v % 2**64 for v in hashes.tolist()]
    rows = [[(min(((p * x + q) % 2**64 for x in u[lo:hi]), default=2**64 - 1) >> 32) for p, q in
             zip((v % 2**64 for v in a.tolist()), (v % 2**64 for v in b.tolist()))]
            for lo, hi in zip(offsets.tolist(), offsets[1:].tolist())]
    return torch.tensor(rows, dtype=torch.int64).to(torch.int32)  # wraps to the uint32 bits


@paths
def test_minhash_signatures_are_their_definition(path_outputs, isa: str):
    out = path_outputs(isa)
    for perms in cases.MINHASH_PERMS:
        want = minhash_reference(*cases.minhash_inputs(perms))
        assert torch.equal(out[f"minhash {perms}"], want), f"{isa} minhash_signatures, {perms} rows"


@paths
def test_lm_head_ce(path_outputs, isa: str):
    out, scalar = path_outputs(isa), path_outputs("scalar")
    for i, (want, bounds) in enumerate(lm_head_references()):
        what = f"{isa} lm_head_ce {cases.LM_HEAD_CASES[i]}"
        got = out[f"lm_head {i}"]
        exact = [2] if cases.LM_HEAD_CASES[i][6] == torch.bfloat16 else [1, 2]  # bf16 logits may move an argmax
        assert_within(got[0][[0]], want[0][[0]], bounds[0][[0]], what + " loss")
        assert torch.equal(got[0][exact].double(), want[0][exact].double()), what + " counts"
        assert torch.equal(got[0][1:], scalar[f"lm_head {i}"][0][1:]), what + " counts against scalar"
        for j, part in ((1, "grad hidden"), (2, "grad weight")):
            assert_within(got[j], want[j], bounds[j], f"{what} {part}")
            assert_within(got[j], scalar[f"lm_head {i}"][j], 2 * bounds[j], f"{what} {part} against scalar")


@paths
def test_host_optimizer_steps(path_outputs, isa: str):
    # The op repeats torch's AdamW operation by operation and Lamb's formulas; a multiply-add fused on one
    # path and not on another, and torch's own order, leave a few fp32 ulps per step: after 10 steps
    # tests/ops/test_host_optim.py's tolerances (AdamW rtol 1e-6, atol 1e-7; LAMB's norms summed in another
    # order: rtol 1e-5, atol 1e-6) hold against torch and, doubled, between paths.
    out, scalar = path_outputs(isa), path_outputs("scalar")
    for key, want in optim_references().items():
        rtol, atol = (1e-6, 1e-7) if key.startswith("adamw") else (1e-5, 1e-6)
        got = out[key][0] if key.startswith("adamw") else out[key]
        assert_within(got, want, atol + rtol * want.abs(), f"{isa} {key}")
        theirs = scalar[key][0] if key.startswith("adamw") else scalar[key]
        assert_within(got, theirs, 2 * (atol + rtol * want.abs()), f"{isa} {key} against scalar")
        if key.startswith("adamw") and out[key][1] is not None:  # the device copy: the new parameter, rounded
            assert torch.equal(out[key][1], got.to(out[key][1].dtype)), f"{isa} {key} device copy"


@paths
def test_fused_decode_step(path_outputs, isa: str):
    # Two layers of matmuls, attention, LayerNorm and gelu in fp32 against the float64 model (no bound of one op
    # carries through a whole step): the logits, 5 to 12 at most, agree to about 1.4e-6 of their largest on
    # every path; 2e-5 of it leaves a margin of ten, and a wrong kernel moves them by far more.
    out, scalar = path_outputs(isa), path_outputs("scalar")
    for key, want in decode_references().items():
        bound = 2e-5 * want.abs().amax()
        assert_within(out[key], want, bound, f"{isa} {key}")
        assert_within(out[key], scalar[key], 2 * bound, f"{isa} {key} against scalar")
