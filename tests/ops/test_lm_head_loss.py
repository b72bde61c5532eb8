"""The fused chunked LM head + loss (C++ op and its PyTorch reference) against the plain
full-logits cross-entropy, activation checkpointing, optimizer offload, and training with them."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

import gpt2forge.ops.lm_head_loss as lhl
from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops import library as custom_ops
from gpt2forge.ops.lm_head_loss import LossChunking, fused_lm_head_loss, lm_head_ce_reference
from gpt2forge.parallel.optimizer_state import named_state
from gpt2forge.train.memory_features import apply_activation_checkpointing, checkpointed_layers, lm_loss_chunking
from gpt2forge.train.optim import build_lr_schedule, build_optimizer

HAVE_KERNEL = custom_ops.load_custom_ops() and hasattr(torch.ops.gpt2forge, "lm_head_ce")
IMPLS = ["kernel", "reference"] if HAVE_KERNEL else ["reference"]
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(lhl, "_use_kernel", lambda hidden: False)
    return request.param


def problem(N=37, C=16, V=67, V_pad=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g)
    W = torch.randn(V_pad, C, generator=g) * 0.5
    W[V:] = 0.0  # the padding rows, as the model initialises them
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = IGNORE_INDEX
    return h, W, y, V


def plain(h, W, y, V, dtype):
    """The oracle: full logits in `dtype` (as autocast computes them), fp32 cross-entropy."""
    h = h.detach().requires_grad_()
    W = W.detach().requires_grad_()
    logits = (h.to(dtype) @ W[:V].to(dtype).T).float()
    loss = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    keep = y != IGNORE_INDEX
    correct = ((logits.argmax(1) == y) & keep).sum()
    return loss.detach(), correct, keep.sum(), h.grad, W.grad


@pytest.mark.parametrize("chunking", [LossChunking(), LossChunking(8, 1), LossChunking(5, 3), LossChunking(37, 4),
                                      LossChunking(1, 67), LossChunking(64, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_accuracy_and_both_gradients_match_plain(impl, chunking, dtype):
    h, W, y, V = problem()
    W[:V, 0] += 3.0 * h[:, 0].mean()  # some rows predicted right, so accuracy is not trivially 0
    ref_loss, ref_correct, ref_tokens, ref_gh, ref_gw = plain(h, W, y, V, dtype)
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss, correct, tokens = fused_lm_head_loss(hh, WW, y, V, IGNORE_INDEX, chunking)
    (loss * 0.5).backward()  # the incoming gradient scales both results
    tol = TOL[dtype]
    torch.testing.assert_close(loss, ref_loss, **tol)
    if dtype == torch.float32:  # in bf16 near-ties may flip the argmax
        assert int(correct) == int(ref_correct)
    assert int(tokens) == int(ref_tokens) == int((y != IGNORE_INDEX).sum())
    torch.testing.assert_close(hh.grad, 0.5 * ref_gh, **tol)
    torch.testing.assert_close(WW.grad, 0.5 * ref_gw, **tol)
    assert WW.grad.dtype == torch.float32 and hh.grad.dtype == torch.float32
    assert WW.grad[V:].abs().max() == 0  # padded rows get no gradient


@pytest.mark.parametrize("rows, chunks", [(16, 1), (16, 3), (37, 9)])
def test_reference_masks_the_padding_columns_it_computes_for_alignment(rows, chunks):
    """The reference computes its logits over V rounded up to 8 columns (cuBLAS's fast kernels need
    16-byte aligned rows), through the weight's padding rows: large values there change nothing, and
    those rows get no gradient."""
    h, W, y, V = problem(V=67, V_pad=80)
    W[V:] = 50.0  # padding rows that would dominate any softmax they entered
    ref_loss, ref_correct, _, ref_gh, ref_gw = plain(h, W, y, V, torch.float32)
    stats, gh, gw = lm_head_ce_reference(h, W, y, V, IGNORE_INDEX, rows, chunks, torch.float32, True)
    torch.testing.assert_close(stats[0], ref_loss, rtol=1e-5, atol=1e-5)
    assert int(stats[1]) == int(ref_correct)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw[:V], ref_gw[:V], rtol=1e-5, atol=1e-5)
    assert gw[V:].abs().max() == 0


def test_kernel_equals_reference_on_odd_sizes():
    if not HAVE_KERNEL:
        pytest.skip("custom ops library not built")
    h, W, y, V = problem(N=53, C=24, V=101, V_pad=128, seed=3)
    for rows, chunks in [(7, 1), (13, 5), (53, 101)]:
        a = torch.ops.gpt2forge.lm_head_ce(h, W, y, V, IGNORE_INDEX, rows, chunks, torch.float32, True)
        b = lm_head_ce_reference(h, W, y, V, IGNORE_INDEX, rows, chunks, torch.float32, True)
        for x, z in zip(a, b):
            torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-5)


def test_kernel_takes_inputs_that_require_grad_on_several_threads():
    # The logits tiles run on the intra-op threads, whose grad mode is on whatever the caller's is,
    # and in fp32 they are written in place with mm's out= form, which refuses inputs that require
    # grad under grad mode: the op detaches its inputs. V = 1100: five tiles of columns on two threads.
    if not HAVE_KERNEL:
        pytest.skip("custom ops library not built")
    h, W, y, V = problem(N=40, C=24, V=1100, V_pad=1152, seed=4)
    want = lm_head_ce_reference(h, W, y, V, IGNORE_INDEX, 16, 1, torch.float32, True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = torch.ops.gpt2forge.lm_head_ce(h.requires_grad_(), W.requires_grad_(), y, V, IGNORE_INDEX, 16, 1,
                                             torch.float32, True)
    finally:
        torch.set_num_threads(threads)
    for x, z in zip(got, want):
        torch.testing.assert_close(x.detach(), z, rtol=1e-5, atol=1e-5)


def test_all_ignored_and_no_grad(impl):
    h, W, y, V = problem(N=6)
    y[:] = IGNORE_INDEX
    loss, correct, tokens = fused_lm_head_loss(h.requires_grad_(), W, y, V)
    assert float(loss.detach()) == 0.0 and int(tokens) == 0 and int(correct) == 0
    loss.backward()
    assert h.grad.abs().max() == 0
    h2, W2, y2, V2 = problem()
    expected = plain(h2, W2, y2, V2, torch.float32)[0]
    with torch.no_grad():  # evaluation: no gradient buffers are made
        loss2 = fused_lm_head_loss(h2.requires_grad_(), W2, y2, V2)[0]
    assert not loss2.requires_grad and torch.isclose(loss2, expected)


def test_out_of_range_label_is_refused(impl):
    h, W, y, V = problem()
    y[3] = V  # a padded id: never a valid target
    with pytest.raises((ValueError, RuntimeError), match="outside"):
        fused_lm_head_loss(h, W, y, V)


def tiny_model(**kw) -> GPT2LMHeadModel:
    cfg = ModelConfig(vocab_size=67, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    model = GPT2LMHeadModel(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def test_model_fused_loss_equals_plain_for_batches_with_sequence_serialization(impl):
    model = tiny_model()
    ids = torch.randint(0, 67, (3, 20), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[1, 5:] = IGNORE_INDEX
    plain_out = model(ids, labels)
    plain_out.loss_sum.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # --enable-sequence-serialized --serialized-seq-len 7 --embedding-serialization-factor 3, batch 3:
    # the reference's chunked loss only covered the first sequence; every row counts here.
    model.fused_loss = lm_loss_chunking("fused", False, True, 7, 3)
    out = model(ids, labels)
    out.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum, plain_out.loss_sum)
    assert int(out.tokens) == int(plain_out.tokens) and int(out.correct) == int(plain_out.correct)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
def test_fused_loss_compiles():
    model = tiny_model()
    model.fused_loss = LossChunking(16, 2)
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(2))
    eager = model(ids, ids)
    eager.loss_sum.backward()
    eager_grad = model.transformer.wte.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(ids, ids)
    out.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum, eager.loss_sum)
    torch.testing.assert_close(model.transformer.wte.weight.grad, eager_grad)


def test_flag_contradictions_and_layer_selection():
    with pytest.raises(UsageError, match="--lm-loss plain contradicts --remap-logit"):
        lm_loss_chunking("plain", True, False, 128, 1)
    assert lm_loss_chunking("plain", False, False, 128, 1) is None
    assert lm_loss_chunking("fused", False, False, 128, 4) == LossChunking(None, 4)
    assert checkpointed_layers(4, True, None) == [0, 1, 2, 3]
    assert checkpointed_layers(4, False, [2, 0, 2]) == [0, 2]
    assert checkpointed_layers(4, False, None) == []
    with pytest.raises(UsageError, match="--recompute-checkpoint-layers 7"):
        checkpointed_layers(4, False, [7])


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_activation_checkpointing_gives_same_gradients_with_dropout(compiled):
    if compiled:  # earlier tests' graphs of GPT2LMHeadModel.forward count against dynamo's recompile limit (8);
        torch.compiler.reset()  # past it torch 2.11 runs the forward eagerly, whose dropout masks are not inductor's
    grads = []
    for layers in ([], [0, 1]):
        model = tiny_model()
        for m in model.modules():  # dropout on: the recomputation must replay the same masks
            if hasattr(m, "p"):
                m.p = 0.2
        apply_activation_checkpointing(model, layers)
        fwd = torch.compile(model) if compiled else model
        ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(4))
        torch.manual_seed(5)
        fwd(ids, ids).loss_sum.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert list(model.state_dict()) == list(tiny_model().state_dict())  # names unchanged
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("name", ["AdamW", "LAMB"])
def test_offloaded_optimizer_matches_plain_and_round_trips_state(name):
    torch.manual_seed(0)
    models = [tiny_model(), tiny_model()]
    opts = [build_optimizer(models[0], name, 1e-2, 0.1), build_optimizer(models[1], name, 1e-2, 0.1, offload=True)]
    scheds = [build_lr_schedule(o, "cosine", 6, 2) for o in opts]
    ids = torch.randint(0, 67, (2, 12))
    for _ in range(4):
        for m, o, s in zip(models, opts, scheds):
            m(ids, ids).loss_sum.backward()
            o.step()
            o.zero_grad()
            s.step()
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        if name == "LAMB" and n.endswith("attn.c_attn.bias"):
            # The key bias's true gradient is 0 (softmax ignores a per-query constant): what it gets
            # is rounding noise, which LAMB's g / (|g| + eps) turns into +-lr steps, so the host op's
            # other summation order moves it differently. Query and value biases are compared.
            C = p.shape[0] // 3
            p, q = torch.cat((p[:C], p[2 * C:])), torch.cat((q[:C], q[2 * C:]))
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=n)
    assert opts[1].param_groups[0]["lr"] == opts[0].param_groups[0]["lr"]
    # Outside, it is an optimizer of the model's parameters: state keyed by them, the same checkpoint form.
    assert set(opts[1].state) == set(models[1].parameters())
    named = [named_state(o, m) for o, m in zip(opts, models)]
    assert named[1]["param_groups"] == named[0]["param_groups"] and named[1]["state"].keys() == named[0]["state"].keys()
    opts[1].load_state_dict(opts[0].state_dict())
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(opts[1].state[q]["exp_avg"], opts[0].state[p]["exp_avg"], rtol=0, atol=0)


STEP = re.compile(r"^step \d+ of epoch \d+, loss: (\S+), .*, peak memory: (\S+) GiB")


def test_training_with_fused_loss_follows_the_plain_loss_curve(tmp_path, capsys):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_positions": 32, "n_embd": 32,
                               "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                               "attn_pdrop": 0.0}))
    curves = {}
    for name, extra in [("plain", ["--lm-loss", "plain"]),
                        ("fused", ["--enable-sequence-serialized", "true", "--serialized-seq-len", "8",
                                   "--embedding-serialization-factor", "2", "--recompute-checkpoint-every-layer",
                                   "true"])]:
        argv = ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
                "--device-iterations", "1", "--training-steps", "50", "--epochs", "13", "--num-workers", "0",
                "--learning-rate", "3e-3", "--optimizer", "AdamW", *extra]
        assert train_main(argv) == 0
        lines = [m for line in capsys.readouterr().out.splitlines() if (m := STEP.match(line))]
        assert len(lines) == 50 and all(float(m.group(2)) > 0 for m in lines)
        curves[name] = [float(m.group(1)) for m in lines]
    assert curves["fused"][-1] < curves["fused"][0] - 0.5  # it learns
    for a, b in zip(curves["plain"], curves["fused"]):
        assert abs(a - b) < 2e-3 * max(1.0, abs(a))


@pytest.mark.slow
def test_compiled_row_pass_equals_eager():
    # On CUDA the one-vocabulary-chunk pass runs torch.compile'd (Triton); inductor compiles the
    # same function for the CPU here, so its semantics are checked without a GPU: both row counts
    # go through one dynamic-shape graph, ignored rows included, bf16 logits with fp32 math.
    from gpt2forge.ops.lm_head_loss import _compiled_xent_rows, xent_rows
    g = torch.Generator().manual_seed(0)
    for n, dtype in ((7, torch.float32), (13, torch.float32), (9, torch.bfloat16)):
        logits = (torch.randn(n, 101, generator=g) * 3).to(dtype)
        labels = torch.randint(0, 101, (n,), generator=g)
        labels[::3] = IGNORE_INDEX
        want = xent_rows(logits, labels, IGNORE_INDEX, True)
        got = _compiled_xent_rows()(logits, labels, IGNORE_INDEX, True)
        assert got[3].dtype == dtype
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_a_gpu_chunk_is_larger_and_tile_aligned():
    from gpt2forge.ops.lm_head_loss import GPU_ROW_MULTIPLE, LOGITS_CHUNK_ELEMENTS

    cpu, gpu = LossChunking().rows(50257), LossChunking().rows(50257, "cuda")
    assert cpu == LOGITS_CHUNK_ELEMENTS // 50257 == 667  # the CPU kernel's measured chunk, unchanged
    assert gpu % GPU_ROW_MULTIPLE == 0 and gpu >= cpu  # 1,280: 13 chunks for 16 x 1,024 tokens
    assert LossChunking(vocab_chunks=4).rows(50257, "cuda") % GPU_ROW_MULTIPLE == 0
    assert LossChunking(token_chunk=100).rows(50257, "cuda") == 100  # --serialized-seq-len is taken as given
    assert LossChunking().rows(10**9, "cuda") == GPU_ROW_MULTIPLE  # never below one aligned tile


def test_auto_lm_loss_is_fused_on_the_cpu_and_plain_on_a_gpu_unless_chunks_are_asked_for():
    from gpt2forge.parallel.memory_plan import MemoryArgs, resolved_lm_loss

    assert resolved_lm_loss(MemoryArgs(), "cpu") == "fused"
    assert resolved_lm_loss(MemoryArgs(), "cuda") == "plain"
    for asked in (dict(remap_logit=True), dict(enable_sequence_serialized=True),
                  dict(embedding_serialization_factor=2)):
        assert resolved_lm_loss(MemoryArgs(**asked), "cuda") == "fused", asked
    assert resolved_lm_loss(MemoryArgs(lm_loss="fused"), "cuda") == "fused"
    assert resolved_lm_loss(MemoryArgs(lm_loss="plain"), "cpu") == "plain"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradients_add_into_fp32_as_their_widened_products(dtype):
    """The bf16/fp16 products are added to the fp32 gradients without an fp32 copy of them: exactly
    the sums that widening each product first gives."""
    gen = torch.Generator().manual_seed(0)
    d, h, w = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((5, 40), (5, 8), (40, 8)))
    gh, gw = torch.randn(5, 8, generator=gen), torch.randn(40, 8, generator=gen)
    want_h, want_w = gh + (d @ w).float(), gw + (d.T @ h).float()
    lhl._add_grads(d, h, w, gh, gw)
    assert torch.equal(gh, want_h) and torch.equal(gw, want_w)
