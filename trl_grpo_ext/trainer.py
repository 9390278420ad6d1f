"""`GroupRelativeTrainer`: GRPO as a `transformers.Trainer` subclass.

One optimizer step, on each process:
1. `generate_rollouts`: sample G completions for each prompt of the generation batch;
2. `score_rollouts`: call every reward function, `(N, F)` with NaN for "not applicable";
3. `compute_advantages`: group-relative advantages over the rewards of all processes;
4. `compute_objective`: per micro-batch, the clipped surrogate of `objective.policy_loss`.

The Trainer's loop is reused as it is. Its data loader yields the prompts of a generation batch,
repeated once per micro-batch slot (`steps_per_generation * num_iterations` times);
`get_batch_samples`, which the loop calls once per optimizer step, turns them into rollouts the
first time and serves buffered micro-batches after that. Each micro-batch carries the token count
of its whole optimizer step over all processes, so the "dapo" loss is exact under gradient
accumulation and data parallelism.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import itertools
import os
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Trainer, set_seed

from . import hub
from .async_rollout import ProcessRolloutWorker, RolloutPipeline
from .checkpoints import (
    ResumableWorker,
    RolloutState,
    checkpoint_step,
    is_complete_checkpoint,
    last_complete_checkpoint,
    load_rollout_state,
    save_rollout_state,
)
from .config import GroupRelativeConfig
from .generation import (
    PromptEncoder,
    check_chat_template,
    is_conversational,
    sampling_config_from_args,
)
from .generation.engines import (
    EngineWorker,
    TransformersEngine,
    WeightPublisher,
    build_engine,
    engine_model_folder,
)
from .metrics import completions_table, length_metrics, print_completions, reward_metrics
from .objective import (
    LOSS_TYPE_TABLE,
    entropy_bonus,
    group_advantages,
    high_entropy_mask,
    policy_loss,
    weighted_rewards,
)
from .off_policy import behaviour_correction
from .rollout import (
    Rollout,
    completion_logprobs,
    completion_mask_from_ids,
    concat_rollouts,
    eos_token_ids,
    generation_seed,
    pad_rollout,
    seeded,
)
from .sampler import EpochDataLoader, GenerationBatchSampler, collate_rows
from .scoring import call_reward_funcs, resolve_reward_funcs, reward_name

try:
    from peft import PeftModel, get_peft_model
except ImportError:  # peft is a dependency; this keeps the import error where it is used
    PeftModel, get_peft_model = (), None


# Parameters of the SAPO and VESPO surrogates, passed from the config as they are named.
_SURROGATE_FIELDS = (
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)


def is_peft_model(model) -> bool:
    return bool(PeftModel) and isinstance(model, PeftModel)


def _end_distributed_at_exit(trainer_ref) -> None:
    """Tears down the process group while the interpreter is still whole.

    Left to interpreter shutdown, gloo's worker threads free finished collectives (and their
    tensors) while Python is being torn down, which aborts the process now and then after a
    finished run (exit code -6). The data-parallel wrapper holds the process group, so it is
    released first."""
    trainer = trainer_ref()
    if trainer is None or not torch.distributed.is_initialized():
        return
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model
    gc.collect()
    trainer.accelerator.end_training()


class GroupRelativeTrainer(Trainer):
    """Trains a causal language model with GRPO.

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            A hub id or local folder (loaded with `AutoModelForCausalLM` and
            `args.model_init_kwargs`), or a model object.
        reward_funcs (callable, `str`, or a list of them):
            Reward functions in TRL's convention, registry names (`"math_accuracy"`) or dotted
            import paths (`"my_pkg.rewards:score"`).
        args ([`GroupRelativeConfig`], *optional*):
            Training configuration; defaults to `GroupRelativeConfig("<model name>-GRPO")`.
        train_dataset (`datasets.Dataset`, *optional*):
            Dataset with a `prompt` column: a string (standard) or a list of messages
            (conversational, rendered with the tokenizer's chat template). Other columns are
            passed to the reward functions, one entry per completion.
        eval_dataset (`datasets.Dataset`, *optional*):
            Prompts for `evaluate()`, in the same format.
        processing_class (`PreTrainedTokenizerBase`, *optional*):
            Tokenizer; loaded from the model's folder when omitted.
        peft_config (`peft.PeftConfig`, *optional*):
            Wraps the model with these adapters; only they are trained.
        callbacks (`list[TrainerCallback]`, *optional*):
            As in `transformers.Trainer`.
        optimizers (`tuple`, *optional*, defaults to `(None, None)`):
            As in `transformers.Trainer`: an optimizer and a learning-rate scheduler.
    """

    _tag_names = ["trl_grpo_ext", "grpo"]
    # compute_objective already scales the loss for gradient accumulation (see its docstring).
    loss_is_scaled_for_ga = True
    # In-flight batches restored from a checkpoint, for the next rollout worker (`train`).
    _resumed_rollouts: dict | None = None

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable | str | list[Callable | str],
        args: GroupRelativeConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GroupRelativeConfig(output_dir=f"{os.path.basename(str(name)) or 'model'}-GRPO")
        if not isinstance(args, GroupRelativeConfig):
            raise TypeError(
                f"args must be a GroupRelativeConfig, got {type(args).__name__}; build one with "
                "GroupRelativeConfig(**your_args.to_dict()) or the same fields."
            )
        set_seed(args.seed)  # adapters and heads initialised below are reproducible
        if isinstance(model, str):
            init_kwargs = {
                "trust_remote_code": args.trust_remote_code,
                **(args.model_init_kwargs or {}),
            }
            model = AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model.config._name_or_path, trust_remote_code=args.trust_remote_code
            )
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token

        self.reward_funcs = resolve_reward_funcs(reward_funcs)
        self.reward_names = [reward_name(func) for func in self.reward_funcs]
        weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(weights)} entries but there are "
                f"{len(self.reward_funcs)} reward functions ({self.reward_names}); give one "
                "weight per function."
            )
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        for split, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            columns = getattr(dataset, "column_names", None)
            if columns is not None and "prompt" not in columns:
                raise ValueError(
                    f"{split} has no 'prompt' column; it has {columns}. Rename the column that "
                    "holds the prompts, e.g. dataset.rename_column('question', 'prompt')."
                )
            check_chat_template(processing_class, dataset, split)

        engine_folder = None
        if args.use_vllm and args.vllm_mode == "colocate":
            base = model.get_base_model() if is_peft_model(model) else model
            engine_folder = engine_model_folder(base, processing_class)
        if peft_config is not None:
            if is_peft_model(model):
                raise ValueError("model is already a PeftModel; do not also pass peft_config.")
            model = get_peft_model(model, peft_config)
        if args.gradient_checkpointing and is_peft_model(model):
            model.enable_input_require_grads()
        if args.sync_ref_model and is_peft_model(model):
            raise ValueError(
                "sync_ref_model=True needs full fine-tuning: under LoRA the reference model is "
                "the base model with the adapters disabled, which cannot move towards the policy. "
                "Set sync_ref_model=False, or train without peft_config."
            )
        if args.disable_dropout:
            from trl.trainer.utils import disable_dropout_in_model

            disable_dropout_in_model(model)
        self.ref_model = None
        if args.beta > 0 and not is_peft_model(model):
            # Full fine-tuning needs a frozen copy; under LoRA the base model with adapters
            # disabled is the reference, with no second copy in memory.
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

        super().__init__(
            model=model,
            args=args,
            data_collator=collate_rows,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
            if args.sync_ref_model:
                from trl.trainer.callbacks import SyncRefModelCallback

                self.add_callback(SyncRefModelCallback(self.ref_model, self.accelerator))
        self.eos_token_ids = eos_token_ids(model, processing_class)
        self.prompt_encoder = PromptEncoder(
            processing_class, args.max_prompt_length, args.chat_template_kwargs
        )
        sampling = dict(eos_token_id=self.eos_token_ids, pad_token_id=processing_class.pad_token_id)
        self.generation_config = sampling_config_from_args(
            args, num_return_sequences=args.num_generations, **sampling
        )
        self.eval_generation_config = sampling_config_from_args(
            args, num_return_sequences=args.num_generations_eval or args.num_generations, **sampling
        )
        self._sampling = self.generation_config  # the eval one inside evaluate()
        lora_rank = None
        if is_peft_model(model):
            lora_rank = max(config.r for config in model.peft_config.values())
        self.engine = build_engine(args, self._policy_for_generation, engine_folder, lora_rank)
        self.weight_publisher = None
        if not isinstance(self.engine, TransformersEngine):
            self.weight_publisher = WeightPublisher(
                self.engine,
                lambda: self.accelerator.unwrap_model(self.model),
                lora_rank is not None,
            )
            weakref.finalize(self, self.weight_publisher.close)
        self._buffer: list[dict] | None = None
        self._pipeline: RolloutPipeline | None = None
        self._lookahead: list = []
        self._lookahead_source = None
        self._staleness_counts: dict[int, int] = {}
        self._threads_before_async: int | None = None
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._last_rollout_table: dict[str, list] | None = None
        self.model_card_sections: dict[str, str] = {}
        self.model_card_datasets: list[str] = []  # Hub dataset ids for the card's metadata
        if args.world_size > 1:
            atexit.register(_end_distributed_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self) -> DataLoader:
        args = self.args
        needed = args.prompts_per_generation * args.world_size
        if len(self.train_dataset) < needed:
            raise ValueError(
                f"train_dataset has {len(self.train_dataset)} prompts but one generation batch "
                f"needs {needed}; add prompts or lower per_device_train_batch_size or "
                "steps_per_generation."
            )
        sampler = GenerationBatchSampler(
            num_rows=len(self.train_dataset),
            prompts_per_batch=args.prompts_per_generation,
            repeats=args.steps_per_generation * args.num_iterations,
            rank=args.process_index,
            world_size=args.world_size,
            shuffle=args.shuffle_dataset,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        return EpochDataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=collate_rows)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Pulls the prompts of one optimizer step and returns its micro-batches of rollouts."""
        args = self.args
        if args.max_staleness is None:
            prompt_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        else:
            prompt_batches = self._pull_with_lookahead(epoch_iterator, num_batches)
        first = self.state.global_step * args.gradient_accumulation_steps
        window = args.steps_per_generation * args.num_iterations
        micro_batches = []
        for offset, rows in enumerate(prompt_batches):
            slot = (first + offset) % window
            if slot == 0 or self._buffer is None:
                # Generation batches are numbered; each samples from its own seed.
                self._buffer = self._make_generation_batch(rows, (first + offset) // window)
            micro_batches.append(self._buffer[slot % args.steps_per_generation])
        return micro_batches, micro_batches[0]["num_items_in_batch"] if micro_batches else None

    def _pull_with_lookahead(self, epoch_iterator, num_batches):
        """Prompt batches of this step, keeping those of the next `max_staleness` steps in
        `self._lookahead` so the rollout worker can generate them in advance."""
        if epoch_iterator is not self._lookahead_source:
            self._lookahead_source, self._lookahead = epoch_iterator, []
        wanted = num_batches * (self.args.max_staleness + 1)
        for rows in itertools.islice(epoch_iterator, max(wanted - len(self._lookahead), 0)):
            self._lookahead.append(rows)
        current, self._lookahead = self._lookahead[:num_batches], self._lookahead[num_batches:]
        return current

    # --------------------------------------------------------- override points

    def generate_rollouts(self, rows: list[dict]) -> Rollout:
        """Samples `num_generations` completions for each dataset row (one generation batch).

        Called in the synchronous mode; with `max_staleness` set, the rollout worker samples
        instead and an override of this method is not used.

        Args:
            rows (`list[dict]`): dataset rows, each with a `prompt`.

        Returns:
            [`Rollout`] with `len(rows) * num_generations` completions, groups consecutive.
        """
        prompt_ids, prompt_mask = self.prompt_encoder.encode([row["prompt"] for row in rows])
        seed = None  # transformers samples from the global generator, seeded by the caller
        if self.weight_publisher is not None:  # an engine with its own copy of the weights
            self.weight_publisher.publish(self.state.global_step)
            seed = int(torch.randint(0, 2**31 - 1, ()))
        prompt_ids, prompt_mask, completion_ids, behaviour_logps = self.engine.generate(
            prompt_ids, prompt_mask, self._sampling, seed
        )
        return self._build_rollout(
            rows, prompt_ids, prompt_mask, completion_ids, behaviour_logps=behaviour_logps
        )

    @contextlib.contextmanager
    def _policy_for_generation(self):
        """The model to generate with: unwrapped from DDP (gathered under ZeRO-3), in eval mode."""
        from trl.models import unwrap_model_for_generation

        with unwrap_model_for_generation(
            self.model_wrapped,
            self.accelerator,
            gather_deepspeed3_params=self.args.ds3_gather_for_generation,
        ) as policy:
            was_training = policy.training
            policy.eval()
            try:
                yield policy
            finally:
                policy.train(was_training)

    def _build_rollout(
        self, rows, prompt_ids, prompt_mask, completion_ids, behaviour_logps=None, version=None
    ) -> Rollout:
        """A `Rollout` from sampled token ids: masks, decoded text, columns per completion."""
        group_size = len(completion_ids) // len(rows)
        prompts = [row["prompt"] for row in rows]
        completion_mask, is_truncated = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        pad = self.processing_class.pad_token_id
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)  # (N, T)
        rollout = Rollout(
            prompts=[prompt for prompt in prompts for _ in range(group_size)],
            completions=[],
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            is_truncated=is_truncated,
            group_size=group_size,
            columns={
                key: [row[key] for row in rows for _ in range(group_size)]
                for key in rows[0]
                if key != "prompt"
            },
            behaviour_logps=behaviour_logps,
            policy_version=self.state.global_step if version is None else version,
        )
        if self.args.pad_to_multiple_of:
            rollout = pad_rollout(rollout, self.args.pad_to_multiple_of, pad)
        decoded = self.processing_class.batch_decode(
            rollout.completion_id_lists(), skip_special_tokens=True
        )
        if is_conversational(prompts[0]):
            decoded = [[{"role": "assistant", "content": text}] for text in decoded]
        rollout.completions = decoded
        return rollout

    def score_rollouts(self, rollout: Rollout) -> torch.Tensor:
        """Calls every reward function on the rollout.

        Returns:
            `torch.Tensor` of shape `(N, F)`: one column per reward function, NaN where a
            function returned None (not applicable).
        """
        return call_reward_funcs(
            self.reward_funcs,
            prompts=rollout.prompts,
            completions=rollout.completions,
            completion_ids=rollout.completion_id_lists(),
            trainer_state=self.state,
            **rollout.columns,
        )

    def compute_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-relative advantages of the rewards `(N, F)` of all processes -> `(N,)`.

        Consecutive rows of `num_generations` form a group (`objective.group_advantages`).
        """
        return group_advantages(
            rewards,
            self.args.num_generations,
            weights=self.reward_weights,
            scale=self.args.scale_rewards,
            multi_objective_aggregation=self.args.multi_objective_aggregation,
        )

    def compute_objective(self, model, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch, scaled so that the Trainer's gradient accumulation and
        the data-parallel gradient mean give the loss of the whole optimizer step.

        "dapo" divides by the token count of the whole step on all processes (times the number
        of processes, which the data-parallel mean divides out again), so its gradient equals
        that of one large batch. The other loss types are per-micro-batch means; they are
        divided by the accumulation steps, which is exact for "grpo" and "dr_grpo" (every
        micro-batch has the same number of sequences) and is TRL's definition for "bnpo".

        A micro-batch with no non-zero advantage (and `beta == 0`, one process) returns a zero
        loss without running the model: its loss and gradient are exactly 0 anyway.

        Returns:
            `(loss, metrics)`; metrics are floats, averaged over the micro-batches that ran the
            model when logged.
        """
        args = self.args
        if self._carries_no_signal(batch):
            # Every term of the loss is an advantage times something: the loss and its
            # gradient are exactly 0, so skip the forward and backward passes. Zero gradients
            # still reach the optimizer (Adam's moments and weight decay step as usual).
            trainable = [p for p in model.parameters() if p.requires_grad]
            return sum(p.view(-1)[0] for p in trainable) * 0.0, {}
        logps, entropy = self._token_logprobs(model, batch, return_entropy=True)
        entropy_mask = None
        if args.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(
                entropy.detach(), batch["completion_mask"], args.top_entropy_quantile
            )
        importance_weights, off_policy_stats = self._behaviour_correction(batch, logps)
        loss, stats = policy_loss(
            logps,
            batch.get("old_logps"),
            batch["advantages"],
            batch["completion_mask"],
            loss_type=args.loss_type,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            importance_sampling_level=args.importance_sampling_level,
            delta=args.delta,
            ref_logps=batch.get("ref_logps"),
            beta=args.beta,
            num_items_in_batch=batch["num_items_in_batch"] / args.world_size,
            max_completion_length=args.max_completion_length,
            importance_weights=importance_weights,
            use_bias_correction_kl=args.use_bias_correction_kl,
            entropy_mask=entropy_mask,
            off_policy_mask_threshold=args.off_policy_mask_threshold,
            sampling_logps=batch.get("behaviour_logps"),
            **{name: getattr(args, name) for name in _SURROGATE_FIELDS},
        )
        stats.update(off_policy_stats)
        if LOSS_TYPE_TABLE[args.loss_type].aggregation != "dapo":
            # The other aggregations are per-micro-batch means (see the docstring).
            loss = loss / self.current_gradient_accumulation_steps
        mask = batch["completion_mask"]
        if args.entropy_coef:
            # TRL's entropy bonus: a plain mean over the trained tokens whatever the loss type,
            # so it is scaled for gradient accumulation only.
            bonus = entropy_bonus(entropy, mask, entropy_mask)
            loss = loss - args.entropy_coef * bonus / self.current_gradient_accumulation_steps
        metrics = {key: value.item() for key, value in stats.items()}
        metrics["entropy"] = ((entropy * mask).sum() / mask.sum().clamp(min=1)).item()
        return loss, metrics

    # ------------------------------------------------------------------ internals

    def _behaviour_correction(self, batch: dict, logps: torch.Tensor):
        """Importance weights `pi_old / mu` for rollouts sampled by another policy `mu` (a vLLM
        engine, the asynchronous worker), and their statistics; `(None, {})` otherwise."""
        if "behaviour_logps" not in batch:
            return None, {}
        old_logps = batch.get("old_logps", logps)  # pi_old
        return behaviour_correction(
            self.args, old_logps, batch["behaviour_logps"], batch["completion_mask"]
        )

    def _carries_no_signal(self, batch: dict) -> bool:
        """True when no token of the micro-batch has a non-zero advantage and nothing else
        (a KL term) enters the loss. Never with several processes, DeepSpeed or FSDP, where a
        skipped forward pass would leave the other processes waiting in a collective or break
        the engine's hooks."""
        if self.args.beta != 0 or self.args.entropy_coef != 0 or self.args.world_size > 1:
            return False
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        signal = (batch["advantages"] != 0).unsqueeze(1) & batch["completion_mask"].bool()
        return not bool(signal.any())

    def _token_logprobs(self, model, batch, return_entropy=False):
        return completion_logprobs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_ids"],
            temperature=self.args.temperature,
            return_entropy=return_entropy,
            logprob_chunk_tokens=self.args.logprob_chunk_tokens,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
        )

    @torch.no_grad()
    def _logps_in_chunks(self, model, tensors, chunk_size):
        """Log-probs of the sampling (or reference) policy, without gradient and with dropout
        off: a dropout mask here would make the first ratio differ from 1 and clip for nothing."""
        rows = tensors["input_ids"].shape[0]
        was_training = model.training
        model.eval()
        try:
            chunks = [
                self._token_logprobs(model, {k: v[i : i + chunk_size] for k, v in tensors.items()})
                for i in range(0, rows, chunk_size)
            ]
        finally:
            model.train(was_training)
        return torch.cat(chunks)

    def _sample(self, rows: list[dict], index: int, round_index: int = 0) -> Rollout:
        """One generation batch: in this process (synchronous) or from the rollout worker."""
        args = self.args
        seed = generation_seed(args.seed, args.process_index, index, round_index)
        if args.max_staleness is None:
            with seeded(seed, self.accelerator.device):
                return self.generate_rollouts(rows)
        pipeline = self._rollout_pipeline()
        prompts = self.prompt_encoder.encode([row["prompt"] for row in rows])
        if round_index > 0:  # dynamic sampling: one more batch, now, with the current weights
            extra = -(index * (args.max_resample_rounds + 1) + round_index)  # never a step
            batch, staleness = pipeline.generate_now(
                extra, self.state.global_step, self._trainable_weights, prompts, seed
            )
        else:
            upcoming = {index: (prompts, seed)}
            step_rows = self._lookahead[:: args.gradient_accumulation_steps]
            for ahead, future_rows in enumerate(step_rows, start=1):
                upcoming[index + ahead] = (
                    self.prompt_encoder.encode([row["prompt"] for row in future_rows]),
                    generation_seed(args.seed, args.process_index, index + ahead),
                )
            batch, staleness = pipeline.consume(index, self._trainable_weights, upcoming)
        self._metrics["async/staleness"].append(float(staleness))
        self._staleness_counts[staleness] = self._staleness_counts.get(staleness, 0) + 1
        return self._build_rollout(
            rows,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            behaviour_logps=batch.behaviour_logps,
            version=batch.version,
        )

    def _trainable_weights(self) -> dict[str, torch.Tensor]:
        """What the rollout worker needs to catch up: the adapter under LoRA, else all weights."""
        model = self.accelerator.unwrap_model(self.model)
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def _rollout_pipeline(self) -> RolloutPipeline:
        if self._pipeline is None and self.weight_publisher is not None:
            # The engine generates while the trainer trains; weights go to it as published.
            worker = EngineWorker(self.engine, self.weight_publisher, self.generation_config)
            worker = ResumableWorker(worker, restored=self._resumed_rollouts)
            self._resumed_rollouts = None
            self._pipeline = RolloutPipeline(worker, self.args.max_staleness)
        if self._pipeline is None:
            model = self.accelerator.unwrap_model(self.model)
            if model.device.type != "cpu":
                warnings.warn(
                    f"max_staleness is set and the model is on {model.device}: the local rollout "
                    "worker generates with a copy of the model on the CPU, which is likely "
                    "slower than synchronous generation on the accelerator. Unset max_staleness "
                    "to generate there.",
                    stacklevel=2,
                )
            worker = ProcessRolloutWorker(
                model, self.generation_config, threads=self.args.rollout_worker_threads
            )
            # Its in-flight batches go into checkpoints (`_save_rng_state`).
            worker = ResumableWorker(worker, restored=self._resumed_rollouts)
            self._resumed_rollouts = None
            self._pipeline = RolloutPipeline(worker, self.args.max_staleness)
            if model.device.type == "cpu":
                # Generation and training overlap only if they do not fight over the cores.
                self._threads_before_async = torch.get_num_threads()
                threads = self._threads_before_async - self.args.rollout_worker_threads
                torch.set_num_threads(max(1, threads))
        return self._pipeline

    def _sample_informative(self, rows: list[dict], index: int):
        """Dynamic sampling: resamples until every group has rewards that differ.

        Returns the rollout, its rewards `(N, F)` and a `(N,)` mask of the rows to train on
        (False for filler groups when `max_resample_rounds` ran out).
        """
        args = self.args
        wanted, group_size = len(rows), args.num_generations
        kept, kept_rewards, filler, filler_rewards = [], [], [], []
        generated = filtered = rounds = 0
        while True:
            rollout = self._sample(rows, index, rounds)
            rewards = self.score_rollouts(rollout)  # (N, F)
            totals = weighted_rewards(rewards, self.reward_weights).view(-1, group_size)
            informative = (totals.nan_to_num().std(dim=1) > 1e-6).tolist()
            generated += len(informative)
            for group, useful in enumerate(informative):
                target = kept if useful else filler
                (kept_rewards if useful else filler_rewards).append(
                    rewards[group * group_size : (group + 1) * group_size]
                )
                target.append(rollout.select_groups([group]))
            filtered += informative.count(False)
            have = torch.tensor(float(len(kept)), device=self.accelerator.device)
            # Every process takes part in every round, so collective calls stay matched.
            if self.accelerator.reduce(have, reduction="min").item() >= wanted:
                break
            if rounds == args.max_resample_rounds:
                break
            rounds += 1
            draw = torch.Generator().manual_seed(
                generation_seed(args.seed, args.process_index, index, rounds)
            )
            picks = torch.randint(len(self.train_dataset), (wanted,), generator=draw)
            rows = [self.train_dataset[i] for i in picks.tolist()]
        self._metrics["dynamic_sampling/filtered_fraction"].append(filtered / generated)
        self._metrics["dynamic_sampling/rounds"].append(float(rounds))
        chosen = (kept + filler)[:wanted]
        chosen_rewards = torch.cat((kept_rewards + filler_rewards)[:wanted])
        trainable = torch.tensor(
            [i < len(kept) for i in range(len(chosen)) for _ in range(group_size)]
        )
        pad = self.processing_class.pad_token_id
        return concat_rollouts(chosen, pad), chosen_rewards, trainable

    def _make_generation_batch(self, rows: list[dict], index: int = 0) -> list[dict]:
        args = self.args
        if args.dynamic_sampling:
            rollout, rewards, trainable = self._sample_informative(rows, index)
        else:
            rollout = self._sample(rows, index)
            rewards, trainable = self.score_rollouts(rollout), None
        rewards = rewards.to(self.accelerator.device)  # (N, F)
        all_rewards = self.accelerator.gather(rewards)  # (N * processes, F)
        all_advantages = self.compute_advantages(all_rewards)  # (N * processes,)
        local = len(rollout)
        start = self.accelerator.process_index * local
        advantages = all_advantages[start : start + local]  # (N,)
        self._record_rollout_metrics(rollout, all_rewards, advantages)

        device = self.accelerator.device
        completion_mask = rollout.completion_mask.to(device)
        if args.mask_truncated_completions:
            completion_mask = completion_mask * (~rollout.is_truncated).to(device).unsqueeze(1)
        if trainable is not None:  # filler groups of dynamic sampling carry no gradient
            completion_mask = completion_mask * trainable.to(device).unsqueeze(1)
        tensors = {
            "input_ids": torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(device),
            "attention_mask": torch.cat([rollout.prompt_mask, completion_mask], 1).to(device),
            "completion_ids": rollout.completion_ids.to(device),
            "completion_mask": completion_mask,
            "advantages": advantages.to(device),
        }
        if rollout.behaviour_logps is not None:
            tensors["behaviour_logps"] = rollout.behaviour_logps.to(device)
        micro = args.per_device_train_batch_size
        # Later micro-batches of a generation batch see weights updated after sampling: they
        # need the sampling policy's log-probs. With one step per generation, the current
        # log-probs detached are the same numbers, so no extra forward pass is spent.
        if args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps:
            tensors["old_logps"] = self._logps_in_chunks(self.model, tensors, micro)
        if args.beta > 0:
            if self.ref_model is not None:
                tensors["ref_logps"] = self._logps_in_chunks(self.ref_model, tensors, micro)
            else:
                with self.accelerator.unwrap_model(self.model).disable_adapter():
                    tensors["ref_logps"] = self._logps_in_chunks(self.model, tensors, micro)

        micro_batches = [
            {key: value[i : i + micro] for key, value in tensors.items()}
            for i in range(0, local, micro)
        ]
        # Token count of each optimizer step over all processes (the "dapo" denominator).
        accumulation = args.gradient_accumulation_steps
        for step_start in range(0, len(micro_batches), accumulation):
            step = micro_batches[step_start : step_start + accumulation]
            tokens = sum(batch["completion_mask"].sum() for batch in step)
            tokens = self.accelerator.reduce(tokens.float(), reduction="sum").clamp(min=1)
            for batch in step:
                batch["num_items_in_batch"] = tokens
        return micro_batches

    def _record_rollout_metrics(self, rollout: Rollout, all_rewards, advantages):
        gather, device = self.accelerator.gather, self.accelerator.device
        lengths = gather(rollout.completion_lengths.to(device))
        truncated = gather(rollout.is_truncated.to(device))
        for metrics in (
            reward_metrics(
                all_rewards, self.reward_weights, self.args.num_generations, self.reward_names
            ),
            length_metrics(lengths, truncated),
        ):
            for key, value in metrics.items():
                self._metrics[key].append(value)
        tokens = gather((rollout.prompt_mask.sum() + rollout.completion_mask.sum()).to(device))
        self.state.num_input_tokens_seen += int(tokens.sum().item())
        if self.args.log_completions:
            self._last_rollout_table = completions_table(
                rollout, all_rewards, self.reward_names, advantages
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(
                "GroupRelativeTrainer does not return model outputs from compute_loss."
            )
        loss, metrics = self.compute_objective(model, inputs)
        for key, value in metrics.items():
            self._metrics[key].append(value)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._metrics and not any(key.startswith("eval_") for key in logs):
            names = sorted(self._metrics)
            means = torch.tensor(
                [sum(self._metrics[name]) / len(self._metrics[name]) for name in names],
                device=self.accelerator.device,
            )
            means = self.accelerator.reduce(means, reduction="mean")
            logs = {
                **logs,
                **dict(zip(names, means.tolist())),
                "num_tokens": self.state.num_input_tokens_seen,
            }
            self._metrics.clear()
            total = sum(self._staleness_counts.values())
            for staleness, count in sorted(self._staleness_counts.items()):
                logs[f"async/staleness_hist/{staleness}"] = count / total
            self._staleness_counts.clear()
            if self._last_rollout_table is not None and self.accelerator.is_main_process:
                print_completions(self._last_rollout_table, self.args.num_completions_to_print)
        super().log(logs, start_time)

    # ------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Samples completions for the evaluation prompts and reports their mean rewards.

        Returns:
            `dict` with `{prefix}_reward` and `{prefix}_rewards/<name>/mean`.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (passed here or to the trainer).")
        rank, world = self.args.process_index, self.args.world_size
        indices = list(range(rank, len(dataset), world))
        chunk = max(self.args.prompts_per_generation, 1)
        sums = torch.zeros(len(self.reward_funcs) + 1, device=self.accelerator.device)
        counts = torch.zeros_like(sums)
        self._sampling = self.eval_generation_config  # num_generations_eval completions
        try:
            for start in range(0, len(indices), chunk):
                rows = [dataset[i] for i in indices[start : start + chunk]]
                rewards = self.score_rollouts(self.generate_rollouts(rows)).to(sums.device)
                total = weighted_rewards(rewards, self.reward_weights.to(sums.device))
                values = torch.cat([total.unsqueeze(1), rewards], dim=1)  # (N, 1 + F)
                valid = ~values.isnan()
                sums += values.nan_to_num().sum(0)
                counts += valid.sum(0)
        finally:
            self._sampling = self.generation_config
        sums = self.accelerator.reduce(sums, reduction="sum")
        counts = self.accelerator.reduce(counts, reduction="sum").clamp(min=1)
        means = (sums / counts).tolist()
        names = ["reward"] + [f"rewards/{name}/mean" for name in self.reward_names]
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in zip(names, means)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics
        )
        return metrics

    # ------------------------------------------------------ checkpoints, Hub

    def train(self, resume_from_checkpoint=None, **kwargs):
        """As `Trainer.train`; `resume_from_checkpoint=True` skips incomplete checkpoints (one
        whose writing was interrupted) and resumes from the last complete one."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No complete checkpoint in {self.args.output_dir} to resume from; pass "
                    "resume_from_checkpoint=None to start afresh."
                )
        elif isinstance(resume_from_checkpoint, str) and not is_complete_checkpoint(
            resume_from_checkpoint
        ):
            raise ValueError(
                f"{resume_from_checkpoint} is not a complete checkpoint (no readable "
                "trainer_state.json: its writing was interrupted). Resume from an earlier one."
            )
        if resume_from_checkpoint is not None:
            self._restore_rollout_state(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            if self._pipeline is not None:
                self._pipeline.close()
                self._pipeline = None
                if self._threads_before_async:
                    torch.set_num_threads(self._threads_before_async)

    def _save_rng_state(self, output_dir: str) -> None:
        """Also writes the rollout state (`checkpoints.save_rollout_state`): here every process
        writes its own, before `trainer_state.json` marks the checkpoint complete."""
        super()._save_rng_state(output_dir)
        args = self.args
        window = args.steps_per_generation * args.num_iterations
        inside_window = self.state.global_step * args.gradient_accumulation_steps % window != 0
        worker = self._pipeline.worker if self._pipeline is not None else None
        state = RolloutState(
            global_step=self.state.global_step,
            micro_batches=self._buffer if inside_window else None,
            in_flight=worker.in_flight() if isinstance(worker, ResumableWorker) else {},
            metrics=dict(self._metrics),
            staleness_counts=self._staleness_counts,
        )
        save_rollout_state(output_dir, state, args.process_index, args.world_size)

    def _restore_rollout_state(self, checkpoint: str) -> None:
        """Puts back what `_save_rng_state` saved: the buffered window, the in-flight batches
        (served to the next rollout worker) and the metrics not logged yet."""
        args = self.args
        state = load_rollout_state(
            checkpoint, self.accelerator.device, args.process_index, args.world_size
        )
        if state is None:
            window = args.steps_per_generation * args.num_iterations
            step = checkpoint_step(checkpoint)
            if step * args.gradient_accumulation_steps % window or args.max_staleness:
                warnings.warn(
                    f"{checkpoint} holds no rollout buffer (it was written by an older "
                    "version): the rollouts of the current generation window, or those in "
                    "flight, will be regenerated with the restored weights, so the resumed run "
                    "will differ from the uninterrupted one.",
                    stacklevel=3,
                )
            state = RolloutState(global_step=step)
        self._buffer = state.micro_batches
        self._resumed_rollouts = state.in_flight
        self._metrics.clear()
        self._metrics.update(state.metrics)
        self._staleness_counts = state.staleness_counts

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Saves the adapter under LoRA (the full model otherwise), the tokenizer and a model card."""
        super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            self.create_model_card(output_dir=output_dir)

    # The base model's Hub id, for a model loaded from a local folder (a downloaded or converted
    # copy): the pushed adapter_config.json and the card name it. None: the id the model was
    # loaded under, or the Hub cache folder it was loaded from; else the card says it has none.
    base_model_id: str | None = None

    def _base_model(self) -> tuple[str | None, str | None]:
        """(Hub id of the base model or None, the local folder it was loaded from or None)."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if is_peft_model(model) else model
        name_or_path = getattr(base.config, "_name_or_path", None) or None
        hub_id = hub.base_model_hub_id(name_or_path, given=self.base_model_id)
        local = name_or_path if name_or_path and os.path.exists(name_or_path) else None
        return hub_id, local

    def create_model_card(
        self, model_name=None, dataset_name=None, tags=None, output_dir=None, **_
    ):
        """Writes `README.md` with Hub metadata, the reward functions and the configuration.

        Sections in `trainer.model_card_sections` (title -> markdown) are appended, which is
        how the recipe adds its before/after table. The base model is named by its Hub id
        (`trainer.base_model_id` when set); a local folder is never presented as one.
        """
        model = self.accelerator.unwrap_model(self.model)
        base_model, local_base_model = self._base_model()
        card = hub.build_model_card(
            base_model=base_model,
            is_adapter=is_peft_model(model),
            reward_names=self.reward_names,
            config=self.args,
            model_name=model_name
            or self.args.hub_model_id
            or os.path.basename(self.args.output_dir),
            datasets=[dataset_name]
            if isinstance(dataset_name, str)
            else dataset_name or self.model_card_datasets,
            extra_sections=self.model_card_sections,
            tags=tags,
            local_base_model=local_base_model,
        )
        card.save(os.path.join(output_dir or self.args.output_dir, "README.md"))

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking=True,
        token=None,
        revision=None,
        extra_files: list[str] | None = None,
        **_,
    ):
        """Uploads the adapter (or model), tokenizer and model card, and nothing else.

        The files are saved afresh into a temporary folder and that folder is uploaded, so
        checkpoints, logs and metrics in `output_dir` stay local. The repository is
        `args.hub_model_id` (default: the output folder's name), private when
        `args.hub_private_repo` is set. The uploaded `adapter_config.json` names the base
        model by its Hub id (`trainer.base_model_id` when set, for a model loaded from a local
        copy), so `AutoPeftModelForCausalLM.from_pretrained(repo)` works anywhere; the adapter in
        `output_dir` keeps the local path.

        Args:
            extra_files (`list[str]`, *optional*): more files to upload beside them (for
                example a reward-curve image the model card shows).
        """
        self.save_model(self.args.output_dir, _internal_call=True)
        if not self.args.should_save:
            return None
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        base_model, local_base_model = self._base_model()
        return hub.push_staged(
            lambda folder: self.save_model(folder, _internal_call=True),
            repo_id=repo_id,
            base_model=base_model,
            local_base_model=local_base_model,
            is_adapter=is_peft_model(self.accelerator.unwrap_model(self.model)),
            extra_files=extra_files,
            private=self.args.hub_private_repo,
            token=token or self.args.hub_token,
            revision=revision or self.args.hub_revision,
            commit_message=commit_message or "End of training",
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints are not pushed: they hold optimizer states and, without LoRA, full
        weights. `push_to_hub()` uploads the adapter, tokenizer and card at the end."""

    def _save(self, output_dir: str | None = None, state_dict=None):
        # `training_args.bin` pickles the arguments: keep the Hub token out of it.
        token, self.args.hub_token = self.args.hub_token, None
        try:
            super()._save(output_dir, state_dict=state_dict)
        finally:
            self.args.hub_token = token
