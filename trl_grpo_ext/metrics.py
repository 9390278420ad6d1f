"""What the trainer logs about each generation batch, as TRL names it, and the completions table.

Pure functions of gathered tensors: the trainer gathers them over processes and appends the
values to its running metrics, which `log` averages.
"""

from __future__ import annotations

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


def completions_table(rollout, rewards, names, advantages) -> dict[str, list]:
    """The columns `print_completions` shows: prompt, completion, each reward, advantage."""
    return {
        "prompt": rollout.prompts,
        "completion": rollout.completions,
        **{name: rewards[: len(rollout), i].tolist() for i, name in enumerate(names)},
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
