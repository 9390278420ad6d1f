"""Which prompts each process trains on: whole generation batches, the same order everywhere."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler


class GenerationBatchSampler(Sampler[list[int]]):
    """Yields this process's prompt indices of each generation batch, `repeats` times in a row.

    Every process draws the same permutation (seeded by `seed + epoch`) and takes its own slice
    of each global generation batch, so processes never share a prompt and a group never leaves
    its process. An incomplete last generation batch is dropped.
    """

    def __init__(self, num_rows, prompts_per_batch, repeats, rank, world_size, shuffle, seed):
        self.num_rows, self.prompts_per_batch, self.repeats = num_rows, prompts_per_batch, repeats
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.num_rows // (self.prompts_per_batch * self.world_size) * self.repeats

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        global_batch = self.prompts_per_batch * self.world_size
        for start in range(0, self.num_rows - global_batch + 1, global_batch):
            local = order[start + self.rank * self.prompts_per_batch :][: self.prompts_per_batch]
            for _ in range(self.repeats):
                yield local


class EpochDataLoader(DataLoader):
    """A DataLoader whose `set_epoch` reaches its batch sampler (the Trainer calls it)."""

    def set_epoch(self, epoch: int):
        self.batch_sampler.set_epoch(epoch)


def collate_rows(batch: list[dict]) -> list[dict]:
    """Keeps a batch as the list of dataset rows (the trainer renders and tokenises them)."""
    return batch
