"""`ProcessEngine`: `transformers` generation in a separate process with its own copy of the
model, so that generation and training overlap on separate CPU cores (or a second GPU).

It is an engine like the others (`engines.py`): `generate` samples one batch in the process and
returns the log-probs of the sampled tokens from the sampling pass's own logits (as a vLLM engine
reports them); `load_weights` sends it new weights. `ParameterPublisher` keeps it on the trainer's
weights: the trained parameters (the adapter's under LoRA), copied to the CPU when a version is
snapshotted. The asynchronous pipeline runs it through `engines.EngineWorker`, as it runs a vLLM
engine.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import sys
import threading
import traceback

import torch
import torch.multiprocessing as mp

from ..internals import usable
from .merged_adapters import merged_for_sampling
from .transformers_engine import generate_with_transformers, seeded
from .weights import OwnWeights


def sample_batch(
    model, prompts, generation_config, seed, image_inputs=None, merge_adapters="exact"
):
    """Samples one generation batch and the behaviour log-probs of its tokens (from the
    sampling pass's own logits, as a server backend such as vLLM reports them), with the LoRA
    adapters merged as `merge_adapters` says (`TransformersEngine`'s argument)."""
    seeding = seeded(seed, model.device) if seed is not None else contextlib.nullcontext()
    with merged_for_sampling(model, merge_adapters, log_reason=False), seeding:
        return generate_with_transformers(
            model,
            *prompts,
            generation_config=generation_config,
            return_logprobs=True,
            image_inputs=image_inputs,
        )


# The forward hooks of training that a spawned worker could not unpickle (local functions) and
# sampling does not need: those of `enable_input_require_grads` (transformers', and PEFT's own
# where a model lacks it; gradient checkpointing installs one per call) and those with which
# transformers captures hidden states (installed again in the worker when a forward asks).
_TRAINING_HOOKS = frozenset(
    {"make_inputs_require_grads", "make_inputs_require_grad", "output_capturing_hook"}
)


def _worker_copy(model):
    """`model` copied to the CPU for the worker, without `_TRAINING_HOOKS`."""
    worker_model = copy.deepcopy(model).cpu()
    for module in worker_model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for key, hook in list(hooks.items()):
                if getattr(hook, "__name__", "") in _TRAINING_HOOKS:
                    del hooks[key]
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False  # installed again where asked
    return worker_model


def _register_output_capture(model) -> None:
    """Registers, in a spawned worker, what each model class's hidden states capture records
    (transformers records it when a model is built, which unpickling skips; without it, a
    vision-language model's image features find no hidden states)."""
    from transformers import PreTrainedModel

    if not usable("worker_output_capture"):  # a transformers it is not tested on
        return
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    # keyed by the class's name in every version (5.24 wraps the dict to take the model)
    for module in model.modules():
        key = str(type(module))
        if isinstance(module, PreTrainedModel) and dict.get(_CAN_RECORD_REGISTRY, key) is None:
            dict.__setitem__(_CAN_RECORD_REGISTRY, key, module._can_record_outputs)


def _worker_main(model, threads, requests, results, merge_adapters="exact"):
    torch.set_num_threads(threads)
    _register_output_capture(model)
    model.eval()
    parameters = dict(model.named_parameters())
    while True:
        message = requests.get()
        if message[0] == "stop":
            return
        if message[0] == "weights":
            _, weights = message
            with torch.no_grad():
                for name, value in weights.items():
                    parameters[name].copy_(value)
            continue
        _, prompts, generation_config, seed, image_inputs = message
        try:
            batch = sample_batch(
                model, prompts, generation_config, seed, image_inputs, merge_adapters
            )
            results.put(batch)
        except Exception:  # noqa: BLE001 - sent to the trainer, which raises it
            results.put(traceback.format_exc())


class ProcessEngine(OwnWeights):
    """`transformers` generation in a separate process, with its own copy of the model (on the
    CPU). Requests are handled in the order they are sent. Its `publisher` is a
    `ParameterPublisher`.

    Args:
        model (`nn.Module`): copied (to the CPU) when the engine starts; a `PeftModel` under LoRA.
        threads (`int`, *optional*, defaults to 1): CPU threads of the process
            (`rollout_worker_threads`).
        merge_adapters (`str`, *optional*, defaults to `"exact"`): LoRA adapters merged while
            sampling, as `TransformersEngine` takes it (`sample_with_merged_adapters`).
    """

    takes_images = True  # `generate` takes the processor's multimodal fields

    def __init__(self, model, threads: int = 1, merge_adapters: str = "exact"):
        # fork needs no importable __main__ and shares the copied model without pickling. Neither
        # CUDA nor the parent's OpenMP thread pool survives a fork (a forked worker with more than
        # one thread hangs in its first parallel region), so a process that initialised CUDA, or
        # a worker with several threads, spawns instead (which needs the usual
        # `if __name__ == "__main__":` guard in the user's script).
        use_fork = sys.platform == "linux" and not torch.cuda.is_initialized() and threads == 1
        context = mp.get_context("fork" if use_fork else "spawn")
        self._requests, self._results = context.Queue(), context.Queue()
        worker_model = _worker_copy(model)
        self._process = context.Process(
            target=_worker_main,
            args=(worker_model, threads, self._requests, self._results, merge_adapters),
            daemon=True,
        )
        self._process.start()
        self._lock = threading.Lock()  # one request in flight: results come back in order
        self._threads_before = None
        if model.device.type == "cpu":
            # Generation and training overlap only if they do not fight over the cores.
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads_before - threads))

    def load_weights(self, named_tensors) -> None:
        """Replaces the process's parameters of these names (the tensors are sent as they are:
        copies that nothing changes later, as `ParameterPublisher.snapshot` makes)."""
        self._requests.put(("weights", dict(named_tensors)))

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None, image_inputs=None):
        """Samples in the process with the weights loaded last.

        Returns:
            `(prompt_ids, prompt_mask, completion_ids, logps)`, as
            `generate_with_transformers(..., return_logprobs=True)`, with the log-probs 0 after
            each completion's end. `image_inputs` are the prompts' multimodal fields, as the
            processor returned them.
        """
        request = ("generate", (prompt_ids, prompt_mask), generation_config, seed, image_inputs)
        with self._lock:
            self._requests.put(request)
            while True:
                try:
                    payload = self._results.get(timeout=5)
                    break
                except queue.Empty:
                    if not self._process.is_alive():
                        raise RuntimeError(
                            f"The rollout worker died (exit code {self._process.exitcode})."
                        ) from None
        if isinstance(payload, str):
            raise RuntimeError(f"The rollout worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        """Stops the process, closes the queues' pipes and ends the thread that feeds the
        requests' pipe, and gives the trainer back the CPU threads it had."""
        self.close_publisher()
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._process.is_alive():
            self._requests.put(("stop",))
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout=10)
        for channel in (self._requests, self._results):
            # With the process gone, nothing reads the pipe: what is left to write fails at
            # once and the feeder ends. One that outlived SIGTERM might hold it: not waited on.
            if self._process.is_alive():
                channel.cancel_join_thread()
            channel.close()
            channel.join_thread()


class ParameterPublisher:
    """Publishes the trained parameters (those with `requires_grad`: the adapter's under LoRA) to
    a `ProcessEngine`, with the interface of `weights.WeightPublisher`: `snapshot` copies them to
    the CPU on the trainer's thread, `load` sends that copy to the engine.

    Args:
        engine (`ProcessEngine`): the engine to keep current.
        model (`Callable[[], nn.Module]`): returns the unwrapped model being trained.
    """

    def __init__(self, engine, model):
        self.engine, self.model = engine, model
        self.version: int | None = None  # the version the engine has

    def publish(self, version: int) -> None:
        if version != self.version:
            self.load(self.snapshot(version), version)

    def snapshot(self, version: int) -> dict:
        return {
            name: parameter.detach().cpu().clone()
            for name, parameter in self.model().named_parameters()
            if parameter.requires_grad
        }

    def load(self, weights, version: int) -> None:
        self.engine.load_weights(weights)
        self.version = version

    def close(self) -> None:
        pass
