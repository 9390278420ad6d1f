"""`GroupRelativeTrainer.evaluate()`: the mean rewards of completions for evaluation prompts.

Each process samples, through the trainer's own `generate_rollouts` and `score_rollouts` (so a
subclass that overrides them is evaluated with its overrides), `num_generations_eval`
completions for every `world_size`-th prompt, `prompts_per_generation` prompts at a time. The
means are over all processes and all completions where a reward applies (NaN entries, "not
applicable", are left out of that reward's mean). The math benchmark evaluation with pass@k is
`evaluation.py`.
"""

from __future__ import annotations

import torch

from .objective import weighted_rewards


@torch.no_grad()
def mean_rewards(trainer, dataset, metric_key_prefix: str = "eval") -> dict[str, float]:
    """The mean weighted reward and the mean of each reward function on `dataset`.

    Args:
        trainer ([`GroupRelativeTrainer`]): samples and scores the completions.
        dataset (`datasets.Dataset`): rows with a `prompt`, as the training data.
        metric_key_prefix (`str`, *optional*, defaults to `"eval"`): prefix of the keys.

    Returns:
        `dict` with `{prefix}_reward` and `{prefix}_rewards/<name>/mean`, equal on every process.
    """
    args, accelerator = trainer.args, trainer.accelerator
    indices = list(range(args.process_index, len(dataset), args.world_size))
    chunk = max(args.prompts_per_generation, 1)
    sums = torch.zeros(len(trainer.reward_funcs) + 1, device=accelerator.device)
    counts = torch.zeros_like(sums)
    with trainer.rollouts.evaluating():  # num_generations_eval completions per prompt
        for start in range(0, len(indices), chunk):
            rows = [dataset[i] for i in indices[start : start + chunk]]
            rewards = trainer.score_rollouts(trainer.generate_rollouts(rows)).to(sums.device)
            total = weighted_rewards(rewards, trainer.reward_weights.to(sums.device))
            values = torch.cat([total.unsqueeze(1), rewards], dim=1)  # (N, 1 + F)
            valid = ~values.isnan()
            sums += values.nan_to_num().sum(0)
            counts += valid.sum(0)
    sums = accelerator.reduce(sums, reduction="sum")
    counts = accelerator.reduce(counts, reduction="sum").clamp(min=1)
    means = (sums / counts).tolist()
    names = ["reward"] + [f"rewards/{name}/mean" for name in trainer.reward_names]
    return {f"{metric_key_prefix}_{name}": value for name, value in zip(names, means)}
