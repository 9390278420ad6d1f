"""Length rewards: DAPO's soft overlong penalty, and a plain `length` reward for tests and demos.

The overlong penalty (DAPO, Yu et al. 2025, eq. 13), with L = completion length in tokens,
L_max = `max_length` and L_cache = `cache_length`:

    R(L) = 0                                 if L <= L_max - L_cache
           ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
           -1                                if L > L_max
"""

from __future__ import annotations

from ._convention import completion_texts, token_lengths
from .registry import register_reward


class OverlongPenalty:
    """An `overlong_penalty` reward function; build it with `overlong_penalty`."""

    def __init__(self, max_length: int, cache_length: int):
        if max_length <= 0 or not 0 <= cache_length <= max_length:
            raise ValueError(
                f"need max_length > 0 and 0 <= cache_length <= max_length, got "
                f"max_length={max_length}, cache_length={cache_length}"
            )
        self.__name__ = "overlong_penalty"
        self.max_length = max_length
        self.cache_length = cache_length

    def __repr__(self) -> str:
        return f"overlong_penalty(max_length={self.max_length}, cache_length={self.cache_length})"

    def penalty(self, length: int) -> float:
        soft_start = self.max_length - self.cache_length
        if length <= soft_start:
            return 0.0
        if length <= self.max_length:  # here cache_length > 0
            return (soft_start - length) / self.cache_length
        return -1.0

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        size = None if completions is None else len(completions)
        return [self.penalty(n) for n in token_lengths(completion_ids, size, self.__name__)]


@register_reward("overlong_penalty", factory=True)
def overlong_penalty(max_length: int, cache_length: int) -> OverlongPenalty:
    """Build DAPO's soft overlong penalty on completion length in tokens (`completion_ids`): 0 up
    to `max_length - cache_length` tokens, then linear down to -1 at `max_length`, -1 beyond.

    Args:
        max_length (`int`):
            Length in tokens at which the penalty reaches -1 (usually `max_completion_length`).
        cache_length (`int`):
            Width of the soft zone before `max_length`; 0 makes it a step at `max_length`.

    Example:
        >>> penalty = overlong_penalty(max_length=10, cache_length=4)
        >>> penalty(completions=["a"] * 4, completion_ids=[[1] * 6, [1] * 8, [1] * 10, [1] * 11])
        [0.0, -0.5, -1.0, -1.0]
    """
    return OverlongPenalty(max_length, cache_length)


class Length:
    """A `length` reward function; build it with `length_reward`."""

    def __init__(self, unit: str, target: int | None):
        if unit not in ("chars", "tokens"):
            raise ValueError(f"unit must be 'chars' or 'tokens', got {unit!r}")
        if target is not None and target <= 0:
            raise ValueError(f"target must be a positive length, got {target!r}")
        self.__name__ = "length"
        self.unit = unit
        self.target = target

    def __repr__(self) -> str:
        return f"length_reward(unit={self.unit!r}, target={self.target!r})"

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        texts = completion_texts(completions, self.__name__)
        if self.unit == "tokens":
            lengths = token_lengths(completion_ids, len(texts), self.__name__)
        else:
            lengths = [len(text) for text in texts]
        if self.target is None:
            return [float(n) for n in lengths]
        return [1.0 - min(1.0, abs(n - self.target) / self.target) for n in lengths]


@register_reward("length", factory=True)
def length_reward(unit: str = "chars", target: int | None = None) -> Length:
    """Build the `length` reward, for tests and demos: the completion's length, or with a `target`,
    `1 - min(1, |length - target| / target)` (1.0 at the target, 0.0 at zero or twice the target).

    Args:
        unit (`str`, *optional*, defaults to `"chars"`):
            `"chars"` (characters of the text) or `"tokens"` (entries of `completion_ids`).
        target (`int`, *optional*):
            The length to aim for; without it the reward is the raw length.

    Example:
        >>> length_reward()(completions=["abc", ""])
        [3.0, 0.0]
        >>> length_reward(target=4)(completions=["abcd", "ab", "abcdefghij"])
        [1.0, 0.5, 0.0]
    """
    return Length(unit, target)
