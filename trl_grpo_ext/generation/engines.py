"""Generation engines behind one interface (`Engine`), built in one place (`build_engine`,
`build_rollout_engine`), and what keeps them on the trainer's weights.

An engine samples G completions for each of B left-padded prompts:

    engine.generate(prompt_ids, prompt_mask, generation_config, seed)
        -> (prompt_ids, prompt_mask, completion_ids, behaviour_logps)

of shapes `(B*G, P)`, `(B*G, P)`, `(B*G, T)` and `(B*G, T)`, groups in consecutive rows.
`generation_config` is the complete `GenerationConfig` of `sampling.sampling_config`. Where each
completion ends (eos, stop strings) is decided afterwards, by one rule for every engine
(`rollout.CompletionEnds`).

- `TransformersEngine` (`transformers_engine.py`): the policy's own `generate`, in this
  process. Its behaviour log-probs are None: the sampling policy is the trained one, whose
  log-probs the trainer computes exactly.
- `VLLMColocateEngine` (`vllm_colocate.py`) and `VLLMServerEngine` (`vllm_server.py`): vLLM
  in this process or behind an unmodified `vllm serve`. They hold their own copy of the weights
  and return the log-probs of the sampled tokens, which the trainer corrects for (TRL's
  `vllm_importance_sampling_*`).
- `ProcessEngine` (`process_worker.py`): transformers in a process of its own with its own copy
  of the model, the asynchronous worker without vLLM; it returns the sampled tokens' log-probs.

Each engine also keeps its weights on the trainer's (`publish`): the transformers engine has
nothing to do; the others have their own copy (`weights.OwnWeights`), which `WeightPublisher`
(vLLM: the adapter of each version, or all weights) or `process_worker.ParameterPublisher` keeps
current. `EngineWorker` runs an engine as the rollout worker of the asynchronous pipeline
(`async_rollout.RolloutPipeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .requests import run_request
from .transformers_engine import TransformersEngine
from .weights import WeightPublisher

if TYPE_CHECKING:
    from .settings import EngineSettings


class Engine(Protocol):
    """What every sampler implements: `TransformersEngine` (in this process, with the trainer's
    weights), `ProcessEngine` (transformers in a process of its own), `VLLMColocateEngine` and
    `VLLMServerEngine`; `build_engine` and `build_rollout_engine` build them.

    Attributes:
        own_weights (`bool`): the engine samples from its own copy of the weights, which
            `publish` keeps on the trainer's, and takes a seed of its own; False for the
            transformers engine, which samples with the trainer's model in this process.
        version (`int`, *optional*): the trainer's version (global step) of the weights the
            engine has; None before the first publication, and always for the transformers engine.
    """

    own_weights: bool
    version: int | None

    def generate(
        self,
        prompt_ids,
        prompt_mask,
        generation_config,
        seed: int | None = None,
        image_inputs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(B, P)` left-padded prompts -> `(prompt_ids, prompt_mask, completion_ids,
        behaviour_logps)` of `B*G` rows (`behaviour_logps` None when the engine samples with
        the trainer's own weights); what follows each completion's end is cut by
        `rollout.CompletionEnds`. `image_inputs`: the processor's multimodal fields of the
        prompts (`images.py`); only the transformers engine takes them so far, the others
        refuse them (`images.refuse_images`) rather than sample from the text alone."""
        ...

    def publish(self, version: int) -> None:
        """Brings the engine's weights (an adapter under LoRA) to the trainer's of `version`,
        now, on this thread."""
        ...

    def publish_later(self, version: int) -> Callable[[], None]:
        """Reads the trainer's weights of `version` now, on this thread (where training cannot
        change them meanwhile), and returns the step that loads them into the engine, to run on
        the thread that samples (the asynchronous worker's)."""
        ...

    def close(self) -> None:
        """Frees the engine, and the adapter versions it was published."""
        ...


class EngineWorker:
    """The asynchronous pipeline's rollout worker over an engine (a vLLM server, typically).

    One background thread handles weight updates and generation requests in the order they were
    sent, so a batch submitted after version v is generated with v or a later version, which is
    what `RolloutPipeline`'s staleness bound needs; the version a batch actually used is reported.

    A weight update that fails (the server refuses the adapter, or is gone) stops the worker: no
    later batch is generated with the older weights, and the update's own error is raised by
    the next `update_weights` or `result`, so the trainer stops with its cause.

    A multi-turn batch (submitted with `tools`) runs its whole `tool_loop` on the thread: every
    turn and tool call of its rollouts happens before the next queued weight update, so all its
    turns are sampled with the version read when it starts, the one reported.

    Args:
        engine (`Engine`): an engine with its own weights (`own_weights`).
        generation_config: the sampling settings of the training batches.
        tool_loop (`multi_turn.ToolLoop`, *optional*): runs the batches submitted with tools.
    """

    def __init__(self, engine: Engine, generation_config, tool_loop=None):
        self.engine, self.generation_config = engine, generation_config
        self.tool_loop = tool_loop
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._futures: dict[int, Future] = {}
        self._failure: BaseException | None = None  # of a weight update

    def update_weights(self, version: int) -> None:
        self._raise_failure()
        load = self.engine.publish_later(version)  # reads the weights now, on the trainer's thread
        self._thread.submit(self._load, load)

    def _load(self, load: Callable[[], None]) -> None:
        if self._failure is not None:
            return
        try:
            load()
        except BaseException as error:  # noqa: BLE001 - raised on the trainer's thread
            self._failure = error

    def submit(self, index: int, prompts, seed: int, tools=None) -> None:
        self._raise_failure()
        if tools is not None and self.tool_loop is None:
            raise ValueError("A batch with tools was submitted to a worker without a tool loop.")
        self._futures[index] = self._thread.submit(self._generate, index, prompts, seed, tools)

    def _generate(self, index, prompts, seed, tools=None):
        from .async_rollout import GeneratedBatch

        self._raise_failure()
        version = self.engine.version  # no update runs on this thread until the batch is done
        generated = run_request(
            self.engine, self.generation_config, seed, prompts, tools, self.tool_loop
        )
        return GeneratedBatch(index, version, *generated)

    def result(self, index: int):
        return self._futures.pop(index).result()

    def call(self, function):
        """`function()` run on the worker's thread, after everything submitted before it (so
        never alongside a generation), and its result. How evaluations reach the engine while
        the worker owns it."""
        self._raise_failure()
        return self._thread.submit(function).result()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


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

    options = {"gather_deepspeed3_params": gather_deepspeed3_params}
    # Older TRL releases (1.7 among them) take no such argument and turn checkpointing back on
    # with transformers' default: it is turned on again here, with the arguments' setting.
    takes_kwargs = "gradient_checkpointing_kwargs" in (
        inspect.signature(unwrap_model_for_generation).parameters
    )
    if takes_kwargs:
        options["gradient_checkpointing_kwargs"] = gradient_checkpointing_kwargs
    unwrapped = accelerator.unwrap_model(model_wrapped)
    checkpointing = gradient_checkpointing_on(unwrapped)
    with contextlib.ExitStack() as stack:
        with without_checkpointing_alias_warning():  # TRL 1.16 reads the alias on entering
            policy = stack.enter_context(
                unwrap_model_for_generation(model_wrapped, accelerator, **options)
            )
        with in_eval_mode(policy):
            yield policy
    if checkpointing and not takes_kwargs:
        unwrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


@contextlib.contextmanager
def without_checkpointing_alias_warning():
    """Hides transformers' FutureWarning (5.25 and later) that `is_gradient_checkpointing` is
    deprecated, inside a call of TRL's or PEFT's that reads it (TRL 1.16's
    `unwrap_model_for_generation`, PEFT 0.18's `PeftModel`): the user can change nothing
    about it. Our own code reads `gradient_checkpointing_on`."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        yield


def gradient_checkpointing_on(model) -> bool:
    """Whether `model` checkpoints activations: `is_activation_checkpointing` (transformers
    5.25 and later), else the older `is_gradient_checkpointing`, which 5.25 deprecates."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(on if on is not None else getattr(model, "is_gradient_checkpointing", False))


# Config fields that fix the shapes of a checkpoint's tensors: where the model in memory differs
# from its checkpoint in one (resized embeddings, say), the engine cannot start from that checkpoint.
_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


@dataclass
class EngineModel:
    """Where a colocated vLLM engine loads its model from, and how.

    Attributes:
        folder (`str`): a folder or Hub id with the model's config, tokenizer and weights.
        temporary (`bool`): a copy saved for the engine, removed when the engine is closed, and
            in any case once nothing refers to it any more (an engine that failed to start, a
            trainer never closed) or when the process exits.
        quantization (`str`, *optional*): vLLM's `quantization` for a model loaded quantized
            (bitsandbytes 4-bit, as TRL passes it); the engine quantizes the checkpoint itself.
        revision (`str`, *optional*): the checkpoint's revision on the Hub.
    """

    folder: str
    temporary: bool = False
    quantization: str | None = None
    revision: str | None = None

    def __post_init__(self):
        if self.temporary:
            weakref.finalize(self, shutil.rmtree, self.folder, True)

    def __fspath__(self) -> str:
        return self.folder

    def __str__(self) -> str:
        return self.folder


def engine_model_folder(model, tokenizer) -> EngineModel:
    """Where a colocated vLLM engine can load `model` from: the folder or Hub id it came from
    when its tensors there have the shapes of the ones in memory, else a temporary copy saved
    for the engine. Call before adding adapters.

    The engine starts from these weights; the trainer then hands it the ones in memory on its
    first publication (`WeightPublisher`), so a model changed in memory since it was loaded
    samples with its own weights.
    """
    quantization = _vllm_quantization(model)
    name = getattr(model.config, "_name_or_path", "") or ""
    revision = getattr(model.config, "_commit_hash", None)
    is_hub_id = name and not name.startswith((".", "/")) and name.count("/") == 1
    if (os.path.isdir(name) or is_hub_id) and _same_shapes(name, model):
        return EngineModel(name, quantization=quantization, revision=revision)
    if quantization is not None:
        raise ValueError(
            f"The quantized model's config differs from its checkpoint {name!r} (or it has "
            "none): a colocated vLLM engine quantizes the checkpoint itself and cannot start from "
            "a changed quantized model. Save the model in full precision and load it from there, "
            "or generate with use_vllm=False."
        )
    folder = tempfile.mkdtemp(prefix="trl_grpo_ext-base-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return EngineModel(folder, temporary=True)


def _same_shapes(name: str, model) -> bool:
    from transformers import AutoConfig

    try:
        saved = AutoConfig.from_pretrained(name).to_dict()
    except (OSError, ValueError):
        return False
    ours = model.config.to_dict()
    return all(saved.get(field) == ours.get(field) for field in _SHAPE_FIELDS)


def _vllm_quantization(model) -> str | None:
    """vLLM's name for the quantization `model` was loaded with (None when it is not)."""
    if not getattr(model, "is_quantized", False):
        return None
    config = getattr(model.config, "quantization_config", None) or {}
    method = config.get("quant_method") if isinstance(config, dict) else config.quant_method
    method = str(getattr(method, "value", method) or "")
    if method == "bitsandbytes" and getattr(model, "is_loaded_in_4bit", False):
        return "bitsandbytes"
    raise ValueError(
        f"A colocated vLLM engine cannot sample from a model quantized with {method or 'this'} "
        "method here (vLLM quantizes in flight with bitsandbytes 4-bit only). Load the model "
        "with load_in_4bit, or unquantized, or generate with use_vllm=False."
    )


def lora_rank(peft_model) -> int | None:
    """The largest LoRA rank of a `PeftModel`'s adapters, counting each `rank_pattern`; None
    for a model without LoRA adapters (none, or only prompt learning's virtual tokens, which
    have no rank)."""
    configs = getattr(peft_model, "peft_config", None) or {}
    ranks = [
        max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])
        for config in configs.values()
        if getattr(config, "r", None) is not None
    ]
    return max(ranks, default=None)


def build_engine(
    settings: EngineSettings,
    policy,
    model,
    model_folder: EngineModel | str | None,
    lora_rank: int | None,
    tokenizer=None,
) -> Engine:
    """The engine `settings` ask for (`EngineSettings`: transformers, vLLM colocated or a vLLM
    server), with what keeps its weights current. The one place engines are built (with
    `build_rollout_engine`).

    Args:
        policy (`Callable[[], ContextManager]`): the trainer's model for generation, as
            `TransformersEngine` takes it.
        model (`Callable[[], nn.Module]`): the unwrapped model being trained, whose weights a
            publisher sends.
        model_folder (`EngineModel` or `str`, *optional*): the base model of a colocated vLLM
            engine (`engine_model_folder`).
        lora_rank (`int`, *optional*): the adapters' largest rank under LoRA (vLLM reserves room
            for adapters of that rank); None for full fine-tuning.
        tokenizer (*optional*): lets the transformers engine stop at stop strings.
    """
    if not settings.use_vllm:
        return TransformersEngine(
            policy,
            cast_lm_head_to_fp32=settings.cast_lm_head_to_fp32,
            tokenizer=tokenizer,
            merge_adapters=settings.sample_with_merged_adapters,
        )
    engine = _vllm_engine(settings, model_folder, lora_rank)
    engine.publisher = WeightPublisher(engine, model, lora_rank is not None)
    return engine


def build_rollout_engine(settings: EngineSettings, engine: Engine, model) -> tuple[Engine, bool]:
    """The engine of the asynchronous rollout worker (`max_staleness`): the engine itself when it
    has its own weights (vLLM), else transformers in a process of its own (`ProcessEngine`)
    with a copy of the model on the CPU, sent the trained parameters of each version. A model
    on an accelerator is never copied to the CPU: without vLLM that is an error naming the
    settings that work. Returns `(engine, owned)`; `owned`: a new engine, closed with the
    worker."""
    if engine.own_weights:
        return engine, False
    from .process_worker import ParameterPublisher, ProcessEngine

    unwrapped = model()
    if unwrapped.device.type != "cpu":
        raise ValueError(
            f"max_staleness >= 1 samples ahead of training, and the model is on "
            f"{unwrapped.device}: without a vLLM engine that would need a copy of the model on the "
            "CPU, far slower than sampling on the accelerator. Sample with vLLM (use_vllm=True, "
            "vllm_mode='server' or 'colocate'), or set max_staleness=0 (or leave it unset) to "
            "sample on the model's device between optimizer steps."
        )
    process = ProcessEngine(
        unwrapped, settings.rollout_worker_threads, settings.sample_with_merged_adapters
    )
    process.publisher = ParameterPublisher(process, model)
    return process, True


def _vllm_engine(settings: EngineSettings, model_folder, lora_rank):
    if settings.server_url is not None:
        if lora_rank is None:
            raise ValueError(
                "vllm_mode='server' publishes new weights to the server as LoRA adapters; full "
                "fine-tuning cannot be served that way. Pass a peft_config (LoRA), or use "
                "vllm_mode='colocate'."
            )
        from .vllm_server import VLLMServerEngine

        # Each training process publishes its own adapter versions (the same weights under DDP)
        # under its own names, so processes never load or unload each other's.
        engine = VLLMServerEngine(
            settings.server_url,
            timeout=settings.server_timeout,
            adapter_prefix=settings.adapter_prefix,
        )
        engine.wait_until_ready()
        return engine
    from .vllm_colocate import VLLMColocateEngine

    if not isinstance(model_folder, EngineModel):
        model_folder = EngineModel(str(model_folder))
    # the engine keeps the folder, so a temporary copy lives as long as the engine
    colocate = dataclasses.replace(settings.colocate, max_lora_rank=lora_rank)
    return VLLMColocateEngine(model_folder, colocate)


def max_model_len(settings, model, engine) -> int:
    """The longest sequence the engine takes: the smaller of a vLLM server's own
    `--max-model-len` (which the trainer's settings cannot change) and `vllm_max_model_length`
    (`settings.max_model_len`) when either is known, else the model's position limit."""
    limits = [getattr(engine, "max_model_len", None), settings.max_model_len]
    limits = [limit for limit in limits if limit]
    if limits:
        return min(limits)
    config = getattr(model.config, "text_config", None) or model.config
    return getattr(config, "max_position_embeddings", None) or 2**31
