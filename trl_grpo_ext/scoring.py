"""Calling reward functions in TRL's convention, and refusing what they return when it is wrong.

A reward function is called with keyword arguments only:
`f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=...,
log_extra=..., **dataset_columns)` (the trainer's `score_rollouts` passes TRL 1.16's arguments) and
returns one `float` or `None` ("not applicable") per completion; booleans count as 1.0 / 0.0, as
in TRL. `async def` functions run concurrently with each other. A function that raises, returns
something other than a list (a string, a scalar), the wrong number of values, a non-number, or NaN
or +-inf stops training with an error naming the function, the value and the sample; nothing is
broadcast, and only `None` means "not applicable" (TRL would read a NaN as one, silently).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy
import torch

logger = logging.getLogger(__name__)

# What reward functions receive besides the columns of one completion's row.
NOT_ROW_KWARGS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something that is not one score per completion."""


def reward_name(func: Callable) -> str:
    """The metric name of a reward function: its `__name__` (or its class name)."""
    return getattr(func, "__name__", None) or type(func).__name__


def reward_weights(weights: list[float] | None, names: list[str]) -> torch.Tensor:
    """`(F,)` float32 weights of the reward functions `names`; all 1 when `weights` is None."""
    weights = weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(
            f"reward_weights has {len(weights)} entries but there are {len(names)} reward "
            f"functions ({names}); give one weight per function."
        )
    return torch.tensor(weights, dtype=torch.float32)


def reward_func_list(reward_funcs) -> list:
    """`reward_funcs` as a non-empty list (one entry, or a list or tuple of them)."""
    if reward_funcs is None or (isinstance(reward_funcs, Sequence) and not reward_funcs):
        raise ValueError(
            "No reward source provided: reward_funcs is empty. Pass at least one reward function, "
            "name or reward model, or an environment_factory whose environments define "
            "get_reward()."
        )
    if not isinstance(reward_funcs, (list, tuple)):
        reward_funcs = [reward_funcs]
    return list(reward_funcs)


def resolve_reward_funcs(reward_funcs) -> list[Callable]:
    """One or a list of callables, registry names or dotted import paths -> list of callables.
    (Reward models are wrapped as callables before, by `rewards.model.resolve_reward_models`.)"""
    reward_funcs = reward_func_list(reward_funcs)
    if not all(callable(func) for func in reward_funcs):
        from .rewards import get_reward  # the registry resolves names and dotted paths

        reward_funcs = [func if callable(func) else get_reward(func) for func in reward_funcs]
    resolved = list(reward_funcs)
    names = [reward_name(func) for func in resolved]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"Reward functions share the names {duplicates}; metrics are logged by name, so give "
            "each function a distinct __name__ (e.g. functools.update_wrapper or a def)."
        )
    return resolved


def _as_float(value) -> float | None:
    """A single score as a float; booleans (Python, NumPy, 0-d tensors) count as 1.0 / 0.0, the
    way `torch.tensor` reads them in TRL. `None` when `value` is not a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        value = value.item()
    if isinstance(value, (bool, numpy.bool_)):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _check_scores(name: str, scores, expected: int) -> list[float]:
    if isinstance(scores, (str, bytes, Mapping)):
        raise RewardFunctionError(
            f"Reward function {name!r} returned a {type(scores).__name__} ({scores!r:.60}); it "
            f"must return a list with one float or None per completion ({expected} values)."
        )
    if isinstance(scores, (torch.Tensor, numpy.ndarray)):
        scores = scores.tolist()
    if not isinstance(scores, Sequence):
        try:
            scores = list(scores)
        except TypeError:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {type(scores).__name__}; it must return a list "
                f"with one float or None per completion ({expected} values)."
            ) from None
    if len(scores) != expected:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(scores)} values for {expected} completions; "
            "it must return exactly one float or None per completion."
        )
    checked = []
    for index, score in enumerate(scores):
        if score is None:  # the only way to say "not applicable"
            checked.append(math.nan)
            continue
        value = _as_float(score)
        if value is None:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {score!r} ({type(score).__name__}) for sample "
                f"{index}; each value must be a float, an int, a bool, or None (not applicable)."
            )
        if not math.isfinite(value):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value} for sample {index}; scores must be "
                "finite. Return None for a completion the function does not apply to."
            )
        checked.append(value)
    return checked


def _run_async(coroutines):
    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)

    # A fresh event loop in a worker thread works whether or not the caller already runs one.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def call_reward_funcs(reward_funcs: list[Callable], **kwargs) -> torch.Tensor:
    """Scores every completion with every function.

    Args:
        reward_funcs (`list[Callable]`): the reward functions.
        **kwargs: `prompts`, `completions`, `completion_ids`, `trainer_state`, `log_metric`,
            `log_extra` and the dataset columns, each a list with one entry per completion (but
            `trainer_state` and the two loggers).

    Returns:
        `torch.Tensor` of shape `(N, F)`, float32, NaN where a function returned None.
    """
    expected = len(kwargs["completions"])
    results: dict[int, object] = {}
    async_indices = [i for i, f in enumerate(reward_funcs) if inspect.iscoroutinefunction(f)]
    if async_indices:
        outcomes = _run_async([reward_funcs[i](**kwargs) for i in async_indices])
        results.update(zip(async_indices, outcomes))
    for index, func in enumerate(reward_funcs):
        if index in results:
            continue
        try:
            results[index] = func(**kwargs)
        except Exception as error:  # noqa: BLE001 - re-raised with the function's name
            results[index] = error
    columns = []
    for index, func in enumerate(reward_funcs):
        name, outcome = reward_name(func), results[index]
        if isinstance(outcome, BaseException):
            raise RewardFunctionError(
                f"Reward function {name!r} raised {type(outcome).__name__}: {outcome}"
            ) from outcome
        columns.append(_check_scores(name, outcome, expected))
    rewards = torch.tensor(columns, dtype=torch.float32).T.reshape(expected, len(reward_funcs))
    warn_if_unscored(rewards, kwargs)
    return rewards


def warn_if_unscored(rewards: torch.Tensor, kwargs: dict) -> None:
    """TRL's warning when every reward function returned None for a completion (its advantage
    is then NaN-free but carries no reward): the first such completion's keyword arguments."""
    unscored = torch.isnan(rewards).all(dim=1).nonzero(as_tuple=True)[0]  # (rows,)
    if len(unscored) == 0:
        return
    row = int(unscored[0])
    row_kwargs = {k: v[row] for k, v in kwargs.items() if k not in NOT_ROW_KWARGS}
    row_kwargs["prompt"] = kwargs["prompts"][row]
    row_kwargs["completion"] = kwargs["completions"][row]
    logger.warning(
        f"All reward functions returned None for the following kwargs:\n{row_kwargs}\n"
        "Please ensure that at least one reward function returns a valid reward."
    )
