"""What the trainer logs about each generation batch, as TRL names it, and the completions table.

Pure functions of gathered tensors: the trainer gathers them over processes and appends the
values to its running metrics, which `log` averages. `RewardLogs` holds what reward functions log
through TRL's `log_metric` and `log_extra` keyword arguments.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from .objective import weighted_rewards


def reward_metrics(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, names: list[str]
) -> dict[str, float]:
    """`reward`, `reward_std` (over the whole batch, as TRL), `frac_reward_zero_std` and, per
    reward function, `rewards/<name>/mean` and `/std` over the rows where it applied: NaN when
    it applied to none (the std: to fewer than two), as TRL logs them. Also
    `reward_std_in_groups`, the mean standard deviation within groups: the spread the
    group-relative advantage divides by.

    Args:
        rewards (`torch.Tensor`): `(N, F)` rewards of all processes, NaN for "not applicable".
        weights (`torch.Tensor`): `(F,)` reward weights.
    """
    total = weighted_rewards(rewards, weights.to(rewards.device))  # (N,)
    group_std = total.view(-1, group_size).std(dim=1)  # (groups,)
    nan = float("nan")
    scored = total[~total.isnan()]
    metrics = {
        "reward": total.nanmean().item(),
        "reward_std": scored.std().item() if len(scored) > 1 else nan,
        "reward_std_in_groups": group_std.nanmean().item(),
        "frac_reward_zero_std": (group_std < 1e-6).float().mean().item(),
    }
    for index, name in enumerate(names):
        column = rewards[:, index]
        valid = column[~column.isnan()]
        metrics[f"rewards/{name}/mean"] = valid.mean().item() if len(valid) else nan
        metrics[f"rewards/{name}/std"] = valid.std().item() if len(valid) > 1 else nan
    return metrics


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """`completions/{mean,min,max}_length`, `completions/clipped_ratio` (the fraction that
    hit `max_completion_length`) and `completions/{mean,min,max}_terminated_length` (of those
    that ended; 0 when none did, as TRL), from `(N,)` lengths and truncation flags of all
    processes."""
    lengths = lengths.float()
    terminated = lengths[~truncated.bool()]
    if len(terminated) == 0:
        terminated = lengths.new_zeros(1)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
    }


def rollout_metrics(rollout, rewards, weights, names, gather) -> tuple[dict[str, float], int]:
    """The reward and length metrics of a generation batch, and its prompt and completion token
    count, over all processes.

    Args:
        rewards (`torch.Tensor`): `(N, F)` rewards of all processes.
        gather (`Callable[[Tensor], Tensor]`): concatenates a tensor over processes.

    Lengths count the model's own tokens, not tool results (as TRL); with tools,
    `tools/call_frequency` is the tool calls per rollout and `tools/failure_frequency` the
    fraction of calls that came back as errors.
    """
    own = rollout.completion_mask
    if rollout.tool_mask is not None:
        own = own * rollout.tool_mask
    lengths, truncated = gather(own.sum(dim=1)), gather(rollout.is_truncated)
    metrics = {
        **reward_metrics(rewards, weights, rollout.group_size, names),
        **length_metrics(lengths, truncated),
    }
    if rollout.tool_calls is not None:
        calls, failures = gather(rollout.tool_calls), gather(rollout.tool_failures)
        total = calls.sum().item()
        metrics["tools/call_frequency"] = total / len(calls)
        metrics["tools/failure_frequency"] = failures.sum().item() / total if total else 0.0
    tokens = gather((rollout.prompt_mask.sum() + rollout.completion_mask.sum()).reshape(1))
    return metrics, int(tokens.sum().item())


def completions_table(rollout, rewards, names, advantages, extra=None) -> dict[str, list]:
    """The columns of the completions table, as TRL's: prompt, completion, each reward, the
    columns reward functions logged with `log_extra`, advantage."""
    return {
        "prompt": rollout.prompts,
        "completion": rollout.completions,
        **{name: rewards[: len(rollout), i].tolist() for i, name in enumerate(names)},
        **(extra or {}),
        "advantage": advantages.tolist(),
    }


def print_completions(table: dict[str, list], limit: int | None) -> None:
    """Prints sample prompts, completions and rewards as a plain-text table."""
    rows = list(zip(*table.values()))[:limit]

    def cell(value, width=40):
        text = (
            value
            if isinstance(value, str)
            else (f"{value:.3f}" if isinstance(value, float) else str(value))
        )
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 1] + "…"

    header = " | ".join(cell(name, 40 if i < 2 else 10) for i, name in enumerate(table))
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" | ".join(cell(value, 40 if i < 2 else 10) for i, value in enumerate(row)))


class RewardLogs:
    """What reward functions log while they score a batch, through the keyword arguments that
    TRL 1.16 passes them: `log_metric(name, value)`, a scalar averaged and logged with the
    built-in metrics, and `log_extra(column, values)`, a column of the completions table (one
    value per completion). The trainer takes both out after each scoring."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        """Logs the scalar `value` as the metric `name` (averaged over the calls of a step)."""
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """Adds `values` (one per completion) as the column `column` of the completions table."""
        self.extra[column].extend(values)

    def take_metrics(
        self,
        gather_names: Callable[[list[str]], list[str]] | None = None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """The mean of each metric logged since the last call, over all processes as TRL: the sum
        of the values of all processes over their count. Without `gather_names` (the names logged
        on any process) and `gather` (concatenates a tensor over processes), this process's."""
        names = sorted(self.metrics)
        if gather_names is not None:  # every process gathers the same names, in one order
            names = sorted(set(gather_names(names)))
        if not names:
            return {}
        sums = torch.tensor(
            [[sum(self.metrics.get(name, [])), len(self.metrics.get(name, []))] for name in names],
            dtype=torch.float64,
        )  # (K, 2)
        if gather is not None:
            sums = gather(sums).view(-1, len(names), 2).sum(dim=0).cpu()  # (K, 2)
        self.metrics.clear()
        return {name: total / count for name, (total, count) in zip(names, sums.tolist())}

    def take_extra(self, num_completions: int | None) -> dict[str, list]:
        """The columns logged since the last call, each with `num_completions` values; None when
        the rows of the batch are not those that were scored (dynamic sampling reorders and
        resamples them): then none."""
        extra = dict(self.extra)
        self.extra.clear()
        if num_completions is None:
            return {}
        for column, values in extra.items():
            if len(values) != num_completions:
                raise ValueError(
                    f"log_extra({column!r}, ...) was given {len(values)} values for a batch of "
                    f"{num_completions} completions; give one value per completion."
                )
        return extra
