"""`GroupRelativeTrainer`: GRPO as a `transformers.Trainer` subclass.

One optimizer step, on each process:
1. `generate_rollouts`: sample G completions for each prompt of the generation batch, through
   `self.rollouts` (`generation.producer.RolloutProducer`, the one generation path);
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

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from functools import cached_property

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, Trainer, set_seed

from . import preparation
from .batches import image_model_inputs, split_micro_batches, step_tokens, training_tensors
from .checkpoints import epoch_micro_step
from .config import GroupRelativeConfig
from .dynamic_sampling import random_rows, sample_informative
from .entropy_control import EntropyControl
from .eval_rewards import EvaluationMixin
from .generation import check_prompt_dataset
from .generation.images import text_tokenizer
from .generation.rollout import Rollout, eos_token_ids
from .generation.transformers_engine import generation_seed, seeded
from .hub import HubMixin
from .liger import prepare_liger_kernel
from .logprobs import completion_logprobs, no_grad_logprobs
from .metrics import (
    RewardLogs,
    completions_table,
    extremes_over_processes,
    log_completions,
    rollout_metrics,
    staleness_shares,
    step_means,
    warn_if_nothing_trains,
)
from .models import load_policy, prepare_policy
from .objective import (
    LOSS_TYPE_TABLE,
    LossSettings,
    group_advantages,
    policy_loss,
)
from .off_policy import behaviour_correction
from .resume_weights import FullWeightsMixin
from .router_loss import captured_aux_losses, router_aux_loss_coef, with_aux_loss
from .sampler import collate_rows, micro_batches_per_epoch, train_dataloader
from .scoring import call_reward_funcs
from .trainer_checkpoints import RolloutCheckpointsMixin
from .trl_helpers import TrlHelpersMixin

# A reward function, a registry name or import path, a reward model, or its folder or Hub id.
RewardSpec = Callable | str | PreTrainedModel


class GroupRelativeTrainer(
    TrlHelpersMixin,
    EvaluationMixin,
    RolloutCheckpointsMixin,
    HubMixin,
    FullWeightsMixin,
    Trainer,
):
    """Trains a causal language model with GRPO.

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            A hub id or local folder (loaded with `AutoModelForCausalLM`, or for a
            vision-language model `AutoModelForImageTextToText`, and `args.model_init_kwargs`),
            or a model object.
        reward_funcs (callable, `str`, `PreTrainedModel`, or a list of them):
            Reward functions in TRL's convention, registry names (`"math_accuracy"`), dotted
            import paths (`"my_pkg.rewards:score"`), or reward models: a `PreTrainedModel` for
            sequence classification, or its local folder or Hub id (`"org/name"`), loaded with
            `AutoModelForSequenceClassification` (`num_labels=1`, `args.model_init_kwargs`); its
            first logit on prompt + completion is the reward (`rewards.model.RewardModel`).
        args ([`GroupRelativeConfig`], *optional*):
            Training configuration; defaults to `GroupRelativeConfig("<model name>-GRPO")`.
        train_dataset (`datasets.Dataset` or `datasets.IterableDataset`, *optional*):
            Dataset (or stream, with `max_steps` set) with a `prompt` column: a string
            (standard) or a list of messages (conversational, rendered with the tokenizer's
            chat template). Other columns are passed to the reward functions, one entry per
            completion. Images, as TRL takes them:
            an `image` or `images` column, or `{"type": "image"}` parts in conversational
            prompts; single-turn rollouts on the transformers engine only for now (other paths
            are an error, `generation/images.py`).
        eval_dataset (`datasets.Dataset`, `datasets.IterableDataset` or a `dict`, *optional*):
            Prompts for `evaluate()`, in the same format (a stream is read to its end); several
            named sets (a dict or a `DatasetDict`) are each evaluated, as `eval_<name>_...`.
        processing_class (`PreTrainedTokenizerBase` or `ProcessorMixin`, *optional*):
            Tokenizer, or a vision-language model's processor (needed for images); loaded from
            the model's folder when omitted (`AutoProcessor` for a vision-language model).
        reward_processing_classes (`PreTrainedTokenizerBase` or `list`, *optional*):
            The tokenizers of the reward models: one per reward function (entries for functions
            are ignored), or a single one when there is one reward function. `None`, or a `None`
            entry, loads the reward model's own with `AutoTokenizer.from_pretrained`.
        callbacks (`list[TrainerCallback]`, *optional*):
            As in `transformers.Trainer`.
        optimizers (`tuple`, *optional*, defaults to `(None, None)`):
            As in `transformers.Trainer`: an optimizer and a learning-rate scheduler.
        quantization_config (`transformers.BitsAndBytesConfig`, *optional*):
            Passed to `from_pretrained` when `model` is a name (with `peft_config`: QLoRA). An
            error with a model object, which is loaded already.
        peft_config (`peft.PeftConfig`, *optional*):
            Wraps the model with these adapters; only they are trained.
        tools (`list[Callable]`, *optional*):
            Functions the model may call (sync or async), with type hints and a Google-style
            docstring, from which the chat template renders their schemas. Rollouts become
            multi-turn: a call the model writes is run, its result appended as tokens, and the
            model continues (docs/agents.md).
        rollout_func (`Callable`, *optional*):
            Samples the rollouts instead of the trainer (TRL's contract):
            `rollout_func(prompts, trainer)` gets each prompt once per completion and returns a
            dict with `prompt_ids`, `completion_ids` and `logprobs` (or None) per completion,
            optionally `env_mask` (0 on tokens the model did not sample) and more fields, which
            the reward functions receive.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
            Builds one environment per rollout (TRL's contract): `reset(**row)` may return text
            appended to the last user message, its public methods are tools, and `get_reward()`,
            if defined, is one more reward (named after its class, weight 1). Reward functions
            receive the rollouts' environments as `environments`. A dict chooses one per row by
            its `environment` column. Without `train_dataset`, `reset()` supplies the prompts
            and `max_steps` sets the length of the run. `trainer.environments` holds those of
            the latest generation batch, and `trainer.tools` every tool, as in TRL.
    """

    _tag_names = ["trl_grpo_ext", "grpo"]
    # compute_objective already scales the loss for gradient accumulation (see its docstring).
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardSpec | list[RewardSpec] | None = None,
        args: GroupRelativeConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        args = preparation.trainer_config(model, args)
        preparation.check_as_trl(args, train_dataset, environment_factory, eval_dataset)
        prepare_liger_kernel(args)  # TRL's checks; Liger's kernels need a GPU
        set_seed(args.seed)  # adapters and heads initialised below are reproducible
        model, processing_class = load_policy(model, args, processing_class, quantization_config)
        self.agent = preparation.agent(tools, environment_factory, rollout_func, args)
        self.rollout_func = rollout_func
        (
            self.reward_funcs,
            self.reward_names,
            self.reward_weights,
            self.reward_processing_classes,
        ) = preparation.prepare_rewards(reward_funcs, reward_processing_classes, args, self.agent)
        if environment_factory is not None:
            train_dataset = preparation.environment_dataset(
                train_dataset, environment_factory, args
            )
        datasets = {"train_dataset": train_dataset, **preparation.named_eval_sets(eval_dataset)}
        first_rows = {
            split: check_prompt_dataset(
                processing_class, dataset, split, environment_factory is None
            )
            for split, dataset in datasets.items()
        }
        preparation.check_images(processing_class, datasets, first_rows, args, rollout_func)

        engine_folder = preparation.colocated_engine_folder(model, processing_class, args)
        model, self.ref_model = prepare_policy(model, args, peft_config)

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
        preparation.place_reward_and_reference_models(self)
        self.eos_token_ids = eos_token_ids(model, text_tokenizer(processing_class))
        self.rollouts = preparation.rollout_producer(self, model, engine_folder)
        self.environments: list | None = None  # those of the latest generation batch, as TRL
        self.entropy_control = EntropyControl(args)  # entropy_coef, static or adaptive
        # MoE load-balancing loss, TRL's names (router_loss.py)
        self.router_aux_loss_coef, self.aux_loss_enabled = router_aux_loss_coef(model, args)
        self._buffer: list[dict] | None = None
        self._train_loader = None  # of the latest train(), whose workers it ends
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._last_rollout_table: dict[str, list] | None = None
        self._warned_all_truncated = False  # `metrics.warn_if_nothing_trains`, once per run
        self._step_started = time.perf_counter()  # of the current optimizer step: `step_time`
        self.reward_logs = RewardLogs()  # what reward functions log: `log_metric`, `log_extra`
        self.model_card_sections: dict[str, str] = {}
        self.model_card_datasets: list[str] = []  # Hub dataset ids for the card's metadata
        preparation.end_distributed_at_exit(self)

    @property
    def tools(self) -> list:
        """The functions the model may call, as TRL's `GRPOTrainer.tools`: `tools`, then the tool
        methods of each environment of `environment_factory` (`reset` and `get_reward` are not
        tools); empty without either."""
        return [] if self.agent is None else self.agent.functions

    @cached_property
    def loss_settings(self) -> LossSettings:
        """The hyper-parameters of `objective.policy_loss`, read from `args` once, on first use."""
        return LossSettings.from_config(self.args)

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self) -> DataLoader:
        self._train_loader = train_dataloader(self.train_dataset, self.args)
        return self._train_loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Pulls the prompts of one optimizer step and returns its micro-batches of rollouts."""
        args = self.args
        self._step_started = time.perf_counter()
        if not args.max_staleness:  # None, or 0: the synchronous trainer
            prompt_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        else:
            prompt_batches = self.rollouts.pull(epoch_iterator, num_batches)
        first = self.state.global_step * args.gradient_accumulation_steps
        in_epoch = epoch_micro_step(self.state.global_step, args, self.micro_batches_per_epoch)
        window = args.steps_per_generation * args.num_iterations
        micro_batches = []
        for offset, rows in enumerate(prompt_batches):
            slot = (in_epoch + offset) % window
            if slot == 0 or self._buffer is None:
                # Generation batches are numbered; each samples from its own seed.
                self._buffer = self._make_generation_batch(rows, (first + offset) // window)
            micro_batches.append(self._buffer[slot % args.steps_per_generation])
        if args.steps_per_generation % args.gradient_accumulation_steps and micro_batches:
            # This step's micro-batches come from two generation batches: count its own tokens.
            tokens = step_tokens(micro_batches, self._sum_over_processes)
            micro_batches = [{**batch, "num_items_in_batch": tokens} for batch in micro_batches]
        return micro_batches, micro_batches[0]["num_items_in_batch"] if micro_batches else None

    @cached_property
    def micro_batches_per_epoch(self) -> int | None:
        """Micro-batches per epoch of the training data loader (None for a stream)."""
        return micro_batches_per_epoch(self.train_dataset, self.args)

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    # --------------------------------------------------------- override points

    def generate_rollouts(self, rows: list[dict]) -> Rollout:
        """Samples `num_generations` completions for each dataset row (one generation batch).

        Called for every generation batch in every mode. With `max_staleness` set, the batch
        comes from the rollout worker, which sampled it ahead from the same rows; an override
        that changes the rows before calling this method has them sampled again, now.

        Args:
            rows (`list[dict]`): dataset rows, each with a `prompt`.

        Returns:
            [`Rollout`] with `len(rows) * num_generations` completions, groups consecutive.
        """
        if self.rollout_func is not None:
            sample = lambda prompts: self.rollout_func(prompts, self)  # noqa: E731
            return self.rollouts.from_rollout_func(rows, sample, self.state.global_step)
        return self.rollouts.generate(rows, self.state.global_step)

    def score_rollouts(self, rollout: Rollout) -> torch.Tensor:
        """Calls every reward function on the rollout, with TRL's keyword arguments: the
        rollout's prompts, completions, `completion_ids`, dataset columns and `environments`,
        `trainer_state`, and `log_metric` and `log_extra` (`metrics.RewardLogs`).

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
            log_metric=self.reward_logs.log_metric,
            log_extra=self.reward_logs.log_extra,
            **({} if rollout.environments is None else {"environments": rollout.environments}),
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

        A micro-batch with no non-zero advantage (and `beta == 0`, one process) has a loss and
        gradient of exactly 0: it runs the model without gradient, for its metrics (TRL logs
        them on every micro-batch), and skips the backward pass.

        In `evaluate()` (the model in eval mode) the loss is TRL's evaluation loss: one batch,
        not divided by the accumulation steps, and the adaptive entropy coefficient is left as is.

        Returns:
            `(loss, metrics)`; metrics are floats, averaged over the micro-batches when logged.
        """
        args = self.args
        training = self.model.training  # False in evaluate(), as TRL tells them apart
        # The Trainer sets current_gradient_accumulation_steps in train(); a call outside it
        # (a subclass's test, say) takes the configured steps.
        steps = getattr(
            self, "current_gradient_accumulation_steps", args.gradient_accumulation_steps
        )
        accumulation = steps if training else 1
        no_signal = self._carries_no_signal(batch)
        aux_losses = captured_aux_losses(model) if self.aux_loss_enabled else nullcontext([])
        with torch.no_grad() if no_signal else nullcontext(), aux_losses as aux_losses:
            logps, entropy = self._token_logprobs(
                model, batch, return_entropy=True, router_logits=self.aux_loss_enabled
            )
        entropy_mask = None
        if args.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(
                entropy.detach(), batch["completion_mask"], 1 - args.top_entropy_quantile
            )
        importance_weights, off_policy_stats = self._behaviour_correction(batch, logps)
        settings = self.loss_settings
        loss, stats = policy_loss(
            logps,
            batch.get("old_logps"),
            batch["advantages"],
            batch["completion_mask"],
            settings,
            ref_logps=batch.get("ref_logps"),
            num_items_in_batch=batch["num_items_in_batch"] / args.world_size,
            importance_weights=importance_weights,
            entropy_mask=entropy_mask,
            sampling_logps=batch.get("behaviour_logps"),
            sequence_mask_fn=self.get_off_policy_mask,
        )
        stats.update(off_policy_stats)
        control = self.entropy_control
        if control.enabled:
            stats["policy_loss"] = loss.detach()  # TRL's metric: before accumulation scaling
        if LOSS_TYPE_TABLE[settings.loss_type].aggregation != "dapo":
            # The other aggregations are per-micro-batch means (see the docstring).
            loss = loss / accumulation
        mask = batch["completion_mask"]
        if control.enabled:
            step_ends = self.accelerator.sync_gradients and training
            loss = control.add_bonus(
                loss, entropy, mask, entropy_mask, accumulation,
                step_ends, self._sum_over_processes, record=training,
            )  # fmt: skip
            if step_ends:
                self._metrics["entropy_coef"].append(control.coef)
        if aux_losses:
            loss, stats["aux_loss"] = with_aux_loss(
                loss,
                aux_losses,
                self.router_aux_loss_coef,
                accumulation,
            )
        stats["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        # In evaluate(), processes may score different numbers of batches: no collective.
        gather = self.accelerator.gather if training else lambda tensor: tensor
        metrics = extremes_over_processes(stats, gather)
        if no_signal:
            # Every term of the loss is an advantage times something: the loss and its gradient
            # are exactly 0, so no backward pass. Zero gradients still reach the optimizer
            # (Adam's moments and weight decay step as usual).
            trainable = [p for p in model.parameters() if p.requires_grad]
            loss = sum(p.view(-1)[0] for p in trainable) * 0.0
        return loss, metrics

    # ------------------------------------------------------------------ internals

    def _behaviour_correction(self, batch: dict, logps: torch.Tensor):
        """Importance weights `pi_old / mu` for rollouts that carry the log-probs of the policy
        `mu` that sampled them (a vLLM engine, the asynchronous worker, a `rollout_func`), TRL's
        `vllm_importance_sampling_*` correction whatever the sampler, and their statistics;
        `(None, {})` otherwise."""
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
        if self.args.beta != 0 or self.entropy_control.enabled or self.aux_loss_enabled:
            return False
        if self.args.world_size > 1:
            return False
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        signal = (batch["advantages"] != 0).unsqueeze(1) & batch["completion_mask"].bool()
        return not bool(signal.any())

    def _token_logprobs(self, model, batch, return_entropy=False, router_logits=False):
        model_inputs = image_model_inputs(batch)
        if router_logits:  # a MoE's auxiliary loss, over every row in full (not packed), as TRL
            model_inputs["output_router_logits"] = True
        return completion_logprobs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_ids"],
            temperature=self.args.temperature,
            return_entropy=return_entropy,
            logprob_chunk_tokens=self.args.logprob_chunk_tokens,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
            model_inputs=model_inputs,
        )

    def _logps_in_chunks(self, model, tensors, chunk_size):
        """Log-probs of the sampling (or reference) policy, without gradient and with dropout
        off (`logprobs.no_grad_logprobs`)."""
        return no_grad_logprobs(self._token_logprobs, model, tensors, chunk_size)

    def _reference_logps(self, tensors: dict, chunk_size: int) -> torch.Tensor:
        """Log-probs of the reference policy: `ref_model`, or the base model without the adapter."""
        if self.ref_model is not None:
            return self._logps_in_chunks(self.ref_model, tensors, chunk_size)
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            return self._logps_in_chunks(self.model, tensors, chunk_size)

    def _sample(self, rows: list[dict], index: int, round_index: int = 0) -> Rollout:
        """Generation batch `index` through `generate_rollouts`, in every mode: sampled now
        from its own seed (synchronous), or taken from the rollout worker (`max_staleness`)."""
        args = self.args
        seed = generation_seed(args.seed, args.process_index, index, round_index)
        synchronous = not args.max_staleness  # max_staleness 0 is the synchronous trainer
        with self.rollouts.scheduled(index, round_index) as batch:
            with seeded(seed, self.accelerator.device) if synchronous else nullcontext():
                rollout = self.generate_rollouts(rows)
        if batch.staleness is not None:
            self._metrics["async/staleness"].append(float(batch.staleness))
        return rollout

    def _make_generation_batch(self, rows: list[dict], index: int = 0) -> list[dict]:
        args = self.args
        self.reward_logs.clear()  # what was logged outside a generation batch is not of it
        if args.dynamic_sampling:
            device = self.accelerator.device
            rollout, rewards, trainable, metrics = sample_informative(
                rows,
                sample=lambda rows, round_index: self._sample(rows, index, round_index),
                score=self.score_rollouts,
                draw_rows=lambda count, round_index: random_rows(
                    self.train_dataset,
                    count,
                    generation_seed(args.seed, args.process_index, index, round_index),
                ),
                fewest_kept=lambda kept: self.accelerator.reduce(
                    torch.tensor(float(kept), device=device), reduction="min"
                ).item(),
                reward_weights=self.reward_weights,
                group_size=args.num_generations,
                max_rounds=args.max_resample_rounds,
                pad_token_id=text_tokenizer(self.processing_class).pad_token_id,
            )
            for key, value in metrics.items():
                self._metrics[key].append(value)
        else:
            rollout = self._sample(rows, index)
            rewards, trainable = self.score_rollouts(rollout), None
        self.environments = rollout.environments
        rewards = rewards.to(self.accelerator.device)  # (N, F)
        all_rewards = self.accelerator.gather(rewards)  # (N * processes, F)
        all_advantages = self.compute_advantages(all_rewards)  # (N * processes,)
        local = len(rollout)
        start = self.accelerator.process_index * local
        advantages = all_advantages[start : start + local]  # (N,)
        self._record_rollout_metrics(rollout, all_rewards, all_advantages)

        tensors = training_tensors(
            rollout,
            advantages,
            self.accelerator.device,
            mask_truncated=args.mask_truncated_completions,
            trainable=trainable,
        )
        micro = args.per_device_train_batch_size
        # Later micro-batches of a generation batch see weights updated after sampling: they
        # need the sampling policy's log-probs. With one step per generation, the current
        # log-probs detached are the same numbers, so no extra forward pass is spent.
        # TRL's condition: sampling and optimizer steps are not aligned.
        if args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations):
            tensors["old_logps"] = self._logps_in_chunks(self.model, tensors, micro)
        if args.beta > 0:
            tensors["ref_logps"] = self._reference_logps(tensors, micro)

        return split_micro_batches(
            tensors,
            micro,
            args.gradient_accumulation_steps,
            self._sum_over_processes,
        )

    def _record_rollout_metrics(self, rollout: Rollout, all_rewards, all_advantages):
        gather = lambda tensor: self.accelerator.gather(tensor.to(self.accelerator.device))  # noqa: E731
        metrics, tokens = rollout_metrics(
            rollout, all_rewards, self.reward_weights, self.reward_names, gather
        )
        metrics.update(self.reward_logs.take_metrics(gather_object, gather))
        for key, value in metrics.items():
            self._metrics[key].append(value)
        self.state.num_input_tokens_seen += tokens
        if not self._warned_all_truncated:
            self._warned_all_truncated = warn_if_nothing_trains(
                metrics["completions/clipped_ratio"],
                self.args,
                self.state.global_step + 1,
                self.accelerator.is_main_process,
            )
        extra = self.reward_logs.take_extra(None if self.args.dynamic_sampling else len(rollout))
        if self.args.log_completions:
            self._last_rollout_table = completions_table(
                rollout, all_rewards, self.reward_names, all_advantages, extra, gather_object
            )

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # the optimizer step's last micro-batch: TRL's time
            self._metrics["step_time"].append(time.perf_counter() - self._step_started)
        return loss

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
        table = None
        if self._metrics and not any(key.startswith("eval_") for key in logs):
            means = step_means(self._metrics, self.accelerator.gather, self.accelerator.device)
            logs = {**logs, **means, "num_tokens": self.state.num_input_tokens_seen}
            logs.update(staleness_shares(self.rollouts.staleness_counts))
            self._metrics.clear()
            table = self._last_rollout_table if self.accelerator.is_main_process else None
        super().log(logs, start_time)
        if table is not None:  # printed and sent to the trackers after the step's metrics
            log_completions(table, self.state.global_step, self.args)
