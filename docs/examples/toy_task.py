"""The toy task of the documentation: answer `a+b=` with the one-digit sum.

Shared by the subclassing examples and by `docs/figures.py` (the reward curve). Two reward
functions in TRL's convention: `closeness`, a dense reward that a random model can climb
(1 for the right digit, less the further off it is, 0 for anything that is not a digit), and
`exact`, the accuracy (1 for the right digit, else 0).
"""

from datasets import Dataset
from peft import LoraConfig

from trl_grpo_ext.tiny import tiny_model_and_tokenizer


def digit_sum_dataset() -> Dataset:
    """All 55 prompts `a+b=` whose sum has one digit, with the answer in a column."""
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
        if a + b < 10
    ]
    return Dataset.from_list(rows)


def closeness(completions, answer, **kwargs):
    """1 - |digit - answer| / 9 for a completion starting with a digit, else 0."""
    scores = []
    for completion, target in zip(completions, answer):
        first = completion.strip()[:1]
        scores.append(1.0 - abs(int(first) - int(target)) / 9 if first.isdigit() else 0.0)
    return scores


def exact(completions, answer, **kwargs):
    """1 when the completion starts with the right digit, else 0."""
    return [float(c.strip()[:1] == target) for c, target in zip(completions, answer)]


def tiny_policy():
    """The tiny offline model and tokenizer; `initializer_range=0.2` gives a random model with
    sharp enough preferences for LoRA to move quickly on this task."""
    return tiny_model_and_tokenizer(seed=0, initializer_range=0.2)


def lora_config() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
