"""Asynchronous rollouts with bounded staleness.

A rollout worker generates the generation batches of the next optimizer steps while the trainer
trains on the current one. `RolloutPipeline` decides what the worker may generate and when:

- at optimizer step s the trainer first sends its weights (version s, the number of optimizer
  steps they have seen; under LoRA only the adapter), then submits the batches of steps up to
  s + k, then waits for the batch of step s;
- the worker handles its messages in order, so a batch submitted at step s is generated with
  weights of version >= s. The batch of step j is submitted at step max(0, j - k) or later,
  hence its staleness j - version is at most k. With k = 0 the trainer waits for each batch
  right after sending its weights: the synchronous trainer.

`ProcessRolloutWorker` is the worker on one machine: a separate process with its own copy of
the model running `transformers` generate, so generation and training overlap on separate CPU
cores (or a second GPU). A server backend (for example vLLM with LoRA hot-loading) would
implement the same four methods: `update_weights`, `submit`, `result`, `close`.
"""

from __future__ import annotations

import copy
import queue
import sys
import traceback
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.multiprocessing as mp

from .rollout import (
    completion_mask_from_ids,
    generate_with_transformers,
    seeded,
)


@dataclass
class GeneratedBatch:
    """What a worker returns for one generation batch (tokens, not text)."""

    index: int
    version: int
    prompt_ids: torch.Tensor  # (N, P)
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T)
    behaviour_logps: torch.Tensor  # (N, T)


class RolloutWorker(Protocol):
    def update_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None: ...

    def submit(self, index: int, prompts: tuple[torch.Tensor, torch.Tensor], seed: int) -> None:
        """Queues batch `index`: `prompts` is `(prompt_ids, prompt_mask)`, left-padded."""

    def result(self, index: int) -> GeneratedBatch: ...

    def close(self) -> None: ...


def sample_batch(model, prompts, generation_config, seed):
    """Samples one generation batch and the behaviour log-probs of its tokens (from the
    sampling pass's own logits, as a server backend such as vLLM reports them)."""
    with seeded(seed, model.device):
        prompt_ids, prompt_mask, completion_ids, behaviour_logps = generate_with_transformers(
            model, *prompts, generation_config=generation_config, return_logprobs=True
        )
    eos = generation_config.eos_token_id
    completion_mask, _ = completion_mask_from_ids(
        completion_ids, eos if isinstance(eos, list) else [eos]
    )
    return prompt_ids, prompt_mask, completion_ids, behaviour_logps * completion_mask


def _worker_main(model, generation_config, threads, requests, results):
    torch.set_num_threads(threads)
    model.eval()
    parameters = dict(model.named_parameters())
    version = 0
    while True:
        message = requests.get()
        if message[0] == "stop":
            return
        if message[0] == "weights":
            _, version, weights = message
            with torch.no_grad():
                for name, value in weights.items():
                    parameters[name].copy_(value)
            continue
        _, index, prompts, seed = message
        try:
            tensors = sample_batch(model, prompts, generation_config, seed)
            results.put((index, version, tensors))
        except Exception:  # noqa: BLE001 - sent to the trainer, which raises it
            results.put((index, version, traceback.format_exc()))


class ProcessRolloutWorker:
    """A rollout worker in a separate process, with its own copy of the model."""

    def __init__(self, model, generation_config, threads=1):
        # fork needs no importable __main__ and shares the copied model without pickling; CUDA
        # cannot cross a fork, so a process that initialised it spawns instead (which needs the
        # usual `if __name__ == "__main__":` guard in the user's script).
        use_fork = sys.platform == "linux" and not torch.cuda.is_initialized()
        context = mp.get_context("fork" if use_fork else "spawn")
        self._requests, self._results = context.Queue(), context.Queue()
        worker_model = (
            copy.deepcopy(model).cpu() if model.device.type != "cpu" else copy.deepcopy(model)
        )
        self._process = context.Process(
            target=_worker_main,
            args=(worker_model, generation_config, threads, self._requests, self._results),
            daemon=True,
        )
        self._process.start()
        self._ready: dict[int, tuple] = {}

    def update_weights(self, version, weights):
        self._requests.put(
            ("weights", version, {k: v.detach().cpu().clone() for k, v in weights.items()})
        )

    def submit(self, index, prompts, seed):
        self._requests.put(("generate", index, tuple(prompts), seed))

    def result(self, index) -> GeneratedBatch:
        while index not in self._ready:
            try:
                got_index, version, payload = self._results.get(timeout=5)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"The rollout worker died (exit code {self._process.exitcode})."
                    ) from None
                continue
            self._ready[got_index] = (version, payload)
        version, payload = self._ready.pop(index)
        if isinstance(payload, str):
            raise RuntimeError(f"The rollout worker failed on batch {index}:\n{payload}")
        return GeneratedBatch(index, version, *payload)

    def close(self):
        if self._process.is_alive():
            self._requests.put(("stop",))
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.terminate()


class RolloutPipeline:
    """Keeps a worker at most `max_staleness` optimizer steps ahead of the trainer.

    Args:
        worker (`RolloutWorker`): generates batches in the order it receives messages.
        max_staleness (`int`): k; no batch is consumed more than k steps after its weights.
    """

    def __init__(self, worker: RolloutWorker, max_staleness: int):
        self.worker, self.max_staleness = worker, max_staleness
        self.sent_version: int | None = None
        self.submitted: set[int] = set()

    def consume(self, step: int, weights, upcoming: dict[int, tuple[tuple, int]]):
        """The batch of optimizer step `step`, generated by weights at most k steps old.

        Args:
            step (`int`): the current optimizer step (also the current weights' version).
            weights (`Callable[[], dict]`): returns the weights to send, called only when the
                worker has older ones.
            upcoming (`dict[int, (prompts, seed)]`): the batches of steps `step`,
                `step + 1`, ... that are known so far.
        """
        self._send_weights(step, weights)
        for index in sorted(upcoming):
            if index <= step + self.max_staleness and index not in self.submitted:
                self.worker.submit(index, *upcoming[index])
                self.submitted.add(index)
        if step not in self.submitted:
            raise RuntimeError(f"The batch of step {step} was never submitted.")
        batch = self.worker.result(step)
        self.submitted.discard(step)
        if batch.version is None:  # a worker must raise its failed update, never hide it here
            raise RuntimeError(
                f"Batch {step} was generated before any weights reached the rollout worker: its "
                "first weight update failed without an error."
            )
        staleness = step - batch.version
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(
                f"Batch {step} came from weights {batch.version}: staleness {staleness} is "
                f"outside [0, {self.max_staleness}]."
            )
        return batch, staleness

    def generate_now(self, index: int, version: int, weights, prompts, seed):
        """A batch outside the schedule (a dynamic-sampling round), from the current weights."""
        self._send_weights(version, weights)
        self.worker.submit(index, prompts, seed)
        return self.worker.result(index), 0

    def _send_weights(self, version: int, weights):
        if self.sent_version is None or self.sent_version < version:
            self.worker.update_weights(version, weights())
            self.sent_version = version

    def close(self):
        self.worker.close()
