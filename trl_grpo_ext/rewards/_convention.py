"""The reward calling convention shared with TRL: completions as text, dataset columns by name.

A reward function is called with keyword arguments only:
`f(prompts=..., completions=..., completion_ids=..., <each dataset column>=..., trainer_state=...)`
where every list has one entry per completion. A completion is a string, or for conversational
datasets a list of messages (`[{"role": "assistant", "content": "..."}]`).
"""

from __future__ import annotations

from collections.abc import Sequence


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the content of the last message.

    Example:
        >>> completion_text([{"role": "assistant", "content": "42"}])
        '42'
        >>> completion_text([{"role": "assistant", "content": [{"type": "text", "text": "4"}]}])
        '4'
    """
    if isinstance(completion, str):
        return completion
    message = completion
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        message = completion[-1]
    if not isinstance(message, dict):
        raise TypeError(
            f"a completion must be a string or a list of messages (dicts), got {type(message)}"
        )
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return str(content)


def completion_texts(completions, reward_name: str) -> list[str]:
    if completions is None:
        raise TypeError(f"{reward_name}() needs the `completions` keyword argument")
    return [completion_text(completion) for completion in completions]


def dataset_column(
    columns: dict, names: Sequence[str], size: int, reward_name: str
) -> tuple[str, list]:
    """The first of `names` that the trainer passed as a dataset column, checked for length."""
    for name in names:
        if name in columns and columns[name] is not None:
            values = list(columns[name])
            if len(values) != size:
                raise ValueError(
                    f"{reward_name}: column {name!r} has {len(values)} values for {size} "
                    "completions"
                )
            return name, values
    passed = sorted(
        key for key in columns if key not in ("trainer_state", "log_extra", "log_metric")
    )
    raise ValueError(
        f"{reward_name} needs a dataset column named {' or '.join(map(repr, names))} holding the "
        f"reference answer; it got columns {passed}. Pass answer_column= to choose another."
    )


def token_lengths(completion_ids, size: int | None, reward_name: str) -> list[int]:
    if completion_ids is None:
        raise ValueError(
            f"{reward_name} measures completions in tokens and needs `completion_ids` (GRPO "
            "trainers pass them; when calling it directly, pass completion_ids=[[...], ...])"
        )
    lengths = [len(ids) for ids in completion_ids]
    if size is not None and len(lengths) != size:
        raise ValueError(f"{reward_name}: {len(lengths)} completion_ids for {size} completions")
    return lengths
