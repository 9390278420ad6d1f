"""Format rewards: the reasoning format as a 0/1 reward (`format`) and as partial credit per tag
(`tag_count`), for R1-style `<think>...</think>` completions."""

from __future__ import annotations

import re

from ._convention import completion_texts
from .registry import register_reward


class ThinkFormat:
    """A `format` reward function; build it with `format_reward`."""

    def __init__(self, think_open, think_close, answer_open, answer_close):
        if not think_close:
            raise ValueError("format_reward needs a closing reasoning tag (think_close)")
        if (answer_open is None) != (answer_close is None):
            raise ValueError("give both answer_open and answer_close, or neither")
        self.__name__ = "format"
        self.tags = tuple(t for t in (think_open, think_close, answer_open, answer_close) if t)
        think_open_re = re.escape(think_open) if think_open else ""
        answer = (
            rf"{re.escape(answer_open)}(?P<answer>.*){re.escape(answer_close)}"
            if answer_open
            else r"(?P<answer>.*)"
        )
        self._pattern = re.compile(
            rf"\s*{think_open_re}(?P<think>.*?){re.escape(think_close)}\s*{answer}\s*", re.DOTALL
        )

    def __repr__(self) -> str:
        return f"format_reward(tags={self.tags!r})"

    def score(self, text: str) -> float:
        match = self._pattern.fullmatch(text)
        if not match or not match["think"].strip() or not match["answer"].strip():
            return 0.0
        if any(text.count(tag) != 1 for tag in self.tags):  # no nested or repeated blocks
            return 0.0
        return 1.0

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        return [self.score(text) for text in completion_texts(completions, self.__name__)]


@register_reward("format", factory=True)
def format_reward(
    think_open: str | None = "<think>",
    think_close: str = "</think>",
    answer_open: str | None = None,
    answer_close: str | None = None,
) -> ThinkFormat:
    """Build the `format` reward: 1.0 when a completion is exactly one non-empty reasoning block
    followed by a non-empty answer, else 0.0. Whitespace around the blocks is allowed; repeated
    or nested tags are not.

    Args:
        think_open (`str` or `None`, *optional*, defaults to `"<think>"`):
            Opening reasoning tag. `None` when the chat template already puts it in the prompt.
        think_close (`str`, *optional*, defaults to `"</think>"`):
            Closing reasoning tag.
        answer_open, answer_close (`str`, *optional*):
            Tags that must wrap the answer (for example `"<answer>"`, `"</answer>"`).

    Example:
        >>> reward = format_reward()
        >>> reward(completions=["<think>9 * 2 = 18</think> 18", "18", "<think>hm</think>  ",
        ...                     "<think></think> 18", "<think>a</think><think>b</think> 18"])
        [1.0, 0.0, 0.0, 0.0, 0.0]
        >>> tagged = format_reward(answer_open="<answer>", answer_close="</answer>")
        >>> tagged(completions=["<think>9*2</think>\\n<answer>18</answer>", "<think>9</think> 18"])
        [1.0, 0.0]
    """
    return ThinkFormat(think_open, think_close, answer_open, answer_close)


class TagCount:
    """A `tag_count` reward function; build it with `tag_count_reward`."""

    def __init__(self, tags):
        tags = tuple(tags)
        if not tags or any(not tag for tag in tags):
            raise ValueError(f"tag_count_reward needs non-empty tags, got {tags!r}")
        self.__name__ = "tag_count"
        self.tags = tags

    def __repr__(self) -> str:
        return f"tag_count_reward(tags={self.tags!r})"

    def score(self, text: str) -> float:
        credit = 0
        last_position = -1  # position of the previous tag that appeared exactly once
        for tag in self.tags:
            if text.count(tag) != 1:
                continue
            position = text.index(tag)
            if position > last_position:
                credit += 1
                last_position = position
        return credit / len(self.tags)

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        return [self.score(text) for text in completion_texts(completions, self.__name__)]


@register_reward("tag_count", factory=True)
def tag_count_reward(tags=("<think>", "</think>", "<answer>", "</answer>")) -> TagCount:
    """Build the `tag_count` reward: 1/len(tags) for each tag that appears exactly once and after
    the earlier tags that do (0.25 per tag with the default four), so a model learning the format
    gets credit for each step on the way. Whitespace and newlines around tags do not matter.

    Args:
        tags (`Sequence[str]`, *optional*, defaults to think and answer open/close tags):
            The tags, in the order they must appear.

    Example:
        >>> reward = tag_count_reward()
        >>> reward(completions=["<think>a</think><answer>b</answer>", "<think>a</think> b",
        ...                     "</think><think>", "<think>a<think>b</think>", "plain"])
        [1.0, 0.5, 0.25, 0.25, 0.0]
    """
    return TagCount(tags)


_ANSWER_BLOCK = re.compile(r"<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)


@register_reward("answer_tags")
def answer_tags(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
    """1.0 when a completion ends with its one non-empty `<answer>...</answer>` block (the
    format reasoning-gym's prompts ask for and its `extract_answer` reads), else 0.0: a
    format-shaping reward to add to an accuracy reward that scores untagged answers 0.

    Example:
        >>> answer_tags(completions=["3 + 4 = 7. <answer>7</answer>", "<answer>7</answer> so 7",
        ...                          "7", "<answer> </answer>", "<answer>6</answer><answer>7</answer>"])
        [1.0, 0.0, 0.0, 0.0, 0.0]
    """
    scores = []
    for text in completion_texts(completions, "answer_tags"):
        match = _ANSWER_BLOCK.search(text)
        ended = match is not None and match.end() == len(text)
        scores.append(
            float(ended and text.count("<answer>") == 1 and bool(match["answer"].strip()))
        )
    return scores
