"""What the trainer logs about each generation batch, as TRL names it, and the completions table.

Pure functions of gathered tensors: the trainer gathers them over processes and appends the
values to its running metrics, which `log` averages. `RewardLogs` holds what reward functions log
through TRL's `log_metric` and `log_extra` keyword arguments; `warn_if_nothing_trains` says when
overlong filtering leaves a generation batch nothing to train on.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import torch

from .objective import weighted_rewards

logger = logging.getLogger(__name__)

ALL_TRUNCATED = (
    "Every completion of the generation batch at step {step} reached max_completion_length "
    "({cap} tokens) without ending, and mask_truncated_completions=True leaves all of them out "
    "of the loss: the step trains nothing, and a policy that no longer ends within the cap gets "
    "no gradient to learn its way back. Raise max_completion_length, or set "
    "mask_truncated_completions=False (`completions/clipped_ratio` in the logs shows the share "
    "cut at the cap). Said once per run."
)


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


def warn_if_nothing_trains(clipped_ratio: float, args, step: int, main_process: bool) -> bool:
    """Logs `ALL_TRUNCATED` (on the main process) when every completion of a generation batch
    was cut at the cap under `args.mask_truncated_completions`; returns whether it applied."""
    applies = clipped_ratio == 1.0 and args.mask_truncated_completions
    if applies and main_process:
        logger.warning(ALL_TRUNCATED.format(step=step, cap=args.max_completion_length))
    return applies


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


def staleness_shares(counts: dict[int, int]) -> dict[str, float]:
    """`async/staleness_hist/<k>`: the share of the batches trained `k` steps after their
    weights, since the last log; empties `counts`."""
    shares = {
        f"async/staleness_hist/{k}": n / sum(counts.values()) for k, n in sorted(counts.items())
    }
    counts.clear()
    return shares


def step_means(metrics: dict[str, list[float]], gather, device) -> dict[str, float]:
    """The mean of each running metric since the last log, NaN values left out as TRL does (NaN
    when every value is), then over processes, which hold the same names.

    Args:
        metrics (`dict[str, list[float]]`): the values appended since the last log, by name.
        gather (`Callable[[Tensor], Tensor]`): concatenates a tensor over processes.
    """
    names = sorted(metrics)
    valid = [[value for value in metrics[name] if value == value] for name in names]  # not NaN
    means = torch.tensor(
        [sum(values) / len(values) if values else float("nan") for values in valid], device=device
    )  # (K,)
    means = gather(means.unsqueeze(0)).nanmean(dim=0)  # (processes, K) -> (K,)
    return dict(zip(names, means.tolist()))


def extremes_over_processes(stats: dict[str, torch.Tensor], gather) -> dict[str, float]:
    """The statistics of a micro-batch as floats; those named `..._min` / `..._max` (the clip
    ratios' per-sequence extremes) over all processes, as TRL gathers them, NaN left out.

    Args:
        stats (`dict[str, torch.Tensor]`): 0-d tensors, the same names on every process.
        gather (`Callable[[Tensor], Tensor]`): concatenates a tensor over processes.
    """
    metrics = {}
    for name, value in stats.items():
        extreme = {"_min": torch.min, "_max": torch.max}.get(name[-4:])
        if extreme is not None:
            values = gather(value.detach().float().reshape(1))  # (processes,)
            values = values[~values.isnan()]
            value = extreme(values) if len(values) else value
        metrics[name] = value.item()
    return metrics


def completions_table(rollout, rewards, names, advantages, extra, gather_object) -> dict[str, list]:
    """The completions table of a generation batch, all processes' rows, TRL's columns: prompt,
    completion, each reward, the `log_extra` columns (sorted by name, None on a process that did
    not log one), advantage.

    Args:
        rewards (`torch.Tensor`): `(N, F)` rewards of all processes.
        advantages (`torch.Tensor`): `(N,)` advantages of all processes.
        extra (`dict[str, list]`): this process's `log_extra` columns.
        gather_object (`Callable[[list], list]`): concatenates a list over processes.
    """
    columns = sorted(set(gather_object(list(extra))))
    return {
        "prompt": gather_object(list(rollout.prompts)),
        "completion": gather_object(list(rollout.completions)),
        **{name: rewards[:, i].tolist() for i, name in enumerate(names)},
        **{c: gather_object(list(extra.get(c, [None] * len(rollout)))) for c in columns},
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

    def clear(self) -> None:
        self.metrics.clear()
        self.extra.clear()

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


def table_trackers(report_to: list[str]) -> list:
    """The trackers of `report_to` that log tables, as TRL picks them: wandb when a run is
    active, and trackio."""
    trackers = []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            trackers.append(wandb)
    if "trackio" in report_to:
        import trackio

        trackers.append(trackio)
    return trackers


def log_completions(table: dict[str, list], step: int, args) -> None:
    """Prints the completions table (`args.num_completions_to_print` rows) and logs it whole, as
    TRL does, to the trackers in `args.report_to` that have tables (`table_trackers`), as
    `completions`: one row per completion of the latest generation batch, first column `step`."""
    print_completions(table, args.num_completions_to_print)
    trackers = table_trackers(args.report_to or [])
    if trackers:
        import pandas

        frame = pandas.DataFrame({"step": [step] * len(table["prompt"]), **table})
        if args.log_unique_prompts:  # conversations compared by their text, as TRL
            frame = frame[~frame["prompt"].astype(str).duplicated()]
        for tracker in trackers:
            tracker.log({"completions": tracker.Table(dataframe=frame)})


def pooled_entropies(accelerator, entropy, completion_mask) -> torch.Tensor:
    """The entropies of the completion tokens of this micro-batch on every process, 1-D: the
    quantile of `top_entropy_quantile` is taken over all of them, as in TRL, so every process
    keeps tokens above one threshold."""
    local = entropy.detach()[completion_mask.bool()].float()  # (tokens here,)
    if accelerator.num_processes == 1:
        return local
    # Processes hold different numbers of tokens: pad to the longest with a value no entropy
    # takes (entropies are >= 0), gather, and drop the padding again (TRL's sentinel).
    padding = -1e9
    padded = accelerator.pad_across_processes(local, dim=0, pad_index=padding)
    gathered = accelerator.gather(padded)  # (processes * longest,)
    return gathered[gathered != padding]
