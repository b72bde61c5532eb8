"""`inference_gpt2.py`: the reference's forward-pass throughput benchmark.

Same flags as training (`train_gpt2.py --help`). The model (random init, or `--checkpoint-input-dir`)
runs in eval mode with its weights in the run's precision; each host step feeds
`--batch-size x --gradient-accumulation x --replication-factor x --device-iterations` sequences
(`input_ids[:, :-1]` of the data items, in micro-batches of `--batch-size`), takes the argmax of
the logits and discards it, as the reference did. Compilation runs before the timed steps.

    step {i} of epoch {e}, throughput: {x} samples/sec, latency avg: {x} ms

"latency" is the wall time of one host step (the reference's definition).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader

from gpt2forge.core import log
from gpt2forge.core.compilation import maybe_compile
from gpt2forge.core.device import resolve_device, synchronize
from gpt2forge.core.errors import UsageError
from gpt2forge.core.precision import PRECISION_DTYPES, configure_matmul, resolve_precision
from gpt2forge.data import DataRequest, collate, load_datasets
from gpt2forge.data.args import DataArgs
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.model.build import build_model


def run_inference(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    device = resolve_device(cfg.runtime.device)
    precision = resolve_precision(cfg.runtime.precision, device)
    configure_matmul(device, precision, cfg.runtime.enable_half_partials)
    model = build_model(cfg.model_source(), device).to(PRECISION_DTYPES[precision]).eval()
    forward = maybe_compile(model, "true" if cfg.runtime.compile_only else cfg.runtime.torch_compile, device,
                            cfg.runtime.executable_cache_dir)
    log.info(f"Parameters: {model.config.num_params() / 1e6:.1f}M, device {device}, precision {precision}")
    micro = cfg.samples_per_step // cfg.parallel.batch_size  # forward calls per host step

    @torch.inference_mode()
    def host_step(batches: list[torch.Tensor]) -> float:
        t0 = synchronize(device)
        for batch in batches:
            forward(batch[:, :-1].clamp(min=0).to(device, non_blocking=True)).argmax(-1)
        return synchronize(device) - t0

    warm = torch.randint(1, model.config.vocab_size, (cfg.parallel.batch_size, cfg.arch.max_len + 1),
                         generator=torch.Generator().manual_seed(42))
    log.banner("Compiling model")
    log.info(f"Compiled/Loaded model in {host_step([warm]):.2f} secs")
    if cfg.runtime.compile_only:
        log.info("Model successfully compiled. Exiting now as '--compile-only' argument was passed.")
        return 0

    # The reader sees only what inference reads: the files, their order and windows, nothing held out.
    reads = DataArgs(dataset=cfg.data.dataset, input_files=cfg.data.input_files, seed=cfg.data.seed,
                     stride=cfg.data.stride)
    data = load_datasets(DataRequest(reads, cfg.arch.max_len, model.config.vocab_size, cfg.samples_per_step))
    loader = DataLoader(data.train, batch_size=cfg.parallel.batch_size, collate_fn=collate, drop_last=True)
    steps_per_epoch = len(loader) // micro
    if steps_per_epoch < 1:
        raise UsageError(f"--input-files: {len(data.train)} samples are fewer than one host step needs "
                         f"({cfg.samples_per_step}); reduce --batch-size or --device-iterations")
    log.banner("Inference")
    done = 0
    for epoch in range(max(cfg.optim.epochs, 1)):
        batches = iter(loader)
        for step in range(steps_per_epoch):
            seconds = host_step([next(batches) for _ in range(micro)])
            if step % cfg.logging.log_steps == 0:
                log.info(f"step {step} of epoch {epoch}, throughput: {cfg.samples_per_step / seconds:.2f} "
                         f"samples/sec, latency avg: {seconds * 1000:.2f} ms")
            done += 1
            if cfg.optim.training_steps is not None and done >= cfg.optim.training_steps:
                return 0
    return 0
