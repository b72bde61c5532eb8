"""``--dataset generated``: synthetic uniform token ids, for benchmarks and smoke tests.

The reference drew one ``(4 * samples_per_step, max_len + 1)`` numpy array after ``np.random.seed``.
Here the data is virtual: item ``i`` is drawn on access from a ``torch.Generator`` seeded by
``(seed, i)``, so memory is O(1), items are the same in every worker and in any access order.
"""

from __future__ import annotations

import numpy as np
import torch

from gpt2forge.data.contract import DataAccount, DataRequest, DatasetSplit

STEPS_PER_EPOCH = 4
"""Host steps per epoch of generated data (as in the reference)."""


class GeneratedDataset(torch.utils.data.Dataset):
    """``num_samples`` items of ``sample_len`` int64 ids, uniform in ``[1, vocab_size)``.

    Item ``i`` depends only on ``(seed, i)``: reading it twice, from another dataset object with the
    same arguments, or from another DataLoader worker gives the same tensor.
    """

    def __init__(self, num_samples: int, sample_len: int, vocab_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.sample_len = sample_len
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} generated samples")
        # SeedSequence mixes (seed, i) into a well-spread 64-bit seed; plain seed + i would make
        # neighbouring seeds share most of their samples.
        entropy = [self.seed % 2**64, i]
        item_seed = int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])
        gen = torch.Generator().manual_seed(item_seed)
        return torch.randint(1, self.vocab_size, (self.sample_len,), generator=gen, dtype=torch.int64)


def load(req: DataRequest) -> DatasetSplit:
    """Reader for ``generated``: ``4 * samples_per_step`` items of ``max_len + 1`` tokens.

    ``--input-files``, ``--stride`` and ``--val-num`` are ignored. ``val`` is None: the reference
    returned the training array again as its "validation" set, which validated nothing.
    """
    train = GeneratedDataset(
        num_samples=STEPS_PER_EPOCH * req.samples_per_step,
        sample_len=req.max_len + 1,
        vocab_size=req.vocab_size,
        seed=req.data.seed,
    )
    n, tokens = train.num_samples, train.num_samples * train.sample_len
    account = DataAccount("train", "generated (uniform random token ids)", n, tokens, n, "samples", tokens,
                          unit="samples")
    return DatasetSplit(train=train, val=None, accounts=(account,))
