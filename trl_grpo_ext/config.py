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

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from .objective import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_MODES
from .off_policy import OFF_POLICY_CORRECTIONS


def _has_accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or (mps is not None and mps.is_available())
        or (xpu is not None and xpu.is_available())
    )


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

    model_init_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of `AutoModelForCausalLM.from_pretrained` when the model "
            "is given as a path or hub id (e.g. {'dtype': 'bfloat16'})."
        },
    )

    # Generation
    num_generations: int = field(
        default=8,
        metadata={"help": "Completions sampled per prompt (the group size G). At least 2."},
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Prompts longer than this many tokens are truncated from the left."},
    )
    max_completion_length: int = field(
        default=256, metadata={"help": "Maximum number of generated tokens per completion."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature; log-probs are computed at it too."}
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 disables it."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum token probability."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty."})
    generation_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments of `GenerationConfig`; they override the above."
        },
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
    beta: float = field(
        default=0.0,
        metadata={"help": "Weight of the k3 KL penalty to the reference model; 0 disables it."},
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range epsilon_low."})
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping range (DAPO's clip-higher); defaults to `epsilon`."},
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Upper bound on the unclipped ratio (two-sided clipping); None disables."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={"help": f"Token aggregation of the loss, one of {', '.join(LOSS_TYPES)}."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "'token' (GRPO) or 'sequence' (GSPO, length-normalised sequence ratio)."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": f"Advantage scaling, one of {', '.join(SCALE_MODES)}."},
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
    off_policy_correction: str = field(
        default="tis",
        metadata={
            "help": "Correction for rollouts from an older policy (asynchronous mode): 'none', "
            "'tis' (token weights min(w, C)) or 'mis' (sequence weights, zero outside "
            "[C_min, C_max])."
        },
    )
    off_policy_clip: float = field(
        default=2.0, metadata={"help": "C of 'tis', and C_max of 'mis'."}
    )
    off_policy_min: float = field(default=0.5, metadata={"help": "C_min of 'mis'."})
    rollout_worker_threads: int = field(
        default=1, metadata={"help": "CPU threads of the asynchronous rollout worker."}
    )

    # Logging
    log_completions: bool = field(
        default=False,
        metadata={"help": "Print a table of sample prompts, completions and rewards when logging."},
    )
    num_completions_to_print: int | None = field(
        default=4, metadata={"help": "Rows of the completions table; None prints all."}
    )

    def __post_init__(self):
        if not self.use_cpu and not _has_accelerator():
            # Makes several CPU processes (accelerate launch --multi_gpu) use gloo data parallelism.
            self.use_cpu = True
        if self.bf16 is None:
            self.bf16 = bool(
                not self.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            )
        if (
            self.gradient_checkpointing_kwargs is None
            and self.activation_checkpointing_kwargs is None
        ):
            # Non-reentrant checkpointing also works when the inputs do not require grad (LoRA).
            self.activation_checkpointing_kwargs = {"use_reentrant": False}
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._validate()

    def _validate(self):
        def fail(message):
            raise ValueError(message)

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
        if self.temperature <= 0:
            fail(f"temperature={self.temperature} must be > 0 (it divides the logits).")

        processes = max(self.world_size, 1)
        micro_batch = self.per_device_train_batch_size
        accumulation = self.gradient_accumulation_steps
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            fail("Set either steps_per_generation or generation_batch_size, not both.")
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
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            fail(
                f"off_policy_correction={self.off_policy_correction!r} is unknown; use one of "
                f"{list(OFF_POLICY_CORRECTIONS)}."
            )
        if not 0 < self.off_policy_min <= 1 <= self.off_policy_clip:
            fail(
                f"off_policy_min={self.off_policy_min} and off_policy_clip={self.off_policy_clip} "
                "must satisfy 0 < off_policy_min <= 1 <= off_policy_clip."
            )
        if self.max_staleness is not None:
            if self.max_staleness < 0:
                fail(f"max_staleness={self.max_staleness} must be >= 0 (or None for synchronous).")
            if self.num_iterations != 1 or self.steps_per_generation != accumulation:
                fail(
                    "Asynchronous rollouts (max_staleness) need one generation batch per optimizer "
                    f"step: set num_iterations=1 (got {self.num_iterations}) and leave "
                    f"steps_per_generation at gradient_accumulation_steps (got "
                    f"{self.steps_per_generation} vs {accumulation})."
                )
        if self.reward_weights is not None and not all(
            isinstance(weight, (int, float)) for weight in self.reward_weights
        ):
            fail(f"reward_weights={self.reward_weights} must be a list of numbers.")

    @property
    def prompts_per_generation(self) -> int:
        """Distinct prompts one process samples per generation batch."""
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations
