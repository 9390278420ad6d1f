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

`WeightPublisher` brings a vLLM engine's copy up to date: under LoRA it saves the adapter (a
folder per version) and has the engine load it as a new adapter, with no merge into the base
weights; in full fine-tuning it hands the engine all weights (colocated only). The process
engine's is `process_worker.ParameterPublisher`. `EngineWorker` runs an engine as the rollout
worker of the asynchronous pipeline (`async_rollout.RolloutPipeline`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from .transformers_engine import TransformersEngine


class Engine(Protocol):
    """What every sampler implements: `TransformersEngine` (in this process, with the trainer's
    weights), `ProcessEngine` (transformers in a process of its own), `VLLMColocateEngine` and
    `VLLMServerEngine`. `build_engine` and `build_rollout_engine` build them, each with the
    publisher that keeps its own copy of the weights current (`WeightPublisher`,
    `ParameterPublisher`: `publish(version)`, or `snapshot` on the trainer's thread and `load`
    on the worker's), or none for the transformers engine, which samples with the trainer's."""

    def generate(
        self, prompt_ids, prompt_mask, generation_config, seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(B, P)` left-padded prompts -> `(prompt_ids, prompt_mask, completion_ids,
        behaviour_logps)` of `B*G` rows (`behaviour_logps` None when the engine samples with
        the trainer's own weights); what follows each completion's end is cut by
        `rollout.CompletionEnds`."""
        ...

    def close(self) -> None: ...


class WeightPublisher:
    """Publishes the trainer's weights to an engine that holds its own copy.

    `publish(version)` does both halves at once; the asynchronous worker calls `snapshot` on the
    trainer's thread (so the weights cannot change under it) and `load` on its own.

    Versions are the trainer's global step, so one version always names the same weights. Under
    LoRA each version is an adapter folder; a folder is deleted once the engine has loaded a
    later version, never before: in asynchronous mode the trainer saves versions ahead of the
    engine. The first publication of a colocated engine under LoRA also hands it the base
    weights the trainer holds in memory (`base_weights`), which may differ from the checkpoint on
    disk the engine started from (a `revision`, resized embeddings, an earlier SFT step).

    Args:
        engine: a vLLM engine (`publish_adapter(folder, version)`, `load_weights(named)`).
        model (`Callable[[], nn.Module]`): returns the unwrapped model (a `PeftModel` under LoRA).
        is_adapter (`bool`): LoRA: publish the adapter only.
        folder (`str`, *optional*): where adapter versions are saved (a temporary folder when
            None, made at the first save and removed by `close`).
    """

    def __init__(self, engine, model, is_adapter: bool, folder: str | None = None):
        self.engine, self.model, self.is_adapter = engine, model, is_adapter
        self._temporary = folder is None
        self.folder = folder
        self.version: int | None = None  # the version the engine has
        self._lock = threading.Lock()  # `_folders` is shared by the trainer and the worker
        self._folders: dict[int, str] = {}  # version -> adapter folder still on disk
        # Only a colocated engine can take full weights; a server keeps its checkpoint's.
        self._base_pending = is_adapter and getattr(engine, "takes_base_weights", False)

    def publish(self, version: int) -> None:
        """Brings the engine to `version` now, on this thread. Full weights go to the engine
        straight from the model, without a copy."""
        if version == self.version:
            return
        if self.is_adapter:
            self.load(self.snapshot(version), version)
            return
        with gathered(self.model()) as model:
            self.engine.load_weights(named_weights(model))
        self.version = version

    def snapshot(self, version: int):
        """The weights of `version`, frozen: an adapter folder, or a copy of every tensor on the
        CPU (the trainer updates its own in place while the engine waits to load them)."""
        if not self.is_adapter:
            with gathered(self.model()) as model:
                return [(name, t.detach().to("cpu", copy=True)) for name, t in named_weights(model)]
        if self._base_pending:
            # Here, on the trainer's thread: a ZeRO-3 gather is a collective every process
            # makes in the same order, and the first snapshot comes before any generation.
            with gathered(self.model()) as model:
                self.engine.load_weights(base_weights(model))
            self._base_pending = False
        with self._lock:
            if version in self._folders:  # saved already (an evaluation, then the pipeline)
                return self._folders[version]
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="trl_grpo_ext-adapters-")
        path = os.path.join(self.folder, f"v{version}")
        with gathered(self.model(), adapter_only=True) as model:
            # A PeftModel saves the adapter only. Not resized embeddings, which PEFT would add
            # and vLLM refuses in an adapter: they reach the engine with the base weights.
            model.save_pretrained(path, save_embedding_layers=False)
        with self._lock:
            self._folders[version] = path
        return path

    def load(self, weights, version: int) -> None:
        if not self.is_adapter:
            self.engine.load_weights(weights)
            self.version = version
            return
        self.engine.publish_adapter(weights, version)
        self.version = version
        with self._lock:  # versions before this one are never loaded again
            done = [v for v in self._folders if v < version]
            paths = [self._folders.pop(v) for v in done]
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._temporary and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def named_weights(model):
    """`(name, tensor)` of every weight of a model, under the checkpoint's names. Under FSDP2 a
    parameter is a shard (`DTensor`): its full tensor is gathered one at a time."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def base_weights(peft_model):
    """The base model's weights of a `PeftModel`, under the checkpoint's names (no adapter
    tensors, `base_layer` names restored), as TRL hands them to vLLM."""
    prefix = f"{peft_model.prefix}" if hasattr(peft_model, "prefix") else "lora_"
    for name, tensor in named_weights(peft_model):
        if prefix in name or "original_module" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name.replace("modules_to_save.default.", ""), tensor


@contextlib.contextmanager
def gathered(model, adapter_only: bool = False):
    """`model` with its parameters whole for the block. Under DeepSpeed ZeRO-3 each process holds
    a shard of every parameter; they are gathered (the adapter only, with `adapter_only`) as TRL
    does before handing weights to vLLM. Elsewhere, the model as it is."""
    parameters = [
        p
        for p in model.parameters()
        if hasattr(p, "ds_id") and (p.requires_grad or not adapter_only)
    ]
    if not parameters:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parameters):
        yield model


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
        engine: samples (`generate(prompt_ids, prompt_mask, config, seed)`).
        publisher: loads weights into the engine (`snapshot`, `load`, `version`).
        generation_config: the sampling settings of the training batches.
        tool_loop (`multi_turn.ToolLoop`, *optional*): runs the batches submitted with tools.
    """

    def __init__(self, engine, publisher: WeightPublisher, generation_config, tool_loop=None):
        self.engine, self.publisher, self.generation_config = engine, publisher, generation_config
        self.tool_loop = tool_loop
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._futures: dict[int, Future] = {}
        self._failure: BaseException | None = None  # of a weight update

    def update_weights(self, version: int) -> None:
        self._raise_failure()
        snapshot = self.publisher.snapshot(version)  # now, on the trainer's thread
        self._thread.submit(self._load, snapshot, version)

    def _load(self, snapshot, version: int) -> None:
        if self._failure is not None:
            return
        try:
            self.publisher.load(snapshot, version)
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
        version = self.publisher.version  # no update runs on this thread until the batch is done
        if tools is None:
            tensors = self.engine.generate(*prompts, self.generation_config, seed)
            return GeneratedBatch(index, version, *tensors)
        turns = self.tool_loop.run(self.engine, self.generation_config, seed, *prompts, tools)
        return GeneratedBatch(index, version, *prompts, None, None, turns=turns)

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
    checkpointing = getattr(unwrapped, "is_gradient_checkpointing", False)
    with unwrap_model_for_generation(model_wrapped, accelerator, **options) as policy:
        with in_eval_mode(policy):
            yield policy
    if checkpointing and not takes_kwargs:
        unwrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


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
    for a model without adapters."""
    configs = getattr(peft_model, "peft_config", None)
    if not configs:
        return None
    return max(
        max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])
        for config in configs.values()
    )


def build_engine(
    args,
    policy,
    model,
    model_folder: EngineModel | str | None,
    lora_rank: int | None,
    tokenizer=None,
) -> tuple[Engine, WeightPublisher | None]:
    """The engine `args` asks for (`use_vllm`, `vllm_mode` and the `vllm_*` settings), and the
    publisher that keeps its weights current (None for one that samples with the trainer's own
    weights). The one place engines are built (with `build_rollout_engine`).

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
    if not args.use_vllm:
        engine = TransformersEngine(
            policy, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32, tokenizer=tokenizer
        )
        return engine, None
    engine = _vllm_engine(args, model_folder, lora_rank)
    return engine, WeightPublisher(engine, model, lora_rank is not None)


def build_rollout_engine(args, engine: Engine, publisher, model):
    """The engine of the asynchronous rollout worker (`max_staleness`) and its publisher: the
    engine itself when it holds its own weights (vLLM), else transformers in a process of its
    own (`ProcessEngine`) with a copy of the model, sent the trained parameters of each version.
    Returns `(engine, publisher, owned)`; `owned`: a new engine, closed with the worker."""
    if publisher is not None:
        return engine, publisher, False
    from .process_worker import ParameterPublisher, ProcessEngine

    unwrapped = model()
    if unwrapped.device.type != "cpu":
        warnings.warn(
            f"max_staleness is set and the model is on {unwrapped.device}: the local rollout "
            "worker generates with a copy of the model on the CPU, which is likely slower than "
            "synchronous generation on the accelerator. Unset max_staleness to generate there, or "
            "generate on a vLLM server (use_vllm=True, vllm_mode='server').",
            stacklevel=4,
        )
    process = ProcessEngine(unwrapped, threads=args.rollout_worker_threads)
    return process, ParameterPublisher(process, model), True


def _vllm_engine(args, model_folder, lora_rank):
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

    if not isinstance(model_folder, EngineModel):
        model_folder = EngineModel(str(model_folder))
    llm_kwargs = {}
    if model_folder.quantization:
        llm_kwargs["quantization"] = model_folder.quantization
    if model_folder.revision and not os.path.isdir(model_folder.folder):
        llm_kwargs["revision"] = model_folder.revision
    return VLLMColocateEngine(
        model_folder,  # the engine keeps it, so a temporary copy lives as long as the engine
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_len=args.vllm_max_model_length,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        max_lora_rank=lora_rank,
        seed=args.seed,
        process_index=args.process_index,
        local_process_index=args.local_process_index,
        world_size=args.world_size,
        remove_model_folder=model_folder.temporary,
        takes_base_weights=model_folder.quantization is None,
        llm_kwargs=llm_kwargs,
    )
