"""Generation engines behind one interface, and what keeps them on the trainer's weights.

An engine samples G completions for each of B left-padded prompts:

    engine.generate(prompt_ids, prompt_mask, generation_config, seed)
        -> (prompt_ids, prompt_mask, completion_ids, behaviour_logps)

of shapes `(B*G, P)`, `(B*G, P)`, `(B*G, T)` and `(B*G, T)`, groups in consecutive rows.
`generation_config` is the complete `GenerationConfig` of `sampling.sampling_config`.

- `TransformersEngine`: the policy's own `generate`, in this process. Its behaviour log-probs are
  None: the sampling policy is the trained one, whose log-probs the trainer computes exactly.
- `VLLMColocateEngine` (`vllm_colocate.py`) and `VLLMServerEngine` (`vllm_server.py`): vLLM
  in this process or behind an unmodified `vllm serve`. They hold their own copy of the weights
  and return the log-probs of the sampled tokens, which the trainer corrects for (TRL's
  `vllm_importance_sampling_*`).

`WeightPublisher` brings an engine's copy up to date: under LoRA it saves the adapter (a folder
per version) and has the engine load it as a new adapter, with no merge into the base weights;
in full fine-tuning it hands the engine all weights (colocated only). `EngineWorker` runs an
engine as the rollout worker of the asynchronous pipeline (`async_rollout.RolloutPipeline`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

from ..logprobs import float32_head
from ..rollout import generate_with_transformers, seeded


class TransformersEngine:
    """`generate` of the policy, in this process.

    Args:
        policy (`Callable[[], ContextManager]`): enters a block in which it yields the model to
            generate with (unwrapped from DDP, gathered under ZeRO-3, in eval mode).
        cast_lm_head_to_fp32 (`bool`): the output head computes the logits in float32
            (`logprobs.float32_head`), as TRL's `cast_lm_head_to_fp32` does for generation.
    """

    holds_own_weights = False

    def __init__(self, policy, cast_lm_head_to_fp32: bool = False):
        self.policy, self.cast_lm_head_to_fp32 = policy, cast_lm_head_to_fp32

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        with self.policy() as model, contextlib.ExitStack() as stack:
            if self.cast_lm_head_to_fp32:
                stack.enter_context(float32_head(model))
            with seeded(seed, model.device) if seed is not None else contextlib.nullcontext():
                prompt_ids, prompt_mask, completion_ids = generate_with_transformers(
                    model, prompt_ids, prompt_mask, generation_config=generation_config
                )
        return prompt_ids, prompt_mask, completion_ids, None

    def close(self):
        pass


class WeightPublisher:
    """Publishes the trainer's weights to an engine that holds its own copy.

    `publish(version)` does both halves at once; the asynchronous worker calls `snapshot` on the
    trainer's thread (so the weights cannot change under it) and `load` on its own.

    Args:
        engine: a vLLM engine (`publish_adapter(folder, version)`, `load_weights(named)`).
        model (`Callable[[], nn.Module]`): returns the unwrapped model (a `PeftModel` under LoRA).
        is_adapter (`bool`): LoRA: publish the adapter only.
        folder (`str`, *optional*): where adapter versions are saved (a temporary folder when
            None); only the latest two are kept.
    """

    def __init__(self, engine, model, is_adapter: bool, folder: str | None = None):
        self.engine, self.model, self.is_adapter = engine, model, is_adapter
        self._temporary = folder is None
        self.folder = folder or tempfile.mkdtemp(prefix="trl_grpo_ext-adapters-")
        self.version: int | None = None  # the version the engine has
        self._saved: list[str] = []

    def publish(self, version: int) -> None:
        if version != self.version:
            self.load(self.snapshot(version), version)

    def snapshot(self, version: int):
        """The weights of `version`, frozen: an adapter folder, or a copy of every tensor."""
        model = self.model()
        if not self.is_adapter:
            return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]
        path = os.path.join(self.folder, f"v{version}")
        model.save_pretrained(path)  # a PeftModel saves the adapter only
        self._saved.append(path)
        return path

    def load(self, weights, version: int) -> None:
        if self.is_adapter:
            self.engine.publish_adapter(weights, version)
            for old in self._saved[:-2]:  # the engine may still read the previous one
                shutil.rmtree(old, ignore_errors=True)
            self._saved = self._saved[-2:]
        else:
            self.engine.load_weights(weights)
        self.version = version

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.folder, ignore_errors=True)


class EngineWorker:
    """The asynchronous pipeline's rollout worker over an engine (a vLLM server, typically).

    One background thread handles weight updates and generation requests in the order they were
    sent, so a batch submitted after version v is generated with v or a later version, which is
    what `RolloutPipeline`'s staleness bound needs; the version a batch actually used is reported.
    """

    def __init__(self, engine, publisher: WeightPublisher, generation_config):
        self.engine, self.publisher, self.generation_config = engine, publisher, generation_config
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._futures: dict[int, Future] = {}

    def update_weights(self, version: int, weights=None) -> None:
        snapshot = self.publisher.snapshot(version)  # now, on the trainer's thread
        self._thread.submit(self.publisher.load, snapshot, version).add_done_callback(_raise)

    def submit(self, index: int, prompts, seed: int) -> None:
        self._futures[index] = self._thread.submit(self._generate, index, prompts, seed)

    def _generate(self, index, prompts, seed):
        from ..async_rollout import GeneratedBatch

        version = self.publisher.version
        tensors = self.engine.generate(*prompts, self.generation_config, seed)
        return GeneratedBatch(index, version, *tensors)

    def result(self, index: int):
        return self._futures.pop(index).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def _raise(future: Future) -> None:
    future.result()  # a failed weight update surfaces in the log at once, and again at result()


@contextlib.contextmanager
def in_eval_mode(model):
    """`model` in eval mode (no dropout) for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def policy_for_generation(
    model_wrapped,
    accelerator,
    gather_deepspeed3_params: bool = True,
    gradient_checkpointing_kwargs: dict | None = None,
):
    """The model to generate with: unwrapped from DDP (gathered under ZeRO-3), in eval mode.
    Gradient checkpointing is off for the block and back on after it with
    `gradient_checkpointing_kwargs` (the training arguments'): without them transformers'
    default (non-reentrant) would replace the trainer's setting after the first generation."""
    from trl.models import unwrap_model_for_generation

    with unwrap_model_for_generation(
        model_wrapped,
        accelerator,
        gather_deepspeed3_params=gather_deepspeed3_params,
        gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
    ) as policy:
        with in_eval_mode(policy):
            yield policy


def engine_model_folder(model, tokenizer) -> str:
    """A folder (or Hub id) from which vLLM can load `model`'s weights: where it came from, or a
    temporary folder it is saved to when it was built in memory. Call before adding adapters."""
    name = getattr(model.config, "_name_or_path", "") or ""
    if os.path.isdir(name) or (name and not name.startswith((".", "/")) and name.count("/") == 1):
        return name
    folder = tempfile.mkdtemp(prefix="trl_grpo_ext-base-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_engine(args, policy, model_folder: str | None, lora_rank: int | None):
    """The engine `args` asks for (`use_vllm`, `vllm_mode` and the `vllm_*` settings).

    Args:
        policy (`Callable[[], ContextManager]`): the trainer's model for generation, as
            `TransformersEngine` takes it.
        model_folder (`str`, *optional*): the base weights for a colocated vLLM engine
            (`engine_model_folder`).
        lora_rank (`int`, *optional*): the adapters' rank under LoRA (vLLM reserves room for
            adapters of that rank); None for full fine-tuning.
    """
    if not args.use_vllm:
        return TransformersEngine(policy, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
    if args.vllm_mode == "server":
        if lora_rank is None:
            raise ValueError(
                "vllm_mode='server' publishes new weights to the server as LoRA adapters; full "
                "fine-tuning cannot be served that way. Pass a peft_config (LoRA), or use "
                "vllm_mode='colocate'."
            )
        from .vllm_server import VLLMServerEngine

        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        # Each training process publishes its own adapter versions (the same weights under DDP)
        # under its own names, so processes never load or unload each other's.
        prefix = "adapter" if args.world_size == 1 else f"adapter-p{args.process_index}"
        engine = VLLMServerEngine(url, timeout=args.vllm_server_timeout, adapter_prefix=prefix)
        engine.wait_until_ready()
        return engine
    from .vllm_colocate import VLLMColocateEngine

    return VLLMColocateEngine(
        model_folder,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_len=args.vllm_max_model_length,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        max_lora_rank=lora_rank,
        seed=args.seed,
    )
