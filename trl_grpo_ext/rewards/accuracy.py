r"""Math accuracy: 1.0 when the completion's final answer equals the reference, checked by
math-verify (`parse` + `verify`), 0.0 otherwise, None when the reference itself cannot be parsed
(as TRL's `accuracy_reward` does).

Which part of the completion is the answer, and the rules against hedging, are in `_verify.py`
and docs/rewards.md. Scoring runs in a small pool of worker processes (`_pool.py`), so that it
works from any thread or process: a hostile completion costs `timeout` seconds of CPU, at most
`2 * timeout + 1` seconds of wall-clock time (`_pool.hard_deadline`), never a hung run.
"""

from __future__ import annotations

import logging
import threading

from . import _pool, _verify
from ._convention import completion_texts, dataset_column
from .registry import register_reward

logger = logging.getLogger(__name__)
_warned_unbounded = False


class MathAccuracy:
    """A `math_accuracy` reward function; build it with `math_accuracy_reward`."""

    def __init__(
        self, answer_column: str | None = None, timeout: float = 1.0, max_distinct_boxed: int = 1
    ):
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if max_distinct_boxed < 1:
            raise ValueError(f"max_distinct_boxed must be >= 1, got {max_distinct_boxed!r}")
        self.__name__ = "math_accuracy"
        self.answer_column = answer_column
        self.timeout = float(timeout)
        self.max_distinct_boxed = int(max_distinct_boxed)

    def __repr__(self) -> str:
        return (
            f"math_accuracy_reward(answer_column={self.answer_column!r}, timeout={self.timeout}, "
            f"max_distinct_boxed={self.max_distinct_boxed})"
        )

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        texts = completion_texts(completions, self.__name__)
        names = (self.answer_column,) if self.answer_column else ("answer", "solution")
        _, references = dataset_column(kwargs, names, len(texts), self.__name__)
        options = {"max_distinct_boxed": self.max_distinct_boxed}
        results = score_completions(references, texts, self.timeout, options)
        log_extra = kwargs.get("log_extra")  # TRL's hook for extra columns in the completions table
        if callable(log_extra):
            log_extra("math_accuracy_note", [note for _, note in results])
        return [score for score, _ in results]


def score_completions(references, texts, timeout: float, options: dict) -> list[list]:
    """`[score, note]` for each (reference, completion) pair; identical pairs are scored once."""
    requests = [(None if ref is None else str(ref), text) for ref, text in zip(references, texts)]
    unique = list(dict.fromkeys(requests))
    try:
        pool = _pool.get_pool()
    except _pool.WorkerStartError as error:
        raise _start_error(error) from error
    if pool is not None:
        try:
            scored = pool.map([(ref, text, options) for ref, text in unique], timeout)
        except _pool.WorkerStartError as error:  # a replacement worker could not start
            raise _start_error(error) from error
    else:
        _warn_if_unbounded()
        scored = [_verify.score_bounded(ref, text, timeout, options) for ref, text in unique]
    by_request = dict(zip(unique, scored))
    return [list(by_request[request]) for request in requests]


def _start_error(error: Exception) -> RuntimeError:
    return RuntimeError(
        f"math_accuracy could not start its verifier processes ({error}); set "
        "TRL_GRPO_EXT_VERIFY_WORKERS=0 to score in-process instead."
    )


def _warn_if_unbounded() -> None:
    global _warned_unbounded
    if threading.current_thread() is not threading.main_thread() and not _warned_unbounded:
        _warned_unbounded = True
        logger.warning(
            "math_accuracy is scoring in-process outside the main thread (verifier workers are "
            "disabled): only the input caps bound its time, not the timeout."
        )


@register_reward("math_accuracy", factory=True)
def math_accuracy_reward(
    answer_column: str | None = None, timeout: float = 1.0, max_distinct_boxed: int = 1
) -> MathAccuracy:
    r"""Build a `math_accuracy` reward: 1.0 when the completion's final answer equals the reference
    answer (math-verify), 0.0 when it does not (or is empty, a hedge, or too slow to check), and
    None when the reference cannot be parsed.

    The final answer is the last `\boxed{}` after the reasoning (`</think>`), else what follows
    `####`, else what math-verify finds at the end ("the answer is 72.", the last number). More
    than `max_distinct_boxed` different boxed answers, or a list of candidate numbers as the final
    answer, scores 0.0. Against a number, worked arithmetic that ends in its result
    (`\boxed{52+6=58}`) is an answer; the arithmetic left undone (`\boxed{52+6}`) is not.

    Args:
        answer_column (`str`, *optional*):
            The dataset column holding the reference. Defaults to `answer`, then `solution`. A
            GSM8K answer (`... #### 72`), a solution with `\boxed{}`, or a bare answer all work.
        timeout (`float`, *optional*, defaults to `1.0`):
            CPU seconds allowed for one completion, after which it scores 0.0 (a worker that
            ignores its timer is killed after `2 * timeout + 1` seconds of wall-clock time).
        max_distinct_boxed (`int`, *optional*, defaults to `1`):
            How many different `\boxed{}` answers a completion may give (the last one counts).

    Example:
        >>> reward = math_accuracy_reward()
        >>> reward(
        ...     completions=["She sells 9 eggs at $2, so she makes $18.", r"It is \boxed{1/3}."],
        ...     answer=["9 * 2 = <<9*2=18>>18\n#### 18", r"\frac{1}{2}"],
        ... )
        [1.0, 0.0]
        >>> reward(completions=[r"\boxed{1} \boxed{2} \boxed{3}", "   "], answer=["2", "2"])
        [0.0, 0.0]
        >>> reward(completions=[r"\boxed{52+6=58}", r"\boxed{52+6}"], answer=["58", "58"])
        [1.0, 0.0]
        >>> reward(completions=[[{"role": "assistant", "content": r"\boxed{\sqrt{2}}"}]],
        ...        solution=[r"so $x = \boxed{\sqrt 2}$"])
        [1.0]
    """
    return MathAccuracy(answer_column, timeout, max_distinct_boxed)


math_accuracy = math_accuracy_reward()
"""The default `math_accuracy` reward: references in `answer` (else `solution`), 1 s each."""
