"""The settings of the generation package, as typed records built once from the configuration.

Nothing in `generation/` reads the configuration (`GroupRelativeConfig`, or `args`) but the
record builders, one per record, each a `from_config` classmethod: `SamplingSettings`
(`sampling.py`, what `generate` samples from), `ColocateSettings` (`vllm_colocate.py`, the
colocated vLLM engine), and here `EngineSettings` (which engine samples, and how) and
`RolloutSettings` (prompts, group sizes, tools, padding and the asynchronous schedule).
`GenerationSettings.from_config` builds them all; a producer without a trainer
(`RolloutProducer.for_model`) builds the same records from their defaults.
`tests/test_layout.py` fails when a module of the package reads a configuration field anywhere
else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import BEAMS_ON_THE_TRAINERS_GENERATE, SamplingSettings, beam_search
from .vllm_colocate import ColocateSettings


@dataclass(frozen=True)
class EngineSettings:
    """Which engine samples and how (`engines.build_engine`, `engines.build_rollout_engine`).

    Attributes:
        use_vllm (`bool`): sample with vLLM (colocated, or a server when `server_url` is set).
        cast_lm_head_to_fp32 (`bool`): the transformers engine's output head in float32.
        sample_with_merged_adapters (`str`): LoRA merged while sampling (`merged_adapters.py`).
        rollout_worker_threads (`int`): CPU threads of the asynchronous worker's process.
        server_url (`str`, *optional*): the vLLM server (`vllm_mode="server"`), else None.
        server_timeout (`float`): seconds to wait for the server.
        adapter_prefix (`str`): the names of the adapter versions this process publishes to a
            server (distinct per process, so processes never unload each other's).
        max_model_len (`int`, *optional*): `vllm_max_model_length` when vLLM samples.
        colocate (`ColocateSettings`): the colocated engine's settings (its `max_lora_rank` is
            the model's, set when the engine is built).
    """

    use_vllm: bool = False
    cast_lm_head_to_fp32: bool = False
    sample_with_merged_adapters: str = "exact"
    rollout_worker_threads: int = 1
    server_url: str | None = None
    server_timeout: float = 240.0
    adapter_prefix: str = "adapter"
    max_model_len: int | None = None
    colocate: ColocateSettings = field(default_factory=ColocateSettings)

    @classmethod
    def from_config(cls, args) -> EngineSettings:
        server = args.use_vllm and args.vllm_mode == "server"
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        return cls(
            use_vllm=args.use_vllm,
            cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
            sample_with_merged_adapters=args.sample_with_merged_adapters,
            rollout_worker_threads=args.rollout_worker_threads,
            server_url=url if server else None,
            server_timeout=args.vllm_server_timeout,
            adapter_prefix="adapter" if args.world_size == 1 else f"adapter-p{args.process_index}",
            max_model_len=args.vllm_max_model_length if args.use_vllm else None,
            colocate=ColocateSettings.from_config(args, lora_rank=None),
        )


@dataclass(frozen=True)
class RolloutSettings:
    """What turns rows into requests and rollouts (`producer.py`).

    Attributes:
        chat_template_kwargs (`dict`, *optional*): passed to the chat template.
        max_prompt_length (`int`, *optional*): prompts are cut to their last tokens.
        num_generations (`int`): completions per prompt in training.
        num_generations_eval (`int`, *optional*): per prompt in evaluations; `num_generations`
            when None.
        max_tool_calling_iterations (`int`, *optional*): tool calls per rollout.
        pad_to_multiple_of (`int`, *optional*): the rollouts' tensors' widths.
        max_staleness (`int`, *optional*): asynchronous rollouts, at most this many steps old.
        seed, process_index (`int`): each generation batch's seed (`generation_seed`).
        gradient_accumulation_steps (`int`): prompt batches per optimizer step.
        max_resample_rounds (`int`): dynamic sampling's rounds per generation batch.
    """

    chat_template_kwargs: dict | None = None
    max_prompt_length: int | None = None
    num_generations: int = 1
    num_generations_eval: int | None = None
    max_tool_calling_iterations: int | None = None
    pad_to_multiple_of: int | None = None
    max_staleness: int | None = None
    seed: int = 0
    process_index: int = 0
    gradient_accumulation_steps: int = 1
    max_resample_rounds: int = 0

    @classmethod
    def from_config(cls, args) -> RolloutSettings:
        return cls(
            chat_template_kwargs=args.chat_template_kwargs,
            max_prompt_length=args.max_prompt_length,
            num_generations=args.num_generations,
            num_generations_eval=args.num_generations_eval,
            max_tool_calling_iterations=args.max_tool_calling_iterations,
            pad_to_multiple_of=args.pad_to_multiple_of,
            max_staleness=args.max_staleness,
            seed=args.seed,
            process_index=args.process_index,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_resample_rounds=args.max_resample_rounds,
        )


@dataclass(frozen=True)
class GenerationSettings:
    """Every setting of the generation package: its three records."""

    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)

    @classmethod
    def from_config(cls, args) -> GenerationSettings:
        """The records of a `GroupRelativeConfig`, each built by its own `from_config`."""
        settings = cls(
            SamplingSettings.from_config(args),
            EngineSettings.from_config(args),
            RolloutSettings.from_config(args),
        )
        kwargs = settings.sampling.generation_kwargs or {}
        if beam_search(kwargs) and (settings.engine.use_vllm or settings.rollout.max_staleness):
            raise ValueError(BEAMS_ON_THE_TRAINERS_GENERATE.format(beams=kwargs["num_beams"]))
        return settings
