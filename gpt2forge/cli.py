"""Console entry points (also behind the top-level scripts)."""

from __future__ import annotations

from typing import Sequence

from .errors import cli_main


@cli_main
def train_main(argv: Sequence[str] | None = None) -> int:
    """`train_gpt2.py` / `gpt2forge-train`."""
    from .arguments import parse_args
    from .trainer import run_training

    return run_training(parse_args(argv))


def generate_parser():
    import argparse

    p = argparse.ArgumentParser(prog="text_generate_gpt2.py",
                                description="Generate text from a GPT-2 checkpoint (ours or a Hugging Face "
                                            "GPT-2 directory). Without --prompt: interactive.")
    p.add_argument("--model-name-or-path", required=True, help="checkpoint directory (or a root with `latest`)")
    p.add_argument("--prompt", default=None, help="one-shot prompt; omit for interactive `Input: ` mode")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--topk", type=int, default=40, help="sample among the k most likely tokens (default: 40)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default: 1.0)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default: 1234)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    return p


@cli_main
def generate_main(argv: Sequence[str] | None = None) -> int:
    """`text_generate_gpt2.py` / `gpt2forge-generate` (the KV-cache generator replaces this loop later)."""
    import torch

    from .checkpoint import load_model_config, load_weights, resolve_checkpoint_dir
    from .errors import UsageError
    from .generation import sample
    from .model import GPT2LMHeadModel
    from .runtime import resolve_device
    from .tokenizer import load_tokenizer

    args = generate_parser().parse_args(argv)
    if args.output_len < 1 or args.topk < 0 or args.temperature < 0:
        raise UsageError("--output-len must be >= 1, --topk >= 0 and --temperature >= 0")
    ckpt = resolve_checkpoint_dir(args.model_name_or_path)
    model = GPT2LMHeadModel(load_model_config(ckpt))
    load_weights(model, ckpt)
    tok = load_tokenizer()
    if model.config.vocab_size != tok.vocab_size:
        raise UsageError(f"{ckpt}: the model's vocabulary ({model.config.vocab_size}) is not the GPT-2 BPE's "
                         f"({tok.vocab_size}); use a checkpoint trained with the GPT-2 tokenizer")
    model.to(resolve_device(args.device)).eval()
    gen = torch.Generator().manual_seed(args.seed)
    temperature = 0.0 if args.greedy else args.temperature

    def complete(text: str) -> str:
        prompt = tok.encode(text)[-(model.config.n_positions - 1):] or [tok.eot_id]
        ids = sample(model, prompt, args.output_len, temperature, args.topk, gen, stop_id=tok.eot_id)
        return tok.decode(ids)

    if args.prompt is not None:
        print(args.prompt + complete(args.prompt))
        return 0
    while True:
        try:
            text = input("Input: ")
        except EOFError:
            return 0
        if not text.strip():
            return 0
        print(text + complete(text), flush=True)
