"""A `vllm.LLM` in the training process: the colocated generation engine.

`VLLMColocateEngine.generate` takes the left-padded prompts and the `GenerationConfig` of
`generation.sampling_config` and returns the tensors of `generate_with_transformers(...,
return_logprobs=True)`. New weights reach the engine as a LoRA adapter version
(`publish_adapter`, a `LoRARequest` per version, the base weights never merged) or, under full
fine-tuning, as named tensors (`load_weights`).

vLLM in the training process changes process-wide state: building the engine seeds the global
random generators, and in-process mode (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) its CPU worker
replaces `torch.set_num_threads` with a no-op and starts a one-process `torch.distributed`
group. The engine restores the random generators and `torch.set_num_threads` after start-up;
the process group stays (vLLM uses it), with world size 1.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from .images import refuse_images
from .vllm_sampling import prompt_seeds, sampling_params, to_tensors, unpadded_prompts
from .weights import OwnWeights

# vLLM's `LoRAConfig.max_lora_rank` takes only these values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def supported_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds adapters of rank `rank`."""
    for supported in VLLM_LORA_RANKS:
        if supported >= rank:
            return supported
    raise ValueError(
        f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}): "
        f"lower lora_r (and any rank_pattern) to {VLLM_LORA_RANKS[-1]} or less, or generate "
        "with use_vllm=False."
    )


def check_cpu_head_size(model) -> None:
    """Fails before vLLM starts when its CPU attention has no kernel for `model`'s head size
    (vLLM's own error comes from deep inside the first forward pass)."""
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(str(model))
    config = getattr(config, "text_config", None) or config
    head_size = (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"vLLM's CPU build has no attention kernel for head size {head_size} (hidden_size "
            f"{config.hidden_size} / {config.num_attention_heads} heads of {model}); it supports "
            f"{supported}. Use a model with one of these head sizes (the recipes' embedded tiny "
            "model: --tiny_num_attention_heads 2, heads of 32), or generate with use_vllm=False."
        )


def _distributed_settings(process_index: int, local_process_index: int, world_size: int) -> dict:
    """What vLLM needs to build one engine per training process, as TRL does: the process's own
    rank and device, over the launcher's (`accelerate launch`, torchrun) process group."""
    from trl.trainer.utils import ensure_master_addr_port

    os.environ["RANK"] = str(process_index)
    os.environ["LOCAL_RANK"] = str(local_process_index)
    os.environ["WORLD_SIZE"] = str(world_size)
    ensure_master_addr_port()
    return dict(distributed_executor_backend="external_launcher")


@contextlib.contextmanager
def _process_state_kept():
    """Restores the random generators, `torch.set_num_threads` and the thread count that
    starting vLLM changes."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


_PRIVATE_FOLDER: list[str] = []  # this process's, once made


def private_folder() -> str:
    """A folder for what this process's vLLM engines leave in the temp folder, removed when the
    process exits.

    vLLM's front end and engine core talk over IPC sockets in `VLLM_RPC_BASE_PATH` (the temp
    folder by default), and an in-process engine keeps its rendezvous file (`vllm_dist_*`) there
    until vLLM shuts down; vLLM removes neither. So the sockets go here, unless the user chose a
    folder for them, and so does the rendezvous file (`in_private_folder`). One folder for the
    whole process: vLLM caches `VLLM_RPC_BASE_PATH` once an engine has started."""
    if not _PRIVATE_FOLDER:
        folder = tempfile.mkdtemp(prefix="vllm-engine-")
        atexit.register(shutil.rmtree, folder, True)
        _PRIVATE_FOLDER.append(folder)
        os.environ.setdefault("VLLM_RPC_BASE_PATH", folder)
    return _PRIVATE_FOLDER[0]


@contextlib.contextmanager
def in_private_folder():
    """Python's temp files of the block (vLLM's rendezvous file) in `private_folder()`."""
    folder, before = private_folder(), tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = before


def checkpoint_dtype(model) -> str:
    """The dtype the checkpoint's config names (float32 when it names none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype else "float32"


@dataclass(frozen=True)
class ColocateSettings:
    """How a colocated vLLM engine is built: the config's `vllm_*` settings and this process's
    place among the training processes, read once (`from_config`).

    Attributes:
        gpu_memory_utilization (`float`):
            Fraction of the GPU's memory vLLM may take for weights and KV cache (TRL's
            `vllm_gpu_memory_utilization`); the trainer keeps the rest. Unused on CPU, where
            `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the cache.
        max_model_len (`int`, *optional*):
            Longest prompt plus completion (TRL's `vllm_max_model_length`); the checkpoint's
            limit when None.
        tensor_parallel_size (`int`):
            GPUs the engine spreads the model over.
        enable_sleep_mode (`bool`):
            GPU only: release the engine's memory between generations (`sleep`/`wake_up`).
        max_lora_rank (`int`, *optional*):
            Serve LoRA adapters up to this rank (`publish_adapter`); None for full fine-tuning.
        dtype (`str`, *optional*):
            The engine's weights dtype; the checkpoint's own (`torch_dtype` in its config) when
            None, as `from_pretrained` loads it. (vLLM's "auto" turns float32 into bfloat16 on
            CPU, where the log-probs then differ from the trainer's by up to 0.1.)
        seed (`int`):
            The engine's seed (each `generate` call takes its own seed too).
        process_index, local_process_index, world_size (`int`):
            This training process among `world_size` (Accelerate's). With several processes each
            builds its own engine on its own device, as TRL does: vLLM's `external_launcher`
            backend, over the process group the trainer already has.
        llm_kwargs (`dict`):
            Further `vllm.LLM` arguments, over the ones above.
    """

    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    max_lora_rank: int | None = None
    dtype: str | None = None
    seed: int = 0
    process_index: int = 0
    local_process_index: int = 0
    world_size: int = 1
    llm_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, args, lora_rank: int | None) -> ColocateSettings:
        """The settings of `args` (a `GroupRelativeConfig`); `lora_rank`: the adapters' largest
        rank under LoRA (`engines.lora_rank`), None for full fine-tuning."""
        return cls(
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_length,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            max_lora_rank=lora_rank,
            seed=args.seed,
            process_index=args.process_index,
            local_process_index=args.local_process_index,
            world_size=args.world_size,
        )


class VLLMColocateEngine(OwnWeights):
    """Generation with a `vllm.LLM` living in this process.

    Args:
        model (`str` or `EngineModel`):
            Folder (or hub id) of the model the trainer starts from; vLLM loads it itself. The
            engine keeps a reference to it, so a temporary copy lives as long as the engine,
            and `close` removes it. An `EngineModel` also says how the model was loaded: a
            quantized one is quantized by vLLM itself (and `load_weights` never replaces its
            base weights), a Hub id is loaded at its revision.
        settings (`ColocateSettings`, *optional*): how the engine is built; the defaults when
            None.
    """

    def __init__(self, model, settings: ColocateSettings | None = None):
        settings = settings or ColocateSettings()
        self.model = model  # a temporary `EngineModel` is removed once nothing refers to it
        if getattr(model, "temporary", False):  # even when the engine fails to start
            self._remove_folder = weakref.finalize(self, shutil.rmtree, str(model), True)
        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu:
            check_cpu_head_size(model)
        if settings.enable_sleep_mode and on_cpu:
            raise ValueError(
                "vllm_enable_sleep_mode needs a GPU; vLLM's CPU build has no sleep mode. "
                "Set vllm_enable_sleep_mode=False."
            )
        llm_settings = dict(
            model=str(model),
            tensor_parallel_size=settings.tensor_parallel_size,
            max_model_len=settings.max_model_len,
            enable_sleep_mode=settings.enable_sleep_mode,
            seed=settings.seed,
            # log-probs after temperature and filters: see vllm_sampling
            logprobs_mode="processed_logprobs",
            # sampling settings come from the trainer's config, never the checkpoint's
            generation_config="vllm",
            enforce_eager=on_cpu,
            dtype=settings.dtype or checkpoint_dtype(model),
        )
        if not on_cpu:
            llm_settings["gpu_memory_utilization"] = settings.gpu_memory_utilization
        max_lora_rank = settings.max_lora_rank
        if max_lora_rank is not None:
            max_lora_rank = supported_lora_rank(max_lora_rank)
            llm_settings.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if settings.world_size > 1:
            llm_settings.update(
                _distributed_settings(
                    settings.process_index, settings.local_process_index, settings.world_size
                )
            )
        quantization = getattr(model, "quantization", None)
        if quantization:  # vLLM quantizes the checkpoint itself
            llm_settings["quantization"] = quantization
        revision = getattr(model, "revision", None)
        if revision and not os.path.isdir(str(model)):
            llm_settings["revision"] = revision
        llm_settings.update(settings.llm_kwargs)
        with _process_state_kept(), in_private_folder():
            self.llm = LLM(**llm_settings)
        self.max_lora_rank = max_lora_rank
        # `load_weights` may replace the base weights under LoRA, unless vLLM quantized them
        self.takes_base_weights = quantization is None
        self.enable_sleep_mode = settings.enable_sleep_mode
        self.adapter = None  # the LoRARequest of the latest published version
        self.adapter_version = None
        self._adapter_ids = 0
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None, image_inputs=None):
        """Samples `num_return_sequences` completions per prompt with the latest weights.

        Args:
            prompt_ids, prompt_mask (`torch.Tensor`): left-padded prompts `(B, P)`.
            generation_config (`transformers.GenerationConfig`): from `generation.sampling_config`.
            seed (`int`, *optional*): the same seed gives the same completions.

        Returns:
            `(prompt_ids, prompt_mask, completion_ids, logps)`, as
            `generate_with_transformers(..., return_logprobs=True)`.
        """
        refuse_images(self, image_inputs)
        group_size = generation_config.num_return_sequences or 1
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        params = [
            sampling_params(generation_config, prompt_seed)
            for prompt_seed in prompt_seeds(seed, len(prompts), group_size)
        ]
        if self.enable_sleep_mode:
            torch.cuda.empty_cache()  # the trainer's cached blocks, for the engine to wake into
            self.llm.wake_up()
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": ids} for ids in prompts],
                sampling_params=params,
                lora_request=self.adapter,
                use_tqdm=False,
            )
        except BaseException:
            # The failed call's requests stay queued in the engine, and the next `generate`
            # would wait on them forever: drop them, so a failure is an error, never a hang.
            self._abort_unfinished()
            raise
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
        completions, logprobs = [], []
        for output in outputs:
            for sample in sorted(output.outputs, key=lambda sample: sample.index):
                tokens = list(sample.token_ids)
                completions.append(tokens)
                logprobs.append(
                    [step[token].logprob for token, step in zip(tokens, sample.logprobs)]
                )
        return to_tensors(prompt_ids, prompt_mask, completions, logprobs, generation_config)

    def publish_adapter(self, adapter_dir, version: int) -> None:
        """Makes the PEFT adapter saved in `adapter_dir` the one every later `generate` uses.

        The base weights stay as loaded; each version is a new `LoRARequest`, and the previous
        one is dropped from the engine.
        """
        from vllm.lora.request import LoRARequest

        from .vllm_sampling import adapter_rank

        if self.max_lora_rank is None:
            raise ValueError(
                "This vLLM engine was started without LoRA: build it with max_lora_rank set "
                "(the adapter's rank or more) to publish adapters, or use load_weights."
            )
        rank = adapter_rank(adapter_dir)
        if rank > self.max_lora_rank:
            raise ValueError(
                f"The adapter in {adapter_dir} has rank {rank}, above the engine's max_lora_rank "
                f"{self.max_lora_rank}: build the engine with max_lora_rank={rank} or more."
            )
        previous = self.adapter
        self._adapter_ids += 1  # a fresh id even when a version is published again (resume)
        self.adapter = LoRARequest(
            lora_name=f"adapter-v{version}",
            lora_int_id=self._adapter_ids,
            lora_path=os.path.abspath(adapter_dir),
        )
        self.adapter_version = version
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def load_weights(self, named_tensors) -> None:
        """Copies full weights (an iterable of `(name, tensor)` with the checkpoint's names) into
        the engine, for full fine-tuning; later `generate` calls use them.

        vLLM's in-place reload (`reload_weights` of its workers) is used: it restores the weight
        loaders that vLLM's post-load processing (e.g. CPU weight packing) removes, which a plain
        `model.load_weights` call trips over.
        """
        weights = [(name, tensor.detach().contiguous()) for name, tensor in named_tensors]
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True)
        )
        self.llm.reset_prefix_cache()
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)

    def close(self) -> None:
        """Drops the engine and removes the temporary copy of the base model it was built on.
        Nothing may be generated afterwards.

        vLLM's own shutdown is not called, nor is the engine collected at once: in this process
        either tears down vLLM's process-wide parallel state and `torch.distributed`'s default
        group, which the trainer (and any other engine of the process) still uses. Its memory
        returns when the process ends."""
        self.close_publisher()
        self.llm = None
        if hasattr(self, "_remove_folder"):
            self._remove_folder()

    def _abort_unfinished(self) -> None:
        engine = self.llm.llm_engine
        with contextlib.suppress(Exception):  # the original error is the one to report
            unfinished = list(engine.output_processor.request_states)
            if unfinished:
                engine.abort_request(unfinished, internal=True)
