"""`GroupRelativeTrainer.evaluate()`: the rewards, lengths and tool use of completions for the
evaluation prompts, under TRL's metric names.

Each process samples, through the trainer's own `generate_rollouts` and `score_rollouts` (so a
subclass that overrides them is evaluated with its overrides), `num_generations_eval`
completions for every `world_size`-th prompt, `prompts_per_generation` prompts at a time.
`reward` and `rewards/<name>/mean` are means over all processes and all completions where a
reward applies (NaN entries, "not applicable", are left out of that reward's mean). The other
metrics of a training batch (`metrics.rollout_metrics`: `reward_std`, `completions/*`,
`tools/*` with tools) are computed per batch and averaged over the batches, NaN left out, as
TRL averages its evaluation metrics. `loss` is TRL's evaluation loss (`objective_of_batches`):
the objective of each batch of `per_device_eval_batch_size` completions at the current weights,
averaged over the batches of all processes, with the objective's own metrics (`entropy`,
`clip_ratio/*`, `kl`) beside it. The math benchmark evaluation with pass@k is `evaluation.py`.

A recipe that evaluates with it (`recipes/vlm_math.py`) records each evaluation's accuracy in its
`metrics.jsonl` with `HeldOutRewardCallback` and reports before and after with `rewards_table`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch
from datasets import IterableDataset
from transformers import TrainerCallback

from .batches import split_micro_batches, training_tensors
from .metrics import rollout_metrics
from .objective import group_advantages, weighted_rewards
from .preparation import eval_set_by_name


@torch.no_grad()
def mean_rewards(trainer, dataset, metric_key_prefix: str = "eval") -> dict[str, float]:
    """The evaluation metrics of `dataset`, each named `{prefix}_<training metric>`.

    Args:
        trainer ([`GroupRelativeTrainer`]): samples and scores the completions.
        dataset (`datasets.Dataset` or `datasets.IterableDataset`): rows with a `prompt`, as
            the training data; a stream is read to its end.
        metric_key_prefix (`str`, *optional*, defaults to `"eval"`): prefix of the keys.

    Returns:
        `dict` with `{prefix}_reward`, `{prefix}_rewards/<name>/mean` and the other rollout
        metrics, equal on every process.
    """
    args, accelerator = trainer.args, trainer.accelerator
    rows_here = rows_of_process(dataset, args.process_index, args.world_size)
    chunk = max(args.prompts_per_generation, 1)
    sums = torch.zeros(len(trainer.reward_funcs) + 1, device=accelerator.device)
    counts = torch.zeros_like(sums)
    batches: dict[str, list[float]] = defaultdict(list)  # per-batch values of the other metrics
    with trainer.rollouts.evaluating():  # num_generations_eval completions per prompt
        while rows := list(itertools.islice(rows_here, chunk)):
            rollout = trainer.generate_rollouts(rows)
            rewards = trainer.score_rollouts(rollout).to(sums.device)
            for key, value in trainer.reward_logs.take_metrics().items():  # `log_metric`
                batches[key].append(value)
            trainer.reward_logs.take_extra(None)  # the completions table is of training batches
            total = weighted_rewards(rewards, trainer.reward_weights.to(sums.device))
            values = torch.cat([total.unsqueeze(1), rewards], dim=1)  # (N, 1 + F)
            valid = ~values.isnan()
            sums += values.nan_to_num().sum(0)
            counts += valid.sum(0)
            metrics, _ = rollout_metrics(
                rollout, rewards, trainer.reward_weights, trainer.reward_names, lambda t: t
            )
            for key, value in metrics.items():
                batches[key].append(value)
            for metrics in objective_of_batches(trainer, rollout, rewards):
                for key, value in metrics.items():
                    batches[key].append(value)
    sums = accelerator.reduce(sums, reduction="sum")
    counts = accelerator.reduce(counts, reduction="sum").clamp(min=1)
    means = (sums / counts).tolist()
    names = ["reward"] + [f"rewards/{name}/mean" for name in trainer.reward_names]
    exact = dict(zip(names, means))
    return {
        f"{metric_key_prefix}_{name}": value
        for name, value in {**_batch_means(batches, accelerator, exact), **exact}.items()
    }


def objective_of_batches(trainer, rollout, rewards: torch.Tensor) -> list[dict[str, float]]:
    """TRL's evaluation loss on a rollout: `trainer.compute_objective` on each batch of
    `per_device_eval_batch_size` completions, the model in eval mode (dropout off) and at the
    weights that sampled them, so the ratio is 1 and the loss is the advantage term aggregated by
    `loss_type`, plus the KL to the reference with `beta`. The advantages are those of the
    rollout's groups of `num_generations_eval` (on this process), and no batch is divided by the
    accumulation steps: one batch, as TRL's `prediction_step` computes it.

    Returns:
        each batch's `{"loss": ..., **objective metrics}`.
    """
    args, device = trainer.args, trainer.accelerator.device
    group = args.num_generations_eval or args.num_generations
    if group == args.num_generations:  # a subclass's compute_advantages, where it applies
        advantages = trainer.compute_advantages(rewards)
    else:
        advantages = group_advantages(
            rewards,
            group,
            weights=trainer.reward_weights,
            scale=args.scale_rewards,
            multi_objective_aggregation=args.multi_objective_aggregation,
        )
    tensors = training_tensors(
        rollout, advantages, device, mask_truncated=args.mask_truncated_completions
    )
    size = args.per_device_eval_batch_size
    if args.beta > 0:
        tensors["ref_logps"] = trainer._reference_logps(tensors, size)
    # Each batch's own tokens divide "dapo" (compute_objective divides by the process count).
    batches = split_micro_batches(tensors, size, 1, lambda tokens: tokens * args.world_size)
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        results = []
        for batch in batches:
            loss, metrics = trainer.compute_objective(model, batch)
            results.append({"loss": loss.item(), **metrics})
    finally:
        model.train(was_training)
    return results


def rows_of_process(dataset, rank: int, world_size: int):
    """Rows `rank`, `rank + world_size`, ... of a `Dataset` or a stream, in order (each process
    reads the whole stream)."""
    if isinstance(dataset, IterableDataset):
        return (row for index, row in enumerate(dataset) if index % world_size == rank)
    return (dataset[index] for index in range(rank, len(dataset), world_size))


def _batch_means(batches: dict[str, list[float]], accelerator, leave_out) -> dict[str, float]:
    """The mean over all processes' batches of each metric, NaN values left out (None where
    every value was NaN, as TRL logs it)."""
    keys = sorted(batches)
    if accelerator.num_processes > 1:  # a process with no prompt has no keys
        keys = sorted({key for keys in accelerator.gather_object([keys]) for key in keys})
    keys = [key for key in keys if key not in leave_out]
    valid = {key: [v for v in batches.get(key, []) if v == v] for key in keys}  # v == v: not NaN
    totals = torch.tensor(
        [[sum(valid[key]), len(valid[key])] for key in keys] or [[0.0, 0.0]],
        device=accelerator.device,
        dtype=torch.float64,
    )
    totals = accelerator.reduce(totals, reduction="sum")
    return {
        key: (total / count if count else None)
        for key, (total, count) in zip(keys, totals.tolist())
    }


class HeldOutRewardCallback(TrainerCallback):
    """Appends the accuracy of every `trainer.evaluate()` to a recipe's `metrics.jsonl`, as
    `heldout/accuracy` with the step and `heldout/label` (the `label` attribute: set it to
    "before" or "after" around the recipe's own calls; evaluations during training are
    "periodic", but the one the Trainer makes at the last step, "after"), which
    `evaluation.plot_training_curve` draws. `last` is `(step, metrics)` of the latest.

    Args:
        path (`str`): the `metrics.jsonl` to append to.
        accuracy_key (`str`): the metric read as the accuracy, e.g.
            `"eval_rewards/math_accuracy/mean"`.
    """

    def __init__(self, path: str, accuracy_key: str):
        self.path, self.accuracy_key, self.label = path, accuracy_key, "periodic"
        self.last: tuple[int, dict] | None = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        from .evaluation import append_jsonl

        self.last = (state.global_step, metrics)
        label = self.label
        if label == "periodic" and state.max_steps and state.global_step >= state.max_steps:
            label = "after"
        if metrics and self.accuracy_key in metrics and state.is_world_process_zero:
            record = {"heldout/accuracy": metrics[self.accuracy_key], "heldout/label": label}
            append_jsonl(self.path, {"step": state.global_step, **record})
        return control


def rewards_table(before: dict, after: dict, prefix: str = "eval") -> str:
    """A markdown table of two `evaluate()` results: the total reward, each reward's mean and
    the mean completion length, before and after training."""
    names = [f"{prefix}_reward"] + sorted(
        key for key in before if key.startswith(f"{prefix}_rewards/") and key.endswith("/mean")
    )
    names.append(f"{prefix}_completions/mean_length")

    def cell(value) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = ["| held-out, sampled | before | after |", "| --- | --- | --- |"]
    for name in names:
        if name in before or name in after:
            label = name[len(prefix) + 1 :]
            lines.append(f"| {label} | {cell(before.get(name))} | {cell(after.get(name))} |")
    return "\n".join(lines)


class EvaluationMixin:
    """The trainer's `evaluate()`, over `mean_rewards`."""

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Samples completions for the evaluation prompts, scores them, and reports TRL's
        evaluation loss and metrics.

        Args:
            eval_dataset (`Dataset`, `IterableDataset`, `dict`, `DatasetDict` or `str`, *optional*):
                The prompts; defaults to the trainer's `eval_dataset`. Several sets (a dict)
                are each evaluated, their metrics named `{prefix}_<name>_...`, as in
                `transformers.Trainer`; a `str` evaluates the trainer's set of that name.
            metric_key_prefix (`str`, *optional*, defaults to `"eval"`): prefix of the keys.

        Returns:
            `dict` with `{prefix}_loss` (the objective on the sampled completions at the current
            weights, TRL's `eval_loss`), `{prefix}_reward`, `{prefix}_rewards/<name>/mean` and
            the other rollout and objective metrics.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (passed here or to the trainer).")
        if isinstance(dataset, str):
            dataset = eval_set_by_name(self.eval_dataset, dataset)
        if isinstance(dataset, dict):  # several sets, a DatasetDict among them
            metrics = {}
            for name, each in dataset.items():
                metrics.update(self.evaluate(each, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        metrics = mean_rewards(self, dataset, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics
        )
        return metrics
