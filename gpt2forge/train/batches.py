"""What the training loop feeds on: the datasets and the run's length (`load_data`), an epoch's
updates as micro-batches on the device (`epoch_updates`), and the shares a blend has drawn."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, IterableDataset

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.data import DataRequest, DatasetSplit, EpochOrdered, ShardedStream, data_loader, load_datasets
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.state import Progress
from gpt2forge.train.step import Run


def load_data(cfg: TrainConfig, vocab_size: int, samples_per_step: int) -> tuple[DatasetSplit, int, int]:
    """The datasets, the host steps per epoch and the run's host steps; prints what each split's reader
    kept and dropped (one `DataAccount` line each) and the epoch's share of the training samples."""
    log.banner("Loading data")
    t0 = time.perf_counter()
    fixed_steps = steps_from_length(cfg, samples_per_step)
    data = load_datasets(DataRequest(cfg.data, cfg.arch.max_len, vocab_size, samples_per_step, cfg.optim.epochs,
                                     fixed_steps))
    for account in data.accounts:
        log.info(account.line())
    steps_per_epoch = len(data.train) // samples_per_step
    if steps_per_epoch < 1:
        raise UsageError(f"--input-files: {len(data.train)} training samples are fewer than one host step needs "
                         f"({samples_per_step}); reduce --batch-size, --gradient-accumulation or "
                         "--device-iterations, or add data")
    read = steps_per_epoch * samples_per_step
    # An epoch reads whole steps; an EpochOrdered dataset reads on where the last epoch stopped, any
    # other leaves a different remainder out of each (reshuffled) epoch.
    rest = "" if read == len(data.train) or isinstance(data.train, EpochOrdered) else (
        f" (an epoch reads {read} of them: {steps_per_epoch} steps of {samples_per_step})")
    log.info(f"Samples per epoch: {len(data.train)}{rest}")
    log.info(f"Steps per epoch: {steps_per_epoch}")
    log.info(f"Data loaded in {time.perf_counter() - t0:.2f} secs")
    return data, steps_per_epoch, fixed_steps or cfg.optim.epochs * steps_per_epoch



def epoch_updates(run: Run, dataset: Dataset, progress: Progress, steps_per_epoch: int,
                  shuffle: bool) -> Iterator[list[torch.Tensor]]:
    """The optimizer updates left in the current epoch, each a list of `run.accumulation`
    micro-batches on the device (streamed: one update's batches are held at a time).

    The order is a permutation seeded by (seed, epoch), so it does not depend on where a run
    was resumed; the DataLoader gets its own generator so it never draws from the global RNG.
    """
    B = run.cfg.parallel.batch_size
    micro_per_step = run.accumulation * run.cfg.parallel.device_iterations
    pin = run.device.type == "cuda"
    if isinstance(dataset, IterableDataset):
        # Stream order does not depend on the worker count (protocol in gpt2forge.data), so a
        # resumed run starts at its next block without reading the consumed ones.
        start = progress.step_in_epoch * micro_per_step
        if isinstance(dataset, ShardedStream):  # a replica's pipeline stages read the same records
            dataset.shard(run.replica.rank, run.replica.world_size)
        stream = dataset.epoch_stream(progress.epoch, B, start, group=run.accumulation)
        loader = data_loader(stream, run.cfg.data, pin_memory=pin, batch_size=B)
        batches = itertools.islice(loader, steps_per_epoch * micro_per_step - start)
    else:
        batches = data_loader(dataset, run.cfg.data, pin_memory=pin,
                              batch_sampler=_replica_batches(run, dataset, progress, steps_per_epoch, shuffle))
    group: list[torch.Tensor] = []
    try:
        for batch in batches:
            group.append(batch.to(run.device, non_blocking=True))
            if len(group) == run.accumulation:
                yield group
                group = []
    except UsageError as exc:
        # A reader's error raised in a DataLoader worker arrives wrapped in a traceback text.
        raise UsageError(str(exc).rstrip().splitlines()[-1].split("UsageError: ", 1)[-1]) from None


def _replica_batches(run: Run, dataset: Dataset, progress: Progress, steps_per_epoch: int, shuffle: bool
                     ) -> list[list[int]]:
    """This replica's micro-batches (sample indices) of a map-style dataset from the current step to the
    epoch's end. Every replica draws from one global order seeded by (seed, epoch)."""
    B, iterations, env = run.cfg.parallel.batch_size, run.cfg.parallel.device_iterations, run.replica
    count = steps_per_epoch * run.accumulation * iterations * B * env.world_size
    if isinstance(dataset, EpochOrdered):
        order = dataset.epoch_indices(progress.epoch, count)
    elif shuffle:
        seed = run.cfg.data.seed + progress.epoch
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(len(dataset))
    # (step, update, replica, micro-batches of the update): replica r takes its own slice of every
    # update, so the union over replicas is what one process with all the accumulation would see.
    used = order[:count].view(steps_per_epoch, iterations, env.world_size, -1)[:, :, env.rank]
    used = used.reshape(steps_per_epoch, run.accumulation * iterations, B)
    return used[progress.step_in_epoch:].reshape(-1, B).tolist()


def blend_shares(dataset: Dataset, consumed: int) -> str:
    """``", shares: A 0.700 B 0.300"``: each corpus's share of the first `consumed` samples of a
    blended dataset (``realized_shares``, by file name); "" for any other dataset."""
    shares = getattr(dataset, "realized_shares", None)
    if shares is None:
        return ""
    return ", shares: " + " ".join(f"{name.rsplit('/', 1)[-1]} {share:.3f}" for name, share in shares(consumed).items())


def steps_from_length(cfg: TrainConfig, samples_per_step: int) -> int | None:
    """Host steps of the run when its length is given in steps or samples (--training-steps, else
    --train-samples rounded up to whole steps); None when it is given in epochs."""
    if cfg.optim.training_steps is not None:
        return cfg.optim.training_steps
    if cfg.optim.train_samples is not None:
        return -(-cfg.optim.train_samples // samples_per_step)
    return None
