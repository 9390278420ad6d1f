"""reasoning-gym's procedural tasks as a training set and its own scoring as the reward.

`from_reasoning_gym(names, size=..., seed=..., **config)`:

- one task (`"basic_arithmetic"`): `reasoning_gym.create_dataset(name, size=size, seed=seed,
  **config)`;
- a list of names: an equal-weight mix of `size` rows in all, a `{name: weight}` dict a weighted
  one: reasoning-gym's own `composite` dataset; `config` then maps a task's name to its settings
  (`from_reasoning_gym(["chain_sum", "leg_counting"], chain_sum={"max_terms": 3})`).

Rows come in the dataset's order. Each has a conversational `prompt` (reasoning-gym's default
system prompt, which asks for the answer in `<answer>` tags, or `system_prompt`: another of its
prompts by name, or a text; then the question), an `answer`
column, the task's name (`task`) and the row's position (`reasoning_gym_index`). The reward,
`reasoning_gym`, is `dataset.score_answer(extract_answer(completion), entry)`: reasoning-gym's
own extraction (the last `<answer>...</answer>`) and scoring of its own entry, whose metadata is
kept whole in the reward function rather than squeezed into Arrow columns. `eval_size` more rows
(positions `size` to `size + eval_size - 1`, never trained on) make an `eval_dataset`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._imports import require

INDEX_COLUMN = "reasoning_gym_index"


def _task_weights(names) -> dict[str, float]:
    if isinstance(names, str):
        return {names: 1.0}
    if isinstance(names, Mapping):
        weights = dict(names)
    elif isinstance(names, Sequence) and not isinstance(names, bytes):
        weights = {name: 1.0 for name in names}
        if len(weights) != len(names):
            raise ValueError(f"from_reasoning_gym: {list(names)} names a task twice.")
    else:
        raise TypeError(
            f"from_reasoning_gym: names is a {type(names).__name__}; expected a task name, a list "
            "of names (an equal-weight mix) or a {name: weight} dict (a weighted mix)."
        )
    if not weights:
        raise ValueError("from_reasoning_gym: names is empty; give at least one task name.")
    for name, weight in weights.items():
        if not isinstance(name, str):
            raise TypeError(f"from_reasoning_gym: task names are strings, got {name!r}.")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise ValueError(
                f"from_reasoning_gym: the weight of {name!r} is {weight!r}; expected > 0."
            )
    return {name: float(weight) for name, weight in weights.items()}


def create_procedural_dataset(names, size: int, seed: int, config: dict):
    """The reasoning-gym dataset of `size` rows that `names` and `config` describe."""
    reasoning_gym = require("reasoning_gym", "reasoning-gym")
    from reasoning_gym.factory import DATASETS

    weights = _task_weights(names)
    unknown = sorted(name for name in weights if name not in DATASETS)
    if unknown:
        raise ValueError(
            f"from_reasoning_gym: no reasoning-gym task named {unknown}; the tasks are: "
            f"{sorted(DATASETS)}."
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"from_reasoning_gym: size={size!r}; expected a number of rows >= 1.")
    if len(weights) == 1 and isinstance(names, str):
        return reasoning_gym.create_dataset(names, size=size, seed=seed, **config)
    stray = sorted(key for key in config if key not in weights)
    if stray:
        raise ValueError(
            f"from_reasoning_gym: with a mix of tasks, each keyword argument names a task of the "
            f"mix and holds its settings; {stray} is not one of {sorted(weights)}."
        )
    from reasoning_gym.composite import DatasetSpec

    specs = [
        DatasetSpec(name=name, weight=weight, config=dict(config.get(name) or {}))
        for name, weight in weights.items()
    ]
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)


def system_prompt_text(system_prompt: str | None) -> str:
    """The system prompt: reasoning-gym's own by name (`"default"` when None, `"direct"`,
    `"simple"`, ...: `reasoning_gym.utils.SYSTEM_PROMPTS`), or the text given."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt is None:
        return SYSTEM_PROMPTS["default"]
    if not isinstance(system_prompt, str):
        raise TypeError(
            f"from_reasoning_gym: system_prompt is a {type(system_prompt).__name__}; expected the "
            f"name of one of reasoning-gym's ({sorted(SYSTEM_PROMPTS)}) or a text."
        )
    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def prompt_messages(question: str, system_prompt: str) -> list[dict]:
    """The prompt of a question: the system prompt, then the question."""
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": question},
    ]


class ReasoningGymReward:
    """reasoning-gym's own scoring as a reward function in TRL's convention: the completion's
    answer extracted by `reasoning_gym.utils.extract_answer`, scored by the dataset's
    `score_answer` against the entry at the row's `reasoning_gym_index`."""

    def __init__(self, dataset, entries: list[dict]):
        self.dataset, self.entries = dataset, entries
        self.__name__ = "reasoning_gym"

    def __call__(self, completions, **kwargs) -> list[float]:
        from reasoning_gym.utils import extract_answer

        from ..rewards import completion_text

        indices = kwargs.get(INDEX_COLUMN)
        if indices is None:
            raise ValueError(
                f"The reasoning_gym reward needs the `{INDEX_COLUMN}` column of the rows that "
                "from_reasoning_gym made; train on that dataset (its train_dataset or "
                "eval_dataset)."
            )
        return [
            float(
                self.dataset.score_answer(
                    extract_answer(completion_text(completion)), entry=self.entries[index]
                )
            )
            for completion, index in zip(completions, indices, strict=True)
        ]


def from_reasoning_gym(
    names: str | Sequence[str] | Mapping[str, float],
    size: int = 500,
    seed: int = 42,
    eval_size: int = 0,
    system_prompt: str | None = None,
    **config,
) -> dict:
    """reasoning-gym tasks as `GroupRelativeTrainer` keyword arguments.

    Args:
        names (`str`, `list[str]` or `dict[str, float]`):
            A task (`"basic_arithmetic"`), an equal-weight mix, or a weighted mix.
        size (`int`, *optional*, defaults to `500`):
            Rows of the training set (of all tasks together for a mix).
        seed (`int`, *optional*, defaults to `42`):
            The dataset's seed: the same seed, the same rows.
        eval_size (`int`, *optional*, defaults to `0`):
            Rows after the training set's, as `eval_dataset` (none when 0).
        system_prompt (`str`, *optional*):
            One of reasoning-gym's system prompts by name (`"default"` when unset; `"direct"`
            asks for the answer alone, in tags), or a text of your own; the reward reads the
            last `<answer>` tags whatever the prompt says.
        **config:
            For one task, its settings (`reasoning_gym.create_dataset(name, **config)`); for a
            mix, `task_name={settings}` for each task to configure.

    Returns:
        `dict` with `train_dataset` (and `eval_dataset`) and `reward_funcs` (`[reasoning_gym]`).

    Example:
        >>> trainer = GroupRelativeTrainer(
        ...     model, args=args, **from_reasoning_gym("leg_counting", size=1000, seed=0)
        ... )  # doctest: +SKIP
    """
    from datasets import Dataset

    if not isinstance(eval_size, int) or eval_size < 0:
        raise ValueError(f"from_reasoning_gym: eval_size={eval_size!r}; expected an int >= 0.")
    system = system_prompt_text(system_prompt)
    dataset = create_procedural_dataset(names, size + eval_size, seed, config)
    entries = [dataset[index] for index in range(size + eval_size)]

    def rows(positions: range) -> Dataset:
        return Dataset.from_list(
            [
                {
                    "prompt": prompt_messages(entries[i]["question"], system),
                    "answer": str(entries[i]["answer"]),
                    "task": entries[i]["metadata"].get("source_dataset", str(names)),
                    INDEX_COLUMN: i,
                }
                for i in positions
            ]
        )

    arguments = {
        "train_dataset": rows(range(size)),
        "reward_funcs": [ReasoningGymReward(dataset, entries)],
    }
    if eval_size:
        arguments["eval_dataset"] = rows(range(size, size + eval_size))
    return arguments
