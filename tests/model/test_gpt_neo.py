"""GPT-Neo as a configuration of our GPT-2: a folder `GPTNeoForCausalLM.save_pretrained` writes loads with
transformers' logits (local attention windows, unscaled scores, no q/k/v biases, nn.Linear weights),
and what we save opens in transformers with the same logits."""

import pytest
import torch
import transformers

from gpt2forge.core.errors import UsageError
from gpt2forge.model.checkpoint import export_pretrained, load_model
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import window_mask
from gpt2forge.model.gpt_neo import compress_attention_layers, expand_attention_types
from gpt2forge.train.run_folder import save_checkpoint

V, T, WINDOW = 101, 32, 8


def neo_config(**kw) -> transformers.GPTNeoConfig:
    base = dict(vocab_size=V, max_position_embeddings=T, hidden_size=64, num_layers=4, num_heads=4,
                attention_types=[[["global", "local"], 2]], window_size=WINDOW, resid_dropout=0.0,
                embed_dropout=0.0, attention_dropout=0.0, bos_token_id=V - 1, eos_token_id=V - 1)
    base.update(kw)
    cfg = transformers.GPTNeoConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def hf_neo(**kw) -> transformers.GPTNeoForCausalLM:
    torch.manual_seed(0)
    hf = transformers.GPTNeoForCausalLM(neo_config(**kw)).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorms, so layout mistakes show up
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    return hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("neo")
    hf = hf_neo()
    hf.save_pretrained(path)
    return path, hf


def ids(B: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_window_mask_is_causal_over_the_last_window_positions():
    mask = window_mask(4, 6, 3, torch.device("cpu"))  # queries are positions 2..5
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_config_reads_and_writes_gpt_neo_keys():
    cfg = ModelConfig.from_hf_dict(neo_config().to_dict())
    assert (cfg.model_type, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == ("gpt_neo", 4, 64, 4, T)
    assert cfg.attention_layers == ["global", "local"] * 2 and not cfg.scale_attn_weights and not cfg.qkv_bias
    assert [cfg.attention_window(i) for i in range(4)] == [None, WINDOW, None, WINDOW]
    back = transformers.GPTNeoConfig(**cfg.to_hf_dict())
    assert back.attention_layers == cfg.attention_layers and back.window_size == WINDOW
    assert compress_attention_layers(["local", "global", "local", "global"]) == [[["local", "global"], 2]]
    assert expand_attention_types([[["global"], 1], [["local"], 2]]) == ["global", "local", "local"]
    with pytest.raises(UsageError, match="3 entries for 4 layers"):
        ModelConfig(model_type="gpt_neo", n_layer=4, attention_layers=["global"] * 3, scale_attn_weights=False)
    with pytest.raises(UsageError, match="needs model_type gpt_neo"):
        ModelConfig(attention_layers=["local"] * 12)


def test_folder_loads_with_transformers_logits(folder):
    path, hf = folder
    model = load_model(path).eval()
    x = ids()
    with torch.no_grad():
        ref, got = hf(x).logits, model(x)[..., :V]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The local layers matter at T > window: all-global attention gives other logits.
    hf_global = hf_neo(attention_types=[[["global"], 4]])
    with torch.no_grad():
        assert (hf_global(x).logits - ref).abs().max() > 1e-3


def test_padding_and_packed_documents_match_transformers(folder):
    """Left padding as our forward takes it (the padding one document, positions restarting at the
    prompt) and packed documents: each equals transformers on the unpadded / separate sequences."""
    path, hf = folder
    model = load_model(path).eval()
    x = ids(B=1, seed=2)
    cut = 11  # documents [0, 11) and [11, T): the second is longer than the window
    document_ids = (torch.arange(T) >= cut).long()[None]
    position_ids = torch.cat([torch.arange(cut), torch.arange(T - cut)])[None]
    with torch.no_grad():
        got = model(x, position_ids=position_ids, document_ids=document_ids)[..., :V]
        first, second = hf(x[:, :cut]).logits, hf(x[:, cut:]).logits
        # transformers' own left padding: attention_mask and position ids of the real tokens
        mask = document_ids.clone()
        padded = hf(x, attention_mask=mask, position_ids=(position_ids * mask)).logits
    torch.testing.assert_close(got[:, :cut], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, cut:], second, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, cut:], padded[:, cut:], rtol=1e-5, atol=1e-5)


def test_last_positions_equal_the_full_forward(folder):
    model = load_model(folder[0]).eval()
    x = ids(B=2)
    with torch.no_grad():
        full = model.transformer(x)
        last = model.transformer(x, last=5)
    torch.testing.assert_close(last, full[:, -5:], rtol=1e-5, atol=1e-5)


def test_saved_folder_opens_in_transformers_with_the_same_logits(folder, tmp_path):
    model = load_model(folder[0]).eval()
    x = ids()
    with torch.no_grad():
        ours = model(x)[..., :V]
    for path in (save_checkpoint(tmp_path / "run", "step_1", model, {"step": 1}, {"seed": 1}),
                 export_pretrained(tmp_path / "final", model)):
        hf = transformers.GPTNeoForCausalLM.from_pretrained(path).eval()
        assert hf.config.attention_layers == ["global", "local"] * 2 and hf.config.window_size == WINDOW
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(load_model(path).eval()(x)[..., :V], ours)


def test_gpt_neo_125m_config_reads_with_transformers_parameter_count():
    """EleutherAI/gpt-neo-125m's config.json (its keys as the hub has them): our shape and parameter
    count (no q/k/v biases) equal transformers' model of it."""
    hub = {"activation_function": "gelu_new", "architectures": ["GPTNeoForCausalLM"], "attention_dropout": 0,
           "attention_layers": ["global", "local"] * 6, "attention_types": [[["global", "local"], 6]],
           "bos_token_id": 50256, "embed_dropout": 0, "eos_token_id": 50256, "gradient_checkpointing": False,
           "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": None, "layer_norm_epsilon": 1e-05,
           "max_position_embeddings": 2048, "model_type": "gpt_neo", "num_heads": 12, "num_layers": 12,
           "resid_dropout": 0, "summary_activation": None, "summary_first_dropout": 0.1, "use_cache": True,
           "vocab_size": 50257, "window_size": 256}
    cfg = ModelConfig.from_hf_dict(hub)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_positions, cfg.window_size, cfg.attn_pdrop) == (12, 768, 2048, 256, 0)
    with torch.device("meta"):
        theirs = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(**cfg.to_hf_dict()))
    assert cfg.num_params() == theirs.num_parameters() == 125_198_592


def test_new_gpt_neo_initialises_as_transformers_does():
    """GPTNeoForCausalLM draws every nn.Linear from N(0, initializer_range): no 1/sqrt(2 n_layer) on c_proj."""
    from gpt2forge.model.gpt2 import GPT2LMHeadModel

    hf_cfg = neo_config(num_layers=8, attention_types=[[["global", "local"], 4]])
    model = GPT2LMHeadModel(ModelConfig.from_hf_dict(hf_cfg.to_dict()))
    model.init_weights(torch.Generator().manual_seed(0))
    hf = transformers.GPTNeoForCausalLM(hf_cfg)
    for ours_name, theirs_name in (("h.0.mlp.c_proj.weight", "h.0.mlp.c_proj.weight"),
                                   ("h.0.attn.c_proj.weight", "h.0.attn.attention.out_proj.weight")):
        ours_std = float(model.state_dict()["transformer." + ours_name].std())
        theirs_std = float(hf.state_dict()["transformer." + theirs_name].std())
        assert ours_std == pytest.approx(theirs_std, rel=0.1) and ours_std == pytest.approx(0.02, rel=0.1)


def test_older_pytorch_model_bin_with_mask_buffers_loads(folder, tmp_path):
    """Older transformers saved GPT-Neo's causal-mask buffers (attn.attention.bias, masked_bias) and the
    tied lm_head in pytorch_model.bin: they are dropped, the weights load."""
    path, hf = folder
    sd = dict(hf.state_dict())
    sd["transformer.h.1.attn.attention.bias"] = torch.ones(1, 1, T, T, dtype=torch.bool)
    sd["transformer.h.1.attn.attention.masked_bias"] = torch.tensor(-1e9)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    x = ids(B=1)
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path).eval()(x)[..., :V], hf(x).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(UsageError, match="not a gpt_neo model of this shape"):
        torch.save({k: v for k, v in sd.items() if "k_proj" not in k}, tmp_path / "pytorch_model.bin")
        load_model(tmp_path)
