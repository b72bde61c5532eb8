"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss): the ids and
masks equal Megatron-Core's, a packed sample equals its documents run one by one through
transformers, every attention path agrees, and the trainer runs with the flags (recomputation,
torch.compile, the pipeline)."""

import ast
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_model import ours  # non-trivial biases and LayerNorms

from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model import dropout as dropout_module
from gpt2forge.model.checkpoint import from_hf_state_dict, to_hf_state_dict
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.documents import (
    DocumentArgs,
    dense_document_mask,
    document_layout,
    document_starts,
    eod_masked_labels,
)
from gpt2forge.model.dropout import causal_attention_dropout
from gpt2forge.model.gpt2 import GPT2LMHeadModel

EOD = 7


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=2, vocab_pad_multiple=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=EOD)
    base.update(kw)
    return ModelConfig(**base)


def packed_text(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A packed row of documents of `lengths` tokens (each but the last ending with EOD) and the documents."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, n in enumerate(lengths):
        body = torch.randint(EOD + 1, 101, (n - 1,), generator=g)
        last = torch.tensor([EOD]) if i < len(lengths) - 1 else torch.randint(EOD + 1, 101, (1,), generator=g)
        docs.append(torch.cat([body, last]))
    return torch.cat(docs), docs


def megatron_masks_function():
    """Megatron-Core's `_get_ltor_masks_and_position_ids`, taken from its gpt_dataset.py (megatron.core's
    __init__ needs triton and more, which this one function does not)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core==0.19.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "datasets" / "gpt_dataset.py"
    if not path.is_file():
        pytest.skip(f"{path} not found in this megatron-core")
    tree = ast.parse(path.read_text())
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef)
                 and n.name == "_get_ltor_masks_and_position_ids"), None)
    if node is None:
        pytest.skip(f"{path} has no _get_ltor_masks_and_position_ids")
    namespace = {"torch": torch}
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["_get_ltor_masks_and_position_ids"]


@pytest.mark.parametrize("lengths", [[5, 9, 1, 1, 8], [24], [1, 23], [23, 1], [3, 3, 3, 3, 3, 3, 3, 3]])
def test_ids_and_masks_equal_megatron_core(lengths):
    megatron = megatron_masks_function()
    text, _ = packed_text(lengths)
    text = torch.cat([torch.tensor([EOD]), text])  # an EOD first too: an empty-looking first document
    tokens, labels = text[:-1], text[1:]  # as Megatron-Core's GPTDataset.__getitem__
    attention, loss_mask, positions = megatron(tokens.clone(), EOD, True, True, True, True)
    layout = document_layout(tokens[None], EOD, True, True, always=True)
    assert torch.equal(layout.position_ids[0], positions)
    allowed = dense_document_mask(layout.document_ids)[0]  # (1, T, T)
    assert torch.equal(allowed, ~attention)  # Megatron: True = masked out
    masked = eod_masked_labels(tokens[None], labels[None], EOD)[0]
    assert torch.equal(masked != IGNORE_INDEX, loss_mask.bool())
    starts = document_starts(layout.document_ids)[0]
    assert torch.equal(starts, torch.arange(len(tokens)) - positions)


def test_rows_of_one_document_need_no_ids_and_flags_off_need_none():
    text, _ = packed_text([16, 9])
    one = text[None, :16].clone()
    one[0, -1] = EOD  # an EOD as the last input token starts nothing inside the row
    assert document_layout(one, EOD, True, True) == (None, None)
    assert document_layout(text[None], EOD, False, False) == (None, None)
    assert document_layout(text[None], EOD, True, True).document_ids is not None
    pos_only = document_layout(text[None], EOD, True, False)
    assert pos_only.document_ids is None and int(pos_only.position_ids[0, 16]) == 0


def hf_twin(model: GPT2LMHeadModel) -> transformers.GPT2LMHeadModel:
    hf_cfg = transformers.GPT2Config(**model.config.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    hf.tie_weights()
    return hf


def assert_same_gradients(model: GPT2LMHeadModel, hf: transformers.GPT2LMHeadModel) -> None:
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    want = from_hf_state_dict(hf_grads, model.config)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_packed_sample_equals_its_documents_one_by_one_in_transformers(eod_mask_loss):
    model = ours(tiny())
    hf = hf_twin(model)
    rows = [packed_text([6, 11, 2, 14], seed=1), packed_text([20, 13], seed=2)]  # 33 tokens each
    text = torch.stack([t for t, _ in rows])
    x, y = text[:, :-1], text[:, 1:]
    if eod_mask_loss:
        y = eod_masked_labels(x, y, EOD)
    layout = document_layout(x, EOD, True, True)
    out = model(x, y, *layout)

    want_loss = 0.0
    for row, (_, docs) in enumerate(rows):
        t0 = 0
        for i, doc in enumerate(docs):
            n = len(doc) if i < len(docs) - 1 else len(doc) - 1  # the last document's final token is a label only
            logits = hf(doc[None, :n]).logits[0]  # the document alone, positions 0..n-1
            if eod_mask_loss:  # the EOD's prediction (the next document's first token) is not scored
                loss = hf(doc[None], labels=doc[None]).loss * (len(doc) - 1)
            else:
                loss = torch.nn.functional.cross_entropy(logits, y[row, t0:t0 + n], reduction="sum")
            want_loss = want_loss + loss
            with torch.no_grad():
                got = model.logits(model.transformer(x[row:row + 1], layout.position_ids[row:row + 1],
                                                     document_ids=layout.document_ids[row:row + 1]))
                torch.testing.assert_close(got[0, t0:t0 + n, :101], logits, rtol=1e-4, atol=1e-4)
            t0 += n
    scored = int((y != IGNORE_INDEX).sum())
    assert int(out.tokens) == scored == 2 * 32 - (4 if eod_mask_loss else 0)  # 4 EOD inputs
    torch.testing.assert_close(out.loss_sum, want_loss, rtol=1e-5, atol=1e-4)
    out.loss_sum.backward()
    want_loss.backward()
    assert_same_gradients(model, hf)


def test_without_ids_the_model_is_unchanged_and_with_them_documents_do_not_mix():
    model = ours(tiny())
    text = torch.stack([packed_text([9, 24], seed=3)[0], packed_text([33], seed=4)[0]])
    x, y = text[:, :-1], text[:, 1:]
    with torch.no_grad():
        plain = model(x, y)
        again = model(x, y, None, None)
        assert torch.equal(plain.loss_sum, again.loss_sum)
        layout = document_layout(x, EOD, True, True)
        packed = model(x, y, *layout)
        assert not torch.allclose(plain.loss_sum, packed.loss_sum)
        # The second document's hidden states do not depend on the first document's tokens.
        other = x.clone()
        other[0, :8] = (other[0, :8] + 1 - EOD) % 90 + EOD + 1
        h1 = model.transformer(x, layout.position_ids, document_ids=layout.document_ids)
        h2 = model.transformer(other, layout.position_ids, document_ids=layout.document_ids)
        torch.testing.assert_close(h1[0, 9:], h2[0, 9:])
        assert not torch.allclose(h1[0, :9], h2[0, :9])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_cpu_path_skips_keys_and_equals_sdpa_with_the_dense_mask(monkeypatch, dtype, tol):
    """The dropout path's chunks (16 rows here) with documents, at a dropout that keeps everything
    (p rounds to 0): equal to SDPA under the dense block-causal mask, values and gradients, and
    chunks whose rows all start late skip the keys before them."""
    monkeypatch.setattr(dropout_module, "ATTENTION_CHUNK_ELEMENTS", 16 * 2 * 3 * 64)
    widths = []
    scores = dropout_module._scores
    monkeypatch.setattr(dropout_module, "_scores", lambda q, k, t0, t1, *a: widths.append((t1 - a[1], a[2] is not None))
                        or scores(q, k, t0, t1, *a))
    B, H, T, hd = 2, 3, 64, 8
    doc_ids = torch.stack([torch.arange(T) // 20, torch.arange(T) // 40])  # documents of 20 and 40 tokens
    q, k, v = (torch.randn(B, H, T, hd).to(dtype).requires_grad_() for _ in range(3))
    out = causal_attention_dropout(q, k, v, 1e-6, 0.3, doc_ids, document_starts(doc_ids))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=dense_document_mask(doc_ids),
                                                           scale=0.3)
    want = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    for a, b in zip((out, *got), (ref, *want)):
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol)
    # Chunk 48..63: both rows' documents start at or after 40, so 40 keys of 64 are skipped; chunk
    # 0..15 lies in the first document of both rows: causal alone, no document mask.
    assert widths[:4] == [(16, False), (32, True), (48, True), (64 - 40, True)]


def test_dropout_training_forward_keeps_documents_apart():
    """In training with attention dropout (the chunked CPU path), a document's outputs do not depend
    on the document before it (the same dropout draws on both runs)."""
    model = ours(tiny(attn_pdrop=0.2)).train()
    text = packed_text([12, 21], seed=5)[0][None]
    x = text[:, :-1]
    layout = document_layout(x, EOD, True, True)
    other = x.clone()
    other[0, :5] = (other[0, :5] + 3 - EOD) % 90 + EOD + 1
    outs = []
    for ids in (x, other):
        torch.manual_seed(0)
        outs.append(model.transformer(ids, layout.position_ids, document_ids=layout.document_ids))
    torch.testing.assert_close(outs[0][0, 12:], outs[1][0, 12:])


@pytest.mark.slow
def test_compiled_training_forward_and_backward_equal_eager_with_documents():
    """torch.compile around the model in training with attention dropout (the chunked CPU path,
    traced without key skipping): the loss and gradients of eager, from the same dropout draws."""
    model = ours(tiny(attn_pdrop=0.1)).train()
    text = torch.stack([packed_text([9, 24], seed=3)[0], packed_text([4, 4, 25], seed=4)[0]])
    x, y = text[:, :-1], text[:, 1:]
    layout = document_layout(x, EOD, True, True)
    results = []
    for forward in (model, torch.compile(model)):
        model.zero_grad()
        torch.manual_seed(0)
        out = forward(x, y, *layout)
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager, eager_grads), (fast, fast_grads) = results
    torch.testing.assert_close(fast, eager, rtol=1e-4, atol=1e-4)
    for a, b in zip(fast_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_evaluation_scores_with_the_training_masks():
    """step.evaluate builds its batches as train_step does: with the flags, the loss of the packed
    batch under document masks, positions and EOD-masked labels."""
    from types import SimpleNamespace

    from gpt2forge.parallel.strategy import ParallelRequest, build_strategy
    from gpt2forge.train.step import evaluate

    model = ours(tiny())
    rows = [packed_text(lengths, seed=i)[0] for i, lengths in enumerate([[6, 11, 2, 14], [20, 13], [33], [1, 32]])]
    strategy = build_strategy(model, ParallelRequest(torch.device("cpu"), batch_size=2))

    def evaluated(on: bool) -> float:
        flags = DocumentArgs(eod_mask_loss=on, reset_position_ids=on, reset_attention_mask=on)
        run = SimpleNamespace(strategy=strategy, device=torch.device("cpu"), precision="fp32",
                              eod=EOD if on else None, cfg=SimpleNamespace(documents=flags))
        return evaluate(run, rows)[0]

    text = torch.stack(rows)
    x, y = text[:, :-1], text[:, 1:]
    with torch.no_grad():
        packed = model(x, eod_masked_labels(x, y, EOD), *document_layout(x, EOD, True, True))
        plain = model(x, y)
    assert evaluated(True) == pytest.approx(float(packed.loss_sum / packed.tokens), rel=1e-5)
    assert evaluated(False) == pytest.approx(float(plain.loss_sum / plain.tokens), rel=1e-5)
    assert abs(evaluated(True) - evaluated(False)) > 1e-4  # the masks change the loss


# -- the trainer -------------------------------------------------------------------------------------------

STEP_LINE = re.compile(r"^step (\d+) of epoch \d+, loss: (\S+),", re.M)


def write_packed_corpus(prefix: Path, vocab: int, eod: int, docs: int = 120, seed: int = 0) -> None:
    from gpt2forge.data.indexed import IndexedWriter

    rng = np.random.default_rng(seed)
    with IndexedWriter(prefix, np.uint16) as w:
        for _ in range(docs):
            n = int(rng.integers(2, 14))
            w.add_document(np.append(rng.integers(eod + 1, vocab, n), eod))


def trainer_args(tmp_path: Path, make_tiny_config, *extra: str) -> list[str]:
    cfg = make_tiny_config(n_positions=32, eos_token_id=3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.1)
    prefix = tmp_path / "corpus_text_document"
    if not prefix.with_suffix(".idx").exists():
        write_packed_corpus(prefix, 96, 3)
    return ["--model-config", str(cfg), "--dataset", "mmap", "--input-files", str(prefix), "--split", "90,10,0",
            "--max-len", "32", "--batch-size", "2", "--gradient-accumulation", "2", "--training-steps", "3",
            "--num-workers", "0", "--learning-rate", "3e-3", "--eval-every-steps", "3",
            "--checkpoint-output-dir", str(tmp_path / "out"), *extra]


DOC_FLAGS = ("--reset-position-ids", "true", "--reset-attention-mask", "true", "--eod-mask-loss", "true")


@pytest.mark.slow
def test_trainer_runs_with_the_flags_and_recomputation(make_tiny_config, tmp_path, capsys):
    from gpt2forge.cli import train_main

    assert train_main(trainer_args(tmp_path, make_tiny_config)) == 0
    plain = STEP_LINE.findall(capsys.readouterr().out)
    assert train_main(trainer_args(tmp_path, make_tiny_config, *DOC_FLAGS)) == 0
    text = capsys.readouterr().out
    packed = STEP_LINE.findall(text)
    assert len(packed) == len(plain) == 3 and packed != plain and "validation after step 3" in text
    assert train_main(trainer_args(tmp_path, make_tiny_config, *DOC_FLAGS,
                                   "--recompute-checkpoint-every-layer", "true")) == 0
    assert STEP_LINE.findall(capsys.readouterr().out) == packed  # recomputation replays the same dropout


def test_a_tokenizer_without_an_end_of_document_token_is_refused(make_tiny_config, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    from gpt2forge.cli import train_main

    folder = tmp_path / "tok"
    folder.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    argv = trainer_args(tmp_path, make_tiny_config, *DOC_FLAGS, "--tokenizer-name-or-path", str(folder))
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no end-of-document token" in err[0]


@pytest.mark.slow
def test_pipelined_run_with_the_flags_equals_one_process(make_tiny_config, tmp_path):
    """Two pipeline stages (a process each, the ids passed to every stage's forward) train and
    validate exactly as one process with the flags."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    argv = trainer_args(tmp_path, make_tiny_config, *DOC_FLAGS, "--layers-per-ipu", "1", "1", "--ipus-per-replica",
                        "2")
    argv[argv.index("--model-config") + 1] = str(make_tiny_config(n_positions=32, eos_token_id=3, resid_pdrop=0.0,
                                                                  embd_pdrop=0.0, attn_pdrop=0.0))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    lines = []
    for launcher in ([], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]):
        proc = subprocess.run([sys.executable, *launcher, str(root / "train_gpt2.py"), *argv], cwd=root, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines.append([line.split(", throughput")[0] for line in proc.stdout.splitlines()
                      if line.startswith(("step ", "validation after"))])
    assert sum(line.startswith("step ") for line in lines[0]) == 3 and lines[1] == lines[0]


@pytest.mark.slow
def test_flex_block_mask_path_equals_the_dense_mask():
    """The CUDA path's FlexAttention block mask (forward only here: FlexAttention has no CPU
    backward) gives SDPA's dense-mask attention."""
    from gpt2forge.model.documents import flex_attention, flex_available, flex_block_mask

    if not flex_available():
        pytest.skip("this PyTorch has no FlexAttention")
    B, H, T, hd = 2, 2, 256, 16
    doc_ids = torch.stack([torch.arange(T) // 50, torch.arange(T) // 200])
    q, k, v = (torch.randn(B, H, T, hd) for _ in range(3))
    got = flex_attention(q, k, v, flex_block_mask(doc_ids), 0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(doc_ids),
                                                            scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _host_gpu_env() -> dict[str, str] | None:
    """The environment of a child process that sees the host's GPUs (conftest hides them), or None."""
    import os

    from conftest import HOST_CUDA_VISIBLE_DEVICES

    if not Path("/dev/nvidiactl").exists():
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE")}
    if HOST_CUDA_VISIBLE_DEVICES is not None:
        env["CUDA_VISIBLE_DEVICES"] = HOST_CUDA_VISIBLE_DEVICES
    return env


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_flex_path_equals_the_cpu_dense_path():
    """On CUDA (FlexAttention block mask without dropout, eager and compiled; SDPA with the dense mask
    with dropout) the loss and gradients of a packed batch equal the CPU's."""
    import subprocess
    import sys
    import textwrap

    env = _host_gpu_env()
    if env is None:
        pytest.skip("no CUDA GPU")
    code = textwrap.dedent("""
        import torch
        from gpt2forge.model.config import ModelConfig
        from gpt2forge.model.documents import document_layout
        from gpt2forge.model.gpt2 import GPT2LMHeadModel
        if not torch.cuda.is_available():
            print("SKIP"); raise SystemExit(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        cfg = ModelConfig(vocab_size=101, n_positions=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=7)
        torch.manual_seed(0)
        cpu = GPT2LMHeadModel(cfg)
        text = torch.randint(8, 101, (2, 257))
        text[0, [30, 100, 101, 200]] = 7
        text[1, [128]] = 7
        x, y = text[:, :-1], text[:, 1:]
        layout = document_layout(x, 7, True, True)
        def run(model, device, compiled=False):
            model.zero_grad()
            forward = torch.compile(model) if compiled else model
            out = forward(x.to(device), y.to(device), *(t.to(device) for t in layout))
            out.loss_sum.backward()
            return out.loss_sum.item(), [p.grad.cpu() for p in model.parameters()]
        want, want_grads = run(cpu, "cpu")
        gpu = GPT2LMHeadModel(cfg).cuda()
        gpu.load_state_dict(cpu.state_dict())
        for compiled in (False, True):
            got, grads = run(gpu, "cuda", compiled)
            assert abs(got - want) < 1e-3 * abs(want), (compiled, got, want)
            for a, b in zip(grads, want_grads):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
        gpu.transformer.attn_pdrop = 0.1  # training with attention dropout: SDPA with the dense mask
        for block in gpu.transformer.h.values():
            block.attn.attn_pdrop = 0.1
        loss, _ = run(gpu, "cuda")
        assert abs(loss - want) < 0.2 * abs(want), (loss, want)
        print("OK")
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if proc.stdout.strip() == "SKIP":
        pytest.skip("no CUDA GPU visible to the child process")
    assert proc.stdout.strip().endswith("OK")
