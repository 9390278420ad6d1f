"""`GroupRelativeTrainer.evaluate()`: the rewards, lengths and tool use of completions for the
evaluation prompts, under TRL's metric names.

Each process samples, through the trainer's own `generate_rollouts` and `score_rollouts` (so a
subclass that overrides them is evaluated with its overrides), `num_generations_eval`
completions for every `world_size`-th prompt, `prompts_per_generation` prompts at a time.
`reward` and `rewards/<name>/mean` are means over all processes and all completions where a
reward applies (NaN entries, "not applicable", are left out of that reward's mean). The other
metrics of a training batch (`metrics.rollout_metrics`: `reward_std`, `completions/*`,
`tools/*` with tools) are computed per batch and averaged over the batches, NaN left out, as
TRL averages its evaluation metrics. The math benchmark evaluation with pass@k is
`evaluation.py`.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .metrics import rollout_metrics
from .objective import weighted_rewards


@torch.no_grad()
def mean_rewards(trainer, dataset, metric_key_prefix: str = "eval") -> dict[str, float]:
    """The evaluation metrics of `dataset`, each named `{prefix}_<training metric>`.

    Args:
        trainer ([`GroupRelativeTrainer`]): samples and scores the completions.
        dataset (`datasets.Dataset`): rows with a `prompt`, as the training data.
        metric_key_prefix (`str`, *optional*, defaults to `"eval"`): prefix of the keys.

    Returns:
        `dict` with `{prefix}_reward`, `{prefix}_rewards/<name>/mean` and the other rollout
        metrics, equal on every process.
    """
    args, accelerator = trainer.args, trainer.accelerator
    indices = list(range(args.process_index, len(dataset), args.world_size))
    chunk = max(args.prompts_per_generation, 1)
    sums = torch.zeros(len(trainer.reward_funcs) + 1, device=accelerator.device)
    counts = torch.zeros_like(sums)
    batches: dict[str, list[float]] = defaultdict(list)  # per-batch values of the other metrics
    with trainer.rollouts.evaluating():  # num_generations_eval completions per prompt
        for start in range(0, len(indices), chunk):
            rows = [dataset[i] for i in indices[start : start + chunk]]
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
    sums = accelerator.reduce(sums, reduction="sum")
    counts = accelerator.reduce(counts, reduction="sum").clamp(min=1)
    means = (sums / counts).tolist()
    names = ["reward"] + [f"rewards/{name}/mean" for name in trainer.reward_names]
    exact = dict(zip(names, means))
    return {
        f"{metric_key_prefix}_{name}": value
        for name, value in {**_batch_means(batches, accelerator, exact), **exact}.items()
    }


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
