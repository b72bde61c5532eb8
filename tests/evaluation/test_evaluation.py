"""Zero-shot evaluation protocols: hand-computed values from models with known outputs, Megatron's
window masks as an oracle, parity with transformers.GPT2LMHeadModel, detokenizers, the command
lines, and counts on the real test sets (the `eval_data` fixture; skipped when absent)."""

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from gpt2forge.evaluation import ClozeExample, PerplexityResult, WindowPlan, count_original_tokens
from gpt2forge.evaluation.cli import lambada_main, wiki_main
from gpt2forge.evaluation.detokenizer import detokenizer_name_for, ptb_detokenizer, wikitext_detokenizer
from gpt2forge.evaluation.protocol import build_cloze_examples, fit_example, lambada_example
from gpt2forge.evaluation.scoring import evaluate_cloze, evaluate_stream
from gpt2forge.model.checkpoint import load_weights
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.train.run_folder import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class PositionBigram(torch.nn.Module):
    """Known outputs: logits[b, p] = table[p, ids[b, p]], a bigram table per position in the window,
    so a score depends on where in its window a token is scored (i.e. on the windows)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)  # (T, V, V)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return self.table[pos, ids]  # (B, T, V)


def nll(table, pos, prev, target) -> float:
    return -float(F.log_softmax(table[pos, prev].double(), -1)[target])


# -- windows ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,L,S", [(7, 4, 2), (100, 16, 16), (100, 16, 1), (5, 16, 4), (2, 8, 8), (50, 8, 3),
                                   (17, 8, 8), (18, 8, 8)])
def test_every_target_scored_once_with_context(n, L, S):
    plan = WindowPlan(n, L, S)
    scored = []
    for i, w in enumerate(plan):
        assert 1 <= w.scored <= w.length <= L
        assert w.start + w.length <= n - 1
        first = w.start + w.length - w.scored + 1  # first scored target index
        scored.extend(range(first, w.start + w.length + 1))
        if i > 0:
            assert first - w.start >= L - S  # tokens of context before the first scored target
            assert w.scored <= S
    assert scored == list(range(1, n))
    assert plan.scored_tokens == n - 1


def test_window_edge_cases_by_hand():
    # stride = seq_len: plain non-overlapping windows, the last one shorter
    assert [(w.start, w.length, w.scored) for w in WindowPlan(10, 4, 4)] == [(0, 4, 4), (4, 4, 4), (8, 1, 1)]
    # stride = 1: one new target per window after the first
    assert [(w.start, w.length, w.scored) for w in WindowPlan(7, 4, 1)] == [(0, 4, 4), (1, 4, 1), (2, 4, 1)]
    # text shorter than one window: a single short window
    assert [(w.start, w.length, w.scored) for w in WindowPlan(3, 16, 8)] == [(0, 2, 2)]


def test_perplexity_equals_hand_computed_value():
    V, L = 5, 4
    table = torch.randn(L, V, V, generator=torch.Generator().manual_seed(0))
    tokens = np.array([3, 1, 4, 1, 0, 2, 2])  # N = 7, L = 4, S = 2
    # window 0 = tokens[0:4] scores targets 1..4 at positions 0..3; window 1 = tokens[2:6] scores
    # targets 5, 6 at positions 2, 3.
    by_hand = [(0, 3, 1), (1, 1, 4), (2, 4, 1), (3, 1, 0), (2, 0, 2), (3, 2, 2)]  # (pos, prev, target)
    expected = sum(nll(table, *t) for t in by_hand)
    for batch in (1, 2, 3):
        res = evaluate_stream(PositionBigram(table), tokens, L, 2, batch_size=batch, progress=False)
        assert res.scored_tokens == 6 and res.windows == 2
        assert res.loss_sum == pytest.approx(expected, rel=1e-6)
        assert res.ppl == pytest.approx(math.exp(expected / 6), rel=1e-6)


def megatron_window_loss(model, tokens, L, S) -> float:
    """Megatron-LM's _LMDataset + evaluate, written independently: padded windows, a loss mask,
    full logits, every window including the all-padding ones past the end."""
    targets = max(len(tokens) - 1 - S, 0)
    total = 0.0
    for idx in range(max(math.ceil(targets / S) + 1, 1)):
        window = list(tokens[idx * S: idx * S + L + 1])
        pad_mask = [1] * len(window) + [0] * (L + 1 - len(window))
        window += [0] * (L + 1 - len(window))
        mask = np.array(pad_mask[1:], dtype=np.float64)
        if S != L and idx != 0:
            mask[:-S] = 0
        x = torch.tensor([window[:-1]])
        logp = F.log_softmax(model(x)[0].double(), -1)
        total += float(-(logp[torch.arange(L), torch.tensor(window[1:])] * torch.from_numpy(mask)).sum())
    return total


@pytest.mark.parametrize("L,S", [(8, 8), (8, 3), (8, 1)])
def test_same_loss_as_megatrons_window_masks(L, S):
    V = 7
    table = torch.randn(L, V, V, generator=torch.Generator().manual_seed(1))
    tokens = np.random.default_rng(0).integers(0, V, 29)
    res = evaluate_stream(PositionBigram(table), tokens, L, S, batch_size=4, progress=False)
    assert res.loss_sum == pytest.approx(megatron_window_loss(PositionBigram(table), tokens, L, S), rel=1e-6)


def test_adjusted_perplexity_formula():
    text = "a b c\n\n d e \n"  # 5 words + 3 lines
    assert count_original_tokens(text) == 8
    assert count_original_tokens("one two") == 3  # a last line without its newline still ends
    res = PerplexityResult(loss_sum=30.0, scored_tokens=12, num_tokenized_tokens=13, num_original_tokens=9)
    assert res.loss == 2.5 and res.ppl == pytest.approx(math.exp(2.5))
    assert res.token_ratio == pytest.approx(12 / 8)
    assert res.adjusted_ppl == pytest.approx(math.exp(30.0 / 8))  # exp(loss_sum / (words - 1))


def test_invalid_stride_and_empty_text_are_usage_errors():
    from gpt2forge.core.errors import UsageError

    with pytest.raises(UsageError, match="--overlapping-eval"):
        WindowPlan(100, 8, 9)
    with pytest.raises(UsageError, match="at least 2"):
        WindowPlan(1, 8, 8)


# -- LAMBADA ------------------------------------------------------------------------------------

CHARS = " abcdefg"


def char_encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def succ_table(T: int, strength: float = 4.0) -> torch.Tensor:
    """Predicts the next character of the alphabet (' '->a->b->...->g->' '), same at every position."""
    V = len(CHARS)
    table = torch.zeros(T, V, V)
    for prev in range(V):
        table[:, prev, (prev + 1) % V] = strength
    return table


def test_cloze_accuracy_and_ppl_equal_hand_computed_values():
    V, strength = len(CHARS), 4.0
    p_hit = math.exp(strength) / (math.exp(strength) + V - 1)
    p_miss = 1 / (math.exp(strength) + V - 1)
    texts = ["gg abc", "ab abd", "c efg"]
    model = PositionBigram(succ_table(16, strength))
    # non-strict: the last character given the rest; 'b'->'c' hit, 'b'->'d' miss, 'f'->'g' hit
    ex = build_cloze_examples(texts, char_encode, strict=False, seq_len=16)
    res = evaluate_cloze(model, ex, strict=False, batch_size=2, progress=False)
    assert (res.correct, res.examples, res.target_tokens) == (2, 3, 3)
    assert res.ppl == pytest.approx(math.exp(-(2 * math.log(p_hit) + math.log(p_miss)) / 3))
    # strict, per target character (prev -> target): " abc" after "gg": g->' ', ' '->a, a->b, b->c all
    # hit -> correct; " abd" after "ab": b->' ' miss, ' '->a, a->b hit, b->d miss -> wrong;
    # " efg" after "c": c->' ' miss, ' '->e miss, e->f, f->g hit -> wrong
    ex = build_cloze_examples(texts, char_encode, strict=True, seq_len=16)
    assert ex[0] == ClozeExample(tuple(char_encode("gg")), tuple(char_encode(" abc")))
    res = evaluate_cloze(model, ex, strict=True, batch_size=3, progress=False)
    assert (res.correct, res.examples, res.target_tokens) == (1, 3, 12)
    hits, misses = 4 + 2 + 2, 0 + 2 + 2
    assert res.loss_sum == pytest.approx(-(hits * math.log(p_hit) + misses * math.log(p_miss)), rel=1e-6)
    assert res.ppl == pytest.approx(math.exp(res.loss_sum / 3))


def test_long_examples_lose_context_on_the_left_and_are_counted():
    ex = lambada_example("abcdefg gab", char_encode, strict=True)
    fitted = fit_example(ex, seq_len=6)  # 7 ids at most: 4 target ids, 3 of context
    assert fitted.target == tuple(char_encode(" gab")) and fitted.context == tuple(char_encode("efg"))
    assert fitted.truncated == 4
    model = PositionBigram(succ_table(16))
    res = evaluate_cloze(model, [fitted, fit_example(ex, 16)], strict=True, progress=False)
    assert res.examples == 2 and res.truncated_examples == 1


# -- parity with transformers -------------------------------------------------------------------

def tiny_checkpoint(root: Path, vocab_size: int = 101, n_positions: int = 32, seed: int = 0) -> Path:
    cfg = ModelConfig(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                      vocab_pad_multiple=64)
    model = GPT2LMHeadModel(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial biases and LayerNorms so layout mistakes would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    extra = {}
    if vocab_size == 50257:
        from gpt2forge.train.state import checkpoint_tokenizer_files
        extra = checkpoint_tokenizer_files(vocab_size)
    return save_checkpoint(root, "step_1", model, {}, {}, extra_files=extra)


def load_model(ckpt: Path) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(ModelConfig.from_json(ckpt / "config.json"))
    load_weights(model, ckpt)
    return model.eval()


def hf_window_loss(hf, tokens, plan) -> tuple[float, int]:
    """One window at a time, full logits, as a plain transformers user would."""
    total, correct = 0.0, 0
    for w in plan:
        x = torch.as_tensor(np.asarray(tokens[w.start:w.start + w.length]))[None]
        y = torch.as_tensor(np.asarray(tokens[w.start + 1:w.start + w.length + 1]))[-w.scored:]
        logits = hf(x).logits[0, -w.scored:].double()
        total += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    return total, correct


@pytest.mark.parametrize("S", [32, 9])
def test_same_numbers_as_transformers(tmp_path, S):
    ckpt = tiny_checkpoint(tmp_path)
    ours = load_model(ckpt)
    hf = transformers.GPT2LMHeadModel.from_pretrained(ckpt).eval()
    tokens = np.random.default_rng(0).integers(0, 101, 300)
    res = evaluate_stream(ours, tokens, 32, S, batch_size=5, progress=False)
    with torch.no_grad():
        ref_loss, ref_correct = hf_window_loss(hf, tokens, WindowPlan(300, 32, S))
    assert res.loss_sum == pytest.approx(ref_loss, rel=1e-5)
    assert res.correct == ref_correct
    # cloze: the same model through the cloze path vs transformers on each example
    rng = np.random.default_rng(1)
    examples = [ClozeExample(tuple(rng.integers(0, 101, k)), tuple(rng.integers(0, 101, t)))
                for k, t in [(5, 1), (20, 2), (31, 1), (12, 3)]]
    cz = evaluate_cloze(ours, examples, strict=True, batch_size=3, progress=False)
    ref_nll, ref_hits = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            seq = torch.tensor(ex.context + ex.target)
            logits = hf(seq[None, :-1]).logits[0, -len(ex.target):].double()
            ref_nll += float(F.cross_entropy(logits, seq[-len(ex.target):], reduction="sum"))
            ref_hits += int(bool((logits.argmax(-1) == seq[-len(ex.target):]).all()))
    assert cz.loss_sum == pytest.approx(ref_nll, rel=1e-5) and cz.correct == ref_hits


def test_bf16_close_to_fp32(tmp_path):
    model = load_model(tiny_checkpoint(tmp_path))
    tokens = np.random.default_rng(0).integers(0, 101, 200)
    a = evaluate_stream(model, tokens, 32, 16, progress=False)
    b = evaluate_stream(model, tokens, 32, 16, precision="bf16", progress=False)
    assert b.loss == pytest.approx(a.loss, rel=2e-2) and b.loss != a.loss


# -- detokenizers -------------------------------------------------------------------------------

def test_wikitext_detokenizer():
    src = (' = Robert <unk> = \n \n He had a guest @-@ starring role , in 2 @,@ 000 ( 3 @.@ 5 % ) . '
           'Teddy \'s " Story " ; the players \' union : = = Career = = \n')
    assert wikitext_detokenizer(src) == (' = Robert <unk> =\n\nHe had a guest-starring role, in 2,000 (3.5 %). '
                                         'Teddy\'s "Story"; the players\' union: == Career ==\n')


def test_ptb_detokenizer_and_choice_by_name():
    assert ptb_detokenizer("he does n't pay a $ N bill \n it 's # 1 \n") == "he doesn't pay a $1 bill\nit's #1\n"
    assert detokenizer_name_for("x/wiki.test.tokens") == "wikitext"
    assert detokenizer_name_for("x/wiki.test.raw") == "wikitext"  # WikiText's raw files are word-tokenized too
    assert detokenizer_name_for("notes.raw", " = Robert Boulter = \n He was born in 1 @,@ 000 .") == "wikitext"
    assert detokenizer_name_for("wiki.txt", "Plain prose, with no marks.\n") == "none"  # content decides
    assert detokenizer_name_for("ptb.test.txt") == "ptb"
    assert detokenizer_name_for("lambada_test.jsonl") == "lambada"
    assert detokenizer_name_for("corpus.jsonl") == "none"


# -- command lines ------------------------------------------------------------------------------

def test_wiki_cli_json_matches_transformers(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=64)
    data = tmp_path / "wiki.test.tokens"
    data.write_text(" = Title = \n \n The cat sat on the mat , and the dog @-@ like fox ran . \n" * 6)
    out = tmp_path / "r.json"
    code = wiki_main(["--checkpoint-input-dir", str(tmp_path / "ck"), "--valid-data", str(data), "--seq-length",
                      "32", "--overlapping-eval", "8", "--batch-size", "3", "--output-json", str(out),
                      "--no-progress", "--device", "cpu"])
    assert code == 0
    rec = json.loads(out.read_text())
    assert "adjusted ppl" in capsys.readouterr().out
    from gpt2forge.text.tokenizer import load_tokenizer

    text = data.read_text()
    tokens = load_tokenizer().encode(wikitext_detokenizer(text))
    hf = transformers.GPT2LMHeadModel.from_pretrained(ckpt).eval()
    with torch.no_grad():
        ref, _ = hf_window_loss(hf, tokens, WindowPlan(len(tokens), 32, 8))
    r = rec["result"]
    assert r["loss_sum"] == pytest.approx(ref, rel=1e-5)
    assert r["num_original_tokens"] == count_original_tokens(text) and r["num_tokenized_tokens"] == len(tokens)
    assert r["adjusted_ppl"] == pytest.approx(math.exp(ref / (count_original_tokens(text) - 1)), rel=1e-5)
    assert rec["protocol"]["stride"] == 8 and rec["protocol"]["seq_length"] == 32
    assert rec["protocol"]["detokenizer"] == "wikitext" and rec["dataset"]["sha256"]
    assert rec["checkpoint"]["resolved"] == str(ckpt) and rec["tokenizer"]["vocab_size"] == 50257


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=64)
    data = tmp_path / "t.txt"
    data.write_text("hello world " * 50)
    base = ["--checkpoint-input-dir", str(ckpt), "--no-progress", "--device", "cpu"]
    cases = [
        (wiki_main, ["--valid-data", str(data), "--seq-length", "16", "--overlapping-eval", "17"],
         "--overlapping-eval"),
        (wiki_main, ["--valid-data", str(data), "--seq-length", "65"], "n_positions"),
        (wiki_main, ["--valid-data", str(tmp_path / "missing.txt")], "file not found"),
        (lambada_main, ["--valid-data", str(data)], "line 1: not valid JSON"),
        (wiki_main, ["--valid-data", str(data), "--task", "LAMBADA"], "tasks/evaluate_lambada.py's task"),
        (lambada_main, ["--valid-data", str(data), "--task", "WIKITEXT103"], "tasks/evaluate_wiki.py's task"),
    ]
    for fn, args, needle in cases:
        assert fn(base + args) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert wiki_main(["--checkpoint-input-dir", str(tmp_path / "nope"), "--valid-data", str(data)]) == 2


def test_run_evaluate_sh_usage_line():
    proc = subprocess.run(["bash", str(ROOT / "tasks/run_evaluate.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: " in proc.stderr.lower()
    proc = subprocess.run(["bash", str(ROOT / "tasks/run_evaluate.sh"), "squad"], capture_output=True, text=True)
    assert proc.returncode == 2 and "wiki" in proc.stderr and "lmbd" in proc.stderr


# -- real test sets -----------------------------------------------------------------------------

@pytest.mark.slow
def test_real_wikitext_counts_and_a_few_windows(tmp_path, eval_data):
    from gpt2forge.text.tokenizer import load_tokenizer

    WIKI_RAW, WIKI_TOKENS = eval_data / "wikitext/wiki.test.raw", eval_data / "wikitext/wiki.test.tokens"
    tok = load_tokenizer()
    raw, tokenized = WIKI_RAW.read_text(encoding="utf-8"), WIKI_TOKENS.read_text(encoding="utf-8")
    assert count_original_tokens(raw) == count_original_tokens(tokenized) == 245_569
    n = len(tok.encode(wikitext_detokenizer(tokenized)))
    plan = WindowPlan(n, 1024, 32)
    assert sum(w.scored for w in plan) == n - 1  # the whole file, nothing dropped
    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=128)
    out = tmp_path / "w.json"
    assert wiki_main(["--checkpoint-input-dir", str(ckpt), "--valid-data", str(WIKI_TOKENS), "--max-windows", "4",
                      "--output-json", str(out), "--no-progress", "--device", "cpu"]) == 0
    rec = json.loads(out.read_text())
    assert rec["result"]["partial"] and rec["result"]["scored_tokens"] == 4 * 128
    assert rec["dataset"]["sha256"] == "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True])
def test_real_lambada_counts_and_a_subset(tmp_path, strict, eval_data):
    from gpt2forge.evaluation.data import read_json_lines
    from gpt2forge.text.tokenizer import load_tokenizer

    LAMBADA = eval_data / "lambada/lambada_test.jsonl"
    texts = read_json_lines(LAMBADA, "text", "--valid-data")
    examples = build_cloze_examples(texts, load_tokenizer().encode, strict, seq_len=1024)
    assert len(examples) == 5153 and not any(ex.truncated for ex in examples)
    short = build_cloze_examples(texts, load_tokenizer().encode, strict, seq_len=64)
    assert len(short) == 5153 and 0 < sum(1 for ex in short if ex.truncated) < 5153
    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=128)
    out = tmp_path / "l.json"
    args = ["--checkpoint-input-dir", str(ckpt), "--valid-data", str(LAMBADA), "--max-examples", "40",
            "--batch-size", "16", "--output-json", str(out), "--no-progress", "--device", "cpu",
            "--strict-lambada", str(strict), "--seq-length", "64"]
    assert lambada_main(args) == 0
    rec = json.loads(out.read_text())["result"]
    assert rec["examples"] == 40 and rec["strict"] is strict and 0 <= rec["correct"] <= 40
    assert rec["truncated_examples"] > 0  # some of the first 40 passages exceed 65 tokens


def test_trainer_logs_quick_zero_shot_next_to_validation(tmp_path, capsys):
    from gpt2forge.cli import train_main

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 32, "n_embd": 32,
                               "n_layer": 2, "n_head": 2}))
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(" = A = \n The cat sat on the mat , and the dog ran . \n" * 40)
    lmbd = tmp_path / "lambada.jsonl"
    lmbd.write_text("".join(json.dumps({"text": f"the cat number {i} sat on the mat"}) + "\n" for i in range(5)))
    code = train_main(["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
                       "--device-iterations", "1", "--training-steps", "2", "--num-workers", "0",
                       "--eval-every-steps", "1", "--eval-wikitext", str(wiki), "--eval-lambada", str(lmbd)])
    assert code == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("zero-shot after step")]
    assert len(lines) == 2 and "wikitext ppl" in lines[0] and "lambada acc" in lines[0] and "(5 examples)" in lines[0]


@pytest.mark.slow
def test_large_corpus_modes_jsonl_and_mmap(tmp_path, capsys):
    """Loose JSON (documents + <|endoftext|>) and a Megatron mmap prefix give the stream's perplexity."""
    from gpt2forge.data.indexed import IndexedWriter
    from gpt2forge.text.tokenizer import load_tokenizer

    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=64)
    tok = load_tokenizer()
    docs = [f"Document {i} talks about the weather in town number {i * 7}." * (i + 1) for i in range(6)]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    stream = np.concatenate([np.asarray(tok.encode(d) + [tok.eot_id]) for d in docs])
    with IndexedWriter(tmp_path / "corpus_text_document", np.uint16) as w:
        for d in docs:
            w.add_document(tok.encode(d) + [tok.eot_id])
    model = load_model(ckpt)
    expected = evaluate_stream(model, stream, 16, 8, progress=False)
    for path, extra in [(jsonl, ["--json-key", "body"]), (tmp_path / "corpus_text_document", [])]:
        out = tmp_path / "r.json"
        assert wiki_main(["--checkpoint-input-dir", str(ckpt), "--valid-data", str(path), "--seq-length", "16",
                          "--overlapping-eval", "8", "--output-json", str(out), "--no-progress", *extra]) == 0
        rec = json.loads(out.read_text())
        assert rec["result"]["num_tokenized_tokens"] == len(stream)
        assert rec["result"]["loss_sum"] == pytest.approx(expected.loss_sum, rel=1e-6)
        assert rec["result"]["adjusted_ppl"] is None and rec["dataset"]["sha256"]
    assert rec["dataset"]["format"] == "mmap"


def test_hugging_face_directory_and_tokenizer_type_1(tmp_path):
    """A directory written by transformers' save_pretrained evaluates to the same numbers."""
    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=64)
    hf_dir = tmp_path / "hf"
    transformers.GPT2LMHeadModel.from_pretrained(ckpt).save_pretrained(hf_dir)
    lmbd = tmp_path / "lambada_test.jsonl"
    lmbd.write_text("".join(json.dumps({"text": f"The {w} sat on the mat next to the {w}"}) + "\n"
                            for w in ("cat", "dog", "hippopotamus", "fox")))
    results = []
    for d, tok_type in [(ckpt, "0"), (hf_dir, "1")]:
        out = tmp_path / f"{d.name}.json"
        assert lambada_main(["--model-name-or-path", str(d), "--valid-data", str(lmbd), "--strict-lambada",
                             "--tokenizer-type", tok_type, "--output-json", str(out), "--no-progress"]) == 0
        results.append(json.loads(out.read_text()))
    assert results[0]["result"]["loss_sum"] == pytest.approx(results[1]["result"]["loss_sum"], rel=1e-6)
    assert results[1]["tokenizer"]["type"] == 1 and results[1]["protocol"]["strict"] is True
    assert results[0]["result"]["target_tokens"] > 4  # "hippopotamus" is several BPE tokens


def shipped_args(tmp_path, script: str, *args: str, env: dict | None = None) -> list[str]:
    """The arguments a tasks/*.sh script passes to Python (PYTHON replaced by a recorder)."""
    import os

    rec = tmp_path / "args.txt"
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {rec}\n')
    stub.chmod(0o755)
    subprocess.run(["bash", str(ROOT / "tasks" / script), *args], check=True,
                   env={**os.environ, "PYTHON": str(stub), **(env or {})})
    return rec.read_text().splitlines()[1:]  # drop the script path


def test_shipped_task_command_lines_parse(tmp_path):
    from gpt2forge.evaluation.cli import lambada_parser, wiki_parser

    wiki = shipped_args(tmp_path, "run_evaluate.sh", "wiki", "CKPT", "data.tokens")
    a = wiki_parser().parse_args(wiki)
    assert (a.checkpoint, a.valid_data, a.seq_length, a.overlapping_eval) == ("CKPT", ["data.tokens"], None, 32)
    a = wiki_parser().parse_args(shipped_args(tmp_path, "run_evaluate.sh", "wiki", "C", "d", env={"SEQ_LEN": "512"}))
    assert a.seq_length == 512
    lmbd = shipped_args(tmp_path, "run_evaluate.sh", "lmbd", env={"CHECKPOINT_PATH": "C", "DATA_PATH": "l.jsonl",
                                                                  "STRICT": "true"})
    a = lambada_parser().parse_args(lmbd)
    assert (a.checkpoint, a.valid_data, a.strict_lambada) == ("C", ["l.jsonl"], True)
    (tmp_path / "ck").mkdir()
    gen = shipped_args(tmp_path, "run_text_generator.sh", str(tmp_path / "ck"), "--prompt", "Hi")
    from gpt2forge.cli import generate_parser

    g = generate_parser().parse_args(gen)
    assert g.prompt == "Hi" and g.output_len == 256


@pytest.mark.slow
def test_task_scripts_run_as_written_on_a_short_context_checkpoint(tmp_path):
    """`make train`'s model has 128 positions: the scripts' defaults (the reference's 1024-token windows and
    256 generated tokens) are fitted to the model's context, as README's next steps run them."""
    import os
    import sys

    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=64)
    data = tmp_path / "wiki.test.tokens"
    data.write_text(" = Title = \n \n The cat sat on the mat , and the dog @-@ like fox ran . \n" * 6)
    env = {**os.environ, "PYTHON": sys.executable, "CHECKPOINT_PATH": str(ckpt)}
    wiki = subprocess.run(["bash", str(ROOT / "tasks/run_evaluate.sh"), "wiki", str(ckpt), str(data), "--device",
                           "cpu", "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert wiki.returncode == 0, wiki.stderr
    assert json.loads((tmp_path / "results/wiki.json").read_text())["protocol"]["seq_length"] == 64
    gen = subprocess.run(["bash", str(ROOT / "tasks/run_text_generator.sh")], input="The module\n", cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert "--output-len 256 leaves no room for a prompt in the model's n_positions (64): at most 32 tokens are " \
           "generated" in gen.stderr


def test_checkpoint_with_its_own_tokenizer(tmp_path):
    """A model trained with another tokenizer is evaluated with the tokenizer saved beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = ["the cat sat on the mat", "a dog ran to the park", "the fox jumped over the dog"] * 20
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=tok.get_vocab_size(), n_positions=32)
    tok.save(str(ckpt / "tokenizer.json"))
    lmbd = tmp_path / "lambada.jsonl"
    lmbd.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus[:3]))
    out = tmp_path / "r.json"
    assert lambada_main(["--checkpoint-input-dir", str(ckpt), "--valid-data", str(lmbd), "--strict-lambada",
                         "--output-json", str(out), "--no-progress"]) == 0
    rec = json.loads(out.read_text())
    assert rec["tokenizer"]["vocab_size"] == tok.get_vocab_size() and rec["result"]["examples"] == 3
    model = load_model(ckpt)
    examples = build_cloze_examples(corpus[:3], lambda s: tok.encode(s).ids, True, 32)
    assert rec["result"]["loss_sum"] == pytest.approx(evaluate_cloze(model, examples, True, progress=False).loss_sum)


def test_gpt_neo_folder_same_numbers_as_transformers(tmp_path):
    """A GPT-Neo folder (save_pretrained; local layers of window 8 inside 32-token windows): the
    stream's overlapping windows (scored through `last`) and the cloze path give transformers' numbers."""
    from gpt2forge.model.checkpoint import load_model as load_folder

    torch.manual_seed(0)
    hf = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=101, max_position_embeddings=32, hidden_size=32, num_layers=2, num_heads=2,
        attention_types=[[["local", "global"], 1]], window_size=8)).eval()
    hf.save_pretrained(tmp_path / "neo")
    ours = load_folder(tmp_path / "neo").eval()
    tokens = np.random.default_rng(0).integers(0, 101, 300)
    res = evaluate_stream(ours, tokens, 32, 9, batch_size=5, progress=False)
    rng = np.random.default_rng(1)
    examples = [ClozeExample(tuple(rng.integers(0, 101, k)), tuple(rng.integers(0, 101, t)))
                for k, t in [(5, 1), (20, 2), (31, 1)]]
    cz = evaluate_cloze(ours, examples, strict=True, batch_size=3, progress=False)
    with torch.no_grad():
        ref_loss, ref_correct = hf_window_loss(hf, tokens, WindowPlan(300, 32, 9))
        ref_nll = 0.0
        for ex in examples:
            logits = hf(torch.tensor(ex.context + ex.target)[None, :-1]).logits[0, -len(ex.target):]
            ref_nll += float(F.cross_entropy(logits, torch.tensor(ex.target), reduction="sum"))
    assert res.loss_sum == pytest.approx(ref_loss, rel=1e-5) and res.correct == ref_correct
    assert cz.loss_sum == pytest.approx(ref_nll, rel=1e-5)
