"""`ProcessRolloutWorker`: `transformers` generation in a separate process with its own copy of
the model, so that generation and training overlap on separate CPU cores (or a second GPU)."""

from __future__ import annotations

import copy
import queue
import sys
import traceback

import torch
import torch.multiprocessing as mp

from .async_rollout import GeneratedBatch
from .rollout import completion_mask_from_ids
from .transformers_engine import generate_with_transformers, seeded


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
