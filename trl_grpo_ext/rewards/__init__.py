"""Reward functions in TRL's convention, a registry to name them in configs, and the built-ins.

A reward function is a plain callable, called with keyword arguments only,
`f(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=...)`,
returning one `float` (or `None`: not applicable) per completion; its `__name__` is the metric
name. So these rewards work in `trl.GRPOTrainer`, and TRL's and open-r1's work here.

Built-ins (registered names): `math_accuracy`, `format`, `tag_count`, `answer_tags`,
`overlong_penalty`, `length`, and `judge`, the factory `judge_reward(...)` of an LLM judge's
reward function (`rewards/judge.py`).
See docs/rewards.md.
"""

from ._convention import completion_text
from .accuracy import math_accuracy, math_accuracy_reward
from .format import answer_tags, format_reward, tag_count_reward
from .judge import judge_reward
from .length import length_reward, overlong_penalty
from .registry import get_reward, list_rewards, register_reward

__all__ = [
    "answer_tags",
    "completion_text",
    "format_reward",
    "get_reward",
    "judge_reward",
    "length_reward",
    "list_rewards",
    "math_accuracy",
    "math_accuracy_reward",
    "overlong_penalty",
    "register_reward",
    "tag_count_reward",
]
