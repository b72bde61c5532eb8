"""Megatron-LM checkpoints in: Megatron-Core's own GPTModel saved as Megatron-LM saves it (TP=1 and
TP=2 over gloo), synthetic legacy checkpoints of each checkpoint_version's QKV layout with tensor and
pipeline shards, export to Hugging Face, the allowlist, and one-line errors.

The Megatron-Core part runs this file under torchrun (2 processes) as its worker, see
`megatron_core_worker`; it skips when megatron-core 0.19.2 is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.megatron_checkpoint import (
    activation_of,
    export_hf,
    load_megatron_checkpoint,
    load_megatron_model,
    main,
)
from gpt2forge.model.megatron_files import TRACKER, is_megatron_checkpoint

ROOT = Path(__file__).resolve().parents[2]
V, PADDED = 100, 128  # real vocabulary; Megatron's embedding rows (padded to 128 x TP in Megatron-LM)
IDS = torch.tensor([[5, 17, 3, 99, 42, 8, 61, 0], [12, 1, 7, 7, 30, 2, 64, 98]])


def tiny(vocab_size: int = V) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                       activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)


def known_model(cfg: ModelConfig, seed: int = 0) -> GPT2LMHeadModel:
    """Random weights with a spread, biases and LayerNorms included, so a misplaced tensor shows."""
    model = GPT2LMHeadModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
        model.transformer.wte.weight[cfg.vocab_size:].zero_()  # padded rows, as init_weights leaves them
    return model.eval()


def megatron_args(cfg: ModelConfig, tp: int = 1, pp: int = 1, **changes) -> argparse.Namespace:
    """The fields of Megatron-LM's args Namespace that describe the model (their names in arguments.py)."""
    args = dict(num_layers=cfg.n_layer, hidden_size=cfg.n_embd, ffn_hidden_size=4 * cfg.n_embd,
                num_attention_heads=cfg.n_head, kv_channels=cfg.n_embd // cfg.n_head,
                max_position_embeddings=cfg.n_positions, padded_vocab_size=PADDED, vocab_size=cfg.vocab_size,
                tokenizer_type="NullTokenizer", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-5,
                hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True, bias_gelu_fusion=False,
                openai_gelu=False, swiglu=False, untie_embeddings_and_output_weights=False,
                transformer_impl="local", params_dtype=torch.float32, ckpt_format="torch")
    args.update(changes)
    return argparse.Namespace(**args)


def save_megatron(root: Path, shards: list[list[dict]], args: argparse.Namespace, version: float | None,
                  iteration: int = 7) -> Path:
    """shards[stage][rank] (model state dicts) written as Megatron-LM's generate_state_dict and
    get_checkpoint_name write them, with RNG states (numpy's included) and the tracker file."""
    pp = len(shards)
    for p, stage in enumerate(shards):
        for t, model_sd in enumerate(stage):
            state = {"args": args, "iteration": iteration, "model": model_sd,
                     "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                    "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
                     "num_floating_point_operations_so_far": 0}
            if version is not None:  # version 0 checkpoints predate the key
                state["checkpoint_version"] = version
            rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            path = root / f"iter_{iteration:07d}" / rank / "model_optim_rng.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
    (root / TRACKER).write_text(f"{iteration}\n")
    return root


def qkv_rows(w: torch.Tensor, version: float, rank: int, tp: int, heads: int) -> torch.Tensor:
    """Our c_attn rows [q; k; v] -> tensor rank `rank`'s rows in the layout of `version`."""
    hn = w.shape[0] // (3 * heads)
    t = w.reshape(3, heads, hn, *w.shape[1:]).chunk(tp, dim=1)[rank]  # (3, np_r, hn, ...)
    if version == 0:
        pass
    elif version == 1.0:
        t = t.movedim(0, 2)  # (np_r, hn, 3, ...)
    else:
        t = t.transpose(0, 1)  # (np_r, 3, hn, ...)
    return t.reshape(-1, *w.shape[1:]).clone()


def legacy_shards(model: GPT2LMHeadModel, version: float, tp: int, pp: int, mcore_names: bool = False,
                  padded: int = PADDED) -> list[list[dict]]:
    """Split a known model of ours the way Megatron shards it: the padded word embedding along its
    rows, QKV and fc1 (column-parallel) along dim 0, the output projections (row-parallel) along
    dim 1, LayerNorms and row-parallel biases replicated; layers over `pp` stages, numbered from 0
    in each. Legacy `language_model` nesting, or Megatron-Core's flat names with the Transformer
    Engine spec (fused LayerNorm names, `_extra_state`)."""
    cfg, sd = model.config, model.state_dict()
    wte = torch.cat([sd["transformer.wte.weight"][:cfg.vocab_size],
                     torch.randn(padded - cfg.vocab_size, cfg.n_embd) * 5.0])  # padding rows: not tokens
    per_stage = cfg.n_layer // pp
    stages = []
    for p in range(pp):
        ranks = []
        for r in range(tp):
            layers = {}
            for local in range(per_stage):
                h = f"transformer.h.{local + p * per_stage}."
                w = {k.removeprefix(h): v for k, v in sd.items() if k.startswith(h)}
                split = {
                    "input_layernorm": (w["ln_1.weight"], w["ln_1.bias"]),
                    "self_attention.query_key_value": (qkv_rows(w["attn.c_attn.weight"], version, r, tp, cfg.n_head),
                                                       qkv_rows(w["attn.c_attn.bias"], version, r, tp, cfg.n_head)),
                    "self_attention.dense": (w["attn.c_proj.weight"].chunk(tp, 1)[r], w["attn.c_proj.bias"]),
                    "post_attention_layernorm": (w["ln_2.weight"], w["ln_2.bias"]),
                    "mlp.dense_h_to_4h": (w["mlp.c_fc.weight"].chunk(tp, 0)[r], w["mlp.c_fc.bias"].chunk(tp)[r]),
                    "mlp.dense_4h_to_h": (w["mlp.c_proj.weight"].chunk(tp, 1)[r], w["mlp.c_proj.bias"]),
                }
                for module, (w, b) in split.items():
                    layers[f"layers.{local}.{module}.weight"] = w.clone()
                    layers[f"layers.{local}.{module}.bias"] = b.clone()
            if p == pp - 1:
                layers["final_layernorm.weight"] = sd["transformer.ln_f.weight"].clone()
                layers["final_layernorm.bias"] = sd["transformer.ln_f.bias"].clone()
            lm = {"encoder": layers}
            if p == 0:
                lm["embedding"] = {"word_embeddings": {"weight": wte.chunk(tp)[r].clone()},
                                   "position_embeddings": {"weight": sd["transformer.wpe.weight"].clone()}}
            shard = {"language_model": lm}
            if p == pp - 1 and pp > 1:  # the last stage's copy of the tied embedding
                shard["word_embeddings_for_head"] = {"weight": wte.chunk(tp)[r].clone()}
            ranks.append(to_mcore_te_names(shard) if mcore_names else shard)
        stages.append(ranks)
    return stages


TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
            "self_attention.query_key_value": "self_attention.linear_qkv",
            "self_attention.dense": "self_attention.linear_proj",
            "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}


def to_mcore_te_names(shard: dict) -> dict:
    """A legacy shard under Megatron-Core's GPTModel names with the Transformer Engine layer spec."""
    lm = shard["language_model"]
    out = {}
    if "embedding" in lm:
        out["embedding.word_embeddings.weight"] = lm["embedding"]["word_embeddings"]["weight"]
        out["embedding.position_embeddings.weight"] = lm["embedding"]["position_embeddings"]["weight"]
    for name, t in lm["encoder"].items():
        if name.startswith("final_layernorm"):
            out[f"decoder.{name}"] = t
            continue
        _, i, rest = name.split(".", 2)
        for old, new in TE_NAMES.items():
            rest = rest.replace(old, new) if rest.startswith(old) else rest
        out[f"decoder.layers.{i}.{rest}"] = t
        if rest.endswith("linear_qkv.weight"):
            out[f"decoder.layers.{i}.self_attention.linear_qkv._extra_state"] = io.BytesIO(b"fp8 meta")
    if "word_embeddings_for_head" in shard:
        out["output_layer.weight"] = shard["word_embeddings_for_head"]["weight"]
    return out


def logits(model: GPT2LMHeadModel) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS)[..., :model.config.vocab_size]


# ------------------------------------------------------------------ synthetic legacy checkpoints


@pytest.mark.parametrize("version,tp,pp,mcore", [(None, 1, 1, False), (1.0, 2, 1, False), (2.0, 1, 2, False),
                                                 (3.0, 2, 2, False), (3.0, 2, 2, True), (3.0, 1, 1, True)])
def test_shards_of_each_version_merge_into_the_same_model(tmp_path, version, tp, pp, mcore):
    model = known_model(tiny())
    shards = legacy_shards(model, version or 0, tp, pp, mcore)
    root = save_megatron(tmp_path, shards, megatron_args(model.config, tp, pp), version)
    assert is_megatron_checkpoint(root) and is_megatron_checkpoint(root / "iter_0000007")
    cfg, state = load_megatron_checkpoint(root)
    assert cfg == model.config
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t), name  # padding rows trimmed (junk there), re-padded with zeros
    torch.testing.assert_close(logits(load_megatron_model(root)), logits(model), rtol=0, atol=0)


def test_a_wrong_version_layout_does_not_load_the_same_model(tmp_path):
    """The layouts differ: version 1.0 shards read as 3.0 give other logits (the test above can fail)."""
    model = known_model(tiny())
    save_megatron(tmp_path, legacy_shards(model, 1.0, 2, 1), megatron_args(model.config, 2), 3.0)
    assert not torch.allclose(logits(load_megatron_model(tmp_path)), logits(model), atol=1e-3)


def test_activation_and_config_follow_megatrons_args():
    cfg = tiny()
    assert activation_of(megatron_args(cfg)) == "gelu"  # F.gelu: the local spec without fusion
    assert activation_of(megatron_args(cfg, bias_gelu_fusion=True)) == "gelu_new"  # fused bias-GeLU: tanh
    assert activation_of(megatron_args(cfg, openai_gelu=True)) == "gelu_new"
    assert activation_of(megatron_args(cfg, transformer_impl="transformer_engine")) == "gelu_new"


def test_disable_bias_linear_loads_zero_biases(tmp_path):
    model = known_model(tiny())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and (".attn." in name or ".mlp." in name):
                p.zero_()
    shards = legacy_shards(model, 3.0, 2, 1)
    for shard in shards[0]:
        enc = shard["language_model"]["encoder"]
        for name in [n for n in enc if n.endswith("bias") and ("attention." in n or "mlp." in n)]:
            del enc[name]
    save_megatron(tmp_path, shards, megatron_args(model.config, 2, add_bias_linear=False), 3.0)
    torch.testing.assert_close(logits(load_megatron_model(tmp_path)), logits(model), rtol=0, atol=0)


# ------------------------------------------------------------------ export, generation, fine-tuning


def test_export_opens_in_transformers_with_the_same_logits(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model = known_model(tiny())
    save_megatron(tmp_path / "meg", legacy_shards(model, 3.0, 2, 1), megatron_args(model.config, 2), 3.0)
    assert main(["export", str(tmp_path / "meg"), str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(IDS).logits
    torch.testing.assert_close(theirs, logits(model), rtol=1e-5, atol=1e-5)
    assert hf.config.activation_function == "gelu" and hf.config.vocab_size == V


def test_export_copies_megatron_tokenizer_files(tmp_path):
    from gpt2forge.text import vocab

    assets = vocab.asset_dir()
    if not (assets / vocab.VOCAB_FILE).is_file() or not (assets / vocab.MERGES_FILE).is_file():
        pytest.skip("GPT-2 vocabulary not fetched; run `python -m gpt2forge.text.vocab` (or `make`)")
    cfg = ModelConfig(vocab_size=50257, n_positions=16, n_embd=32, n_layer=1, n_head=2, activation_function="gelu")
    model = known_model(cfg)
    args = megatron_args(cfg, padded_vocab_size=50304, vocab_size=None, tokenizer_type="GPT2BPETokenizer")
    save_megatron(tmp_path / "meg", legacy_shards(model, 3.0, 1, 1, padded=50304), args, 3.0)
    out = export_hf(tmp_path / "meg", tmp_path / "hf", vocab_file=str(assets / vocab.VOCAB_FILE),
                    merge_file=str(assets / vocab.MERGES_FILE))
    assert (out / "vocab.json").is_file() and (out / "merges.txt").is_file()
    from gpt2forge.model.pretrained import load_pretrained

    loaded, tok = load_pretrained(tmp_path / "meg")  # generation and evaluation open the Megatron directory
    assert tok.vocab_size == 50257
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)


def test_fine_tuning_starts_from_megatron_weights(tmp_path):
    from gpt2forge.frontends.graphcore import parse_args
    from gpt2forge.model.build import build_model

    model = known_model(tiny())
    save_megatron(tmp_path, legacy_shards(model, 3.0, 2, 2), megatron_args(model.config, 2, 2), 3.0)
    base = ["--checkpoint-input-dir", str(tmp_path), "--max-len", "16", "--dataset", "generated"]
    source = parse_args(base).model_source()
    built = build_model(source, torch.device("cpu"))
    assert source.checkpoint == tmp_path
    torch.testing.assert_close(logits(built), logits(model), rtol=0, atol=0)
    with pytest.raises(UsageError, match="add --finetune"):
        parse_args([*base, "--resume-training-from-checkpoint"]).model_source()


# ------------------------------------------------------------------ refused input


class RunsOnLoad:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_holding_another_global_is_refused_and_never_runs(tmp_path, capsys):
    from gpt2forge.cli import generate_main

    model = known_model(tiny())
    marker = tmp_path / "it_ran"
    save_megatron(tmp_path / "meg", legacy_shards(model, 3.0, 1, 1),
                  megatron_args(model.config, 1, extra=RunsOnLoad(marker)), 3.0)
    with pytest.raises(UsageError) as err:
        load_megatron_checkpoint(tmp_path / "meg")
    message = str(err.value)
    assert "\n" not in message and "model_optim_rng.pt" in message and "system" in message
    assert generate_main(["--model-name-or-path", str(tmp_path / "meg"), "--prompt", "hi"]) == 2
    assert "nothing in it ran" in capsys.readouterr().err
    assert not marker.exists()


def _drop(root: Path, rel: str) -> None:
    import shutil

    shutil.rmtree(root / rel) if (root / rel).is_dir() else (root / rel).unlink()


@pytest.mark.parametrize("damage,expected", [
    (lambda root: _drop(root, "iter_0000007/mp_rank_01"), "mp_rank_01/model_optim_rng.pt: missing"),
    (lambda root: _drop(root, TRACKER), "no latest_checkpointed_iteration.txt"),
    (lambda root: (root / TRACKER).write_text("9\n"), "iter_0000009: not found"),
    (lambda root: _resave(root, checkpoint_version=4.0), "checkpoint_version 4.0 is unknown"),
    (lambda root: _resave(root, untie_embeddings_and_output_weights=True), "--untie-embeddings-and-output-weights"),
    (lambda root: _resave(root, position_embedding_type="rope"), "--position-embedding-type rope"),
    (lambda root: _resave(root, tokenizer_type="SentencePieceTokenizer", vocab_size=None), "pass --vocab-size"),
    (lambda root: _resave(root, shrink="layers.0.mlp.dense_h_to_4h.weight"), "inconsistent shapes"),
])
def test_bad_checkpoints_are_one_line(tmp_path, damage, expected):
    model = known_model(tiny())
    save_megatron(tmp_path, legacy_shards(model, 3.0, 2, 1), megatron_args(model.config, 2), 3.0)
    damage(tmp_path)
    with pytest.raises(UsageError, match=expected) as err:
        load_megatron_checkpoint(tmp_path)
    assert "\n" not in str(err.value)


def _resave(root: Path, checkpoint_version: float | None = None, shrink: str | None = None, **arg_changes) -> None:
    """Rewrite tensor rank 0's file with other args, version, or one tensor cut short."""
    path = root / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)  # the test's own file
    vars(state["args"]).update(arg_changes)
    if checkpoint_version is not None:
        state["checkpoint_version"] = checkpoint_version
    if shrink:
        enc = state["model"]["language_model"]["encoder"]
        enc[shrink] = enc[shrink][:-1]
    torch.save(state, path)


# ------------------------------------------------------------------ Megatron-Core's own GPTModel


@pytest.mark.slow
def test_megatron_core_gpt_model_checkpoints_load_with_its_logits(tmp_path):
    """Megatron-Core 0.19.2 builds its GPTModel (local layer spec, CPU initialisation, gloo) at TP=2
    and TP=1, runs its forward, and saves each rank as Megatron-LM does; we load and compare."""
    spec = importlib.util.find_spec("megatron")  # not find_spec("megatron.core"): another test may stub that module
    if spec is None or not any((Path(p) / "core").is_dir() for p in spec.submodule_search_locations or ()):
        pytest.skip("megatron-core is not installed (.venv/bin/pip install --no-deps --ignore-requires-python "
                    "megatron-core==0.19.2)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          __file__, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    if (tmp_path / "skip.txt").is_file():
        pytest.skip((tmp_path / "skip.txt").read_text())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for tp in (1, 2):
        root = tmp_path / f"tp{tp}"
        theirs = torch.load(root / "logits.pt", weights_only=True)
        ours = load_megatron_model(root)
        assert ours.config.activation_function == "gelu" and ours.config.vocab_size == V
        torch.testing.assert_close(logits(ours), theirs[..., :V], rtol=1e-5, atol=1e-5)


def megatron_core_worker(out: Path) -> None:
    """One torchrun process (2 in all): Megatron-Core's GPTModel at TP=2, then TP=1 (data parallel
    2), each rank's model state dict saved as Megatron-LM's save_checkpoint writes it, and the
    model's logits for IDS (gathered over the vocabulary shards) saved next to it by rank 0.

    On a CPU-only PyTorch, Megatron-Core's model code needs four stand-ins, none in the model's
    arithmetic: (1) megatron.core.transformer.moe.ops.paged_stash imports triton at import time
    (`ModuleNotFoundError: No module named 'triton'`), an absent module stands in for those MoE
    kernels; (2) DotProductAttention takes its score buffer from GlobalMemoryBuffer.get_tensor,
    which allocates on torch.cuda.current_device() (`AssertionError: Torch not compiled with CUDA
    enabled`): it allocates on the CPU here; (3) attention dropout runs inside the CUDA RNG
    tracker's fork(), which model_parallel_cuda_manual_seed cannot set up without CUDA (`cuda rng
    state model-parallel-rng is not added`): a tracker whose fork does nothing (dropout is 0, eval
    mode); (4) the default causal mask is made on "cuda": the mask is passed, as Megatron-LM's
    pretrain_gpt.py passes it."""
    import contextlib
    import types
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")

    def triton_kernel(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name}: a Triton kernel, absent on CPU")
        return kernel

    absent = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    absent.__getattr__ = triton_kernel
    sys.modules[absent.__name__] = absent
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core import utils as mcore_utils
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        (out / "skip.txt").write_text(f"megatron-core's model code does not import: {exc}")
        return
    mcore_utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: \
        torch.empty(shape, dtype=dtype)
    no_rng = types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_rng

    dist.init_process_group("gloo")
    cfg = tiny()
    for tp in (2, 1):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        torch.manual_seed(1234)  # use_cpu_initialization: every rank makes the same master weights
        config = TransformerConfig(num_layers=cfg.n_layer, hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                   tensor_model_parallel_size=tp, bias_activation_fusion=False,
                                   masked_softmax_fusion=False, bias_dropout_fusion=False,
                                   gradient_accumulation_fusion=False, persist_layer_norm=False)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=PADDED,
                         max_sequence_length=cfg.n_positions, position_embedding_type="learned_absolute",
                         share_embeddings_and_output_weights=True).eval()
        gen = torch.Generator().manual_seed(5)  # spread every tensor (biases and LayerNorms start at 0 and 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        T = IDS.shape[1]
        with torch.no_grad():
            causal = torch.ones(T, T).triu(1).bool()[None, None]  # True = masked, as get_ltor_masks_and_position_ids
            local = model(IDS, torch.arange(T).expand_as(IDS), attention_mask=causal)  # (B, T, PADDED / tp)
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        root = out / f"tp{tp}"
        if parallel_state.get_data_parallel_rank() == 0:
            path = root / "iter_0000003" / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
            path.mkdir(parents=True, exist_ok=True)
            args = megatron_args(cfg, tp, 1)
            args.model_type = ModelType.encoder_or_decoder  # Megatron's own enum, as pretrain() sets it
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3,
                        "model": model.state_dict_for_save_checkpoint(),
                        "rng_state": [{"np_rng_state": np.random.get_state(),
                                       "torch_rng_state": torch.get_rng_state()}]},
                       path / "model_optim_rng.pt")
        if dist.get_rank() == 0:
            (root / TRACKER).write_text("3")
            torch.save(torch.cat(shards, dim=-1), root / "logits.pt")
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    megatron_core_worker(Path(sys.argv[1]))
