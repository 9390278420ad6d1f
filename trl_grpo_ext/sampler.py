"""Which prompts each process trains on: whole generation batches, the same order everywhere,
from a map-style dataset or a stream."""

from __future__ import annotations

import logging
from functools import partial

import datasets
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler
from transformers.trainer_utils import seed_worker

from . import internals

logger = logging.getLogger(__name__)


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


# Rows of a stream's seeded shuffle buffer (`IterableDataset.shuffle`), as TRL shuffles streams.
SHUFFLE_BUFFER_ROWS = 1000


class StreamBatches(IterableDataset):
    """The generation batches of a streaming dataset (`datasets.IterableDataset`), as
    `GenerationBatchSampler` makes them of a map-style one: every process reads the same stream,
    in a seeded buffered shuffle (`stream.shuffle(seed, buffer_size)`, reseeded per epoch, as
    TRL shuffles streams), takes its own slice of each global generation batch and yields it
    `repeats` times. An incomplete last generation batch is dropped.
    """

    def __init__(
        self,
        stream,
        prompts_per_batch,
        repeats,
        rank,
        world_size,
        shuffle,
        seed,
        buffer_size=SHUFFLE_BUFFER_ROWS,
    ):
        self.stream, self.prompts_per_batch, self.repeats = stream, prompts_per_batch, repeats
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.buffer_size = buffer_size
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        stream = self.stream
        if self.shuffle:
            stream = stream.shuffle(seed=self.seed, buffer_size=self.buffer_size)
            stream.set_epoch(self.epoch)
        global_batch = self.prompts_per_batch * self.world_size
        batch, rows = [], 0
        for row in stream:
            rows += 1
            batch.append(row)
            if len(batch) == global_batch:
                local = batch[self.rank * self.prompts_per_batch :][: self.prompts_per_batch]
                for _ in range(self.repeats):
                    yield [dict(row) for row in local]  # fresh rows, as a map-style dataset's
                batch = []
        if rows < global_batch:  # else an epoch of no step, and training would end silently
            raise ValueError(
                f"train_dataset streamed {rows} prompts but one generation batch needs "
                f"{global_batch}; add prompts or lower per_device_train_batch_size or "
                "steps_per_generation."
            )


class EpochDataLoader(DataLoader):
    """A DataLoader whose `set_epoch` reaches its batch sampler, or its `StreamBatches` (the
    Trainer calls it)."""

    def set_epoch(self, epoch: int):
        (self.batch_sampler if self.batch_sampler is not None else self.dataset).set_epoch(epoch)

    def end_workers(self) -> None:
        """Ends `dataloader_persistent_workers` now, at the end of `train()` (which builds a new
        loader each time). Otherwise they would live until the garbage collector frees the
        trainer, and torch's shutdown, after its queues went first, waits 5 s on each. Drops
        the iterator torch caches for them, whose deletion ends them: the fast path
        "persistent_workers_end" (`internals.py`), on torch's private `DataLoader._iterator`;
        where it is off, they end with the loader, as in transformers' Trainer."""
        if self.persistent_workers and internals.usable("persistent_workers_end"):
            self._iterator = None


def collate_rows(batch: list[dict]) -> list[dict]:
    """Keeps a batch as the list of dataset rows (the trainer renders and tokenises them)."""
    return batch


def worker_options(args) -> dict:
    """The `DataLoader` options of `args` that transformers' Trainer (and TRL's) gives its
    training loader: `dataloader_num_workers` and what goes with them, and each worker seeded as
    the Trainer seeds it. The batch sampler runs in this process and the workers deliver its
    batches in order, so the batches are those of a loader without workers.
    `dataloader_in_order=False` is not followed: the micro-batch slots of a generation batch
    must come in their order. `dataloader_pin_memory` has nothing to pin: the loader yields
    dataset rows, which the trainer tokenises afterwards."""
    if not args.dataloader_num_workers:
        return {}
    if getattr(args, "dataloader_in_order", True) is False:
        logger.warning(
            "dataloader_in_order=False is not followed for training: the repeated prompts of a "
            "generation batch must reach the trainer in order. The training loader delivers "
            "in order; the data loader workers still prepare batches ahead."
        )
    return dict(
        num_workers=args.dataloader_num_workers,
        persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
        multiprocessing_context=args.dataloader_multiprocessing_context,
        worker_init_fn=partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
    )


def train_dataloader(dataset, args) -> DataLoader:
    """The training prompts of this process, one generation batch per item, `steps_per_generation
    * num_iterations` times each: from a `Dataset` by `GenerationBatchSampler` (with
    `dataloader_num_workers` workers fetching its rows, `worker_options`), from a stream
    (`datasets.IterableDataset`) by `StreamBatches` (read in this process, as in TRL: workers
    would each read the stream and interleave their generation batches)."""
    batches = dict(
        prompts_per_batch=args.prompts_per_generation,
        repeats=args.steps_per_generation * args.num_iterations,
        rank=args.process_index,
        world_size=args.world_size,
        shuffle=args.shuffle_dataset,
        seed=args.data_seed if args.data_seed is not None else args.seed,
    )
    if isinstance(dataset, datasets.IterableDataset):  # a stream: no length
        return EpochDataLoader(
            StreamBatches(dataset, **batches), batch_size=None, collate_fn=collate_rows
        )
    needed = args.prompts_per_generation * args.world_size
    if len(dataset) < needed:
        raise ValueError(
            f"train_dataset has {len(dataset)} prompts but one generation batch needs {needed}; "
            "add prompts or lower per_device_train_batch_size or steps_per_generation."
        )
    sampler = GenerationBatchSampler(num_rows=len(dataset), **batches)
    return EpochDataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_rows, **worker_options(args)
    )


def micro_batches_per_epoch(dataset, args) -> int | None:
    """How many micro-batches `train_dataloader` yields per epoch (None for a stream)."""
    if dataset is None or isinstance(dataset, datasets.IterableDataset):
        return None
    batches = len(dataset) // (args.prompts_per_generation * args.world_size)
    return batches * args.steps_per_generation * args.num_iterations
