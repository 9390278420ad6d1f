"""Dataset loaders, prompt formatting and the synthetic arithmetic of `trl_grpo_ext.data`."""

import json
import os
import re

import pytest

from trl_grpo_ext.data import (
    SYSTEM_PROMPT,
    check_chat_template,
    extract_reference_answer,
    is_held_out,
    last_boxed,
    load_math_dataset,
    make_prompt,
    synthetic_dataset,
    synthetic_rows,
    synthetic_split,
)
from trl_grpo_ext.rewards import math_accuracy

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
GSM8K_TEST = os.path.join(SHARED, "gsm8k", "test.jsonl")
MATH500_TEST = os.path.join(SHARED, "math500", "test.jsonl")
needs_gsm8k = pytest.mark.skipif(not os.path.exists(GSM8K_TEST), reason="no shared GSM8K data")
needs_math500 = pytest.mark.skipif(
    not os.path.exists(MATH500_TEST), reason="no shared MATH-500 data"
)


def test_reference_answers():
    assert extract_reference_answer("She makes 9 * 2 = 18.\n#### 1,018") == "1018"
    assert extract_reference_answer(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert extract_reference_answer("  42 ") == "42"
    assert last_boxed(r"\boxed{1} then \boxed{\sqrt{2}}") == r"\sqrt{2}"
    assert last_boxed(r"\boxed{unclosed") is None


def test_prompt_has_system_message_unless_empty():
    assert make_prompt("q") == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "q"},
    ]
    assert make_prompt("q", "") == [{"role": "user", "content": "q"}]
    assert "boxed" in SYSTEM_PROMPT and "step by step" in SYSTEM_PROMPT


def test_synthetic_is_seeded_and_held_out_never_trains():
    train = synthetic_rows(2000, split="train", difficulty=2, seed=0, unique=False)
    assert train == synthetic_rows(2000, split="train", difficulty=2, seed=0, unique=False)
    assert train != synthetic_rows(2000, split="train", difficulty=2, seed=1, unique=False)
    test = synthetic_rows(300, split="test", difficulty=2, seed=0)
    assert len({row["question"] for row in test}) == 300
    train_questions = {row["question"] for row in train}
    assert not train_questions & {row["question"] for row in test}
    # The split is a property of the problem, whatever the seed.
    other_seed = synthetic_rows(2000, split="train", difficulty=2, seed=7, unique=False)
    assert not any(is_held_out(row["question"]) for row in other_seed)
    for row in test[:50]:
        a, operation, b = row["question"].removeprefix("What is ").rstrip("?").split()
        assert int(row["answer"]) == eval(f"{a}{operation}{b}")  # noqa: S307 - our own digits


def test_synthetic_validation_split_comes_out_of_train():
    validation = synthetic_rows(300, split="validation", seed=0, validation_percent=10)
    train = synthetic_rows(3000, split="train", seed=0, unique=False, validation_percent=10)
    test = synthetic_rows(300, split="test", seed=0)
    questions = [{row["question"] for row in rows} for rows in (train, validation, test)]
    assert len(questions[1]) == 300  # distinct
    assert not questions[0] & questions[1] and not questions[1] & questions[2]
    assert not questions[0] & questions[2]
    # A tenth of all problems: about 10 / 80 of what was training before.
    without = synthetic_rows(3000, split="train", seed=0, unique=False)
    moved = sum(synthetic_split(row["question"], 10) == "validation" for row in without)
    assert 0.09 < moved / len(without) < 0.16
    # Held-out problems do not depend on the validation share; the default has no validation.
    assert test == synthetic_rows(300, split="test", seed=0, validation_percent=30)
    assert synthetic_split("What is 1 + 1?") in ("train", "test")
    with pytest.raises(ValueError, match="validation_percent"):
        synthetic_rows(5, split="validation")
    dataset = load_math_dataset(
        "synthetic", "validation", num_rows=8, validation_percent=10, system_prompt=""
    )
    assert len(set(dataset["question"])) == 8 and dataset[0]["prompt"][0]["role"] == "user"
    assert not set(dataset["question"]) & questions[0]


def test_synthetic_difficulty_and_scoring():
    easy = synthetic_rows(50, split="train", difficulty=1, seed=0, unique=False)
    assert all(len(row["answer"]) <= 2 for row in easy)
    hard = synthetic_rows(200, split="train", difficulty=4, seed=0)
    assert {row["question"].split()[3] for row in hard} == {"+", "-"}
    assert all(int(row["answer"]) >= 0 for row in hard)
    products = synthetic_rows(200, split="train", difficulty=6, seed=0)
    for row in products:
        a, operation, b = row["question"].rstrip("?").split()[2:]  # "What is 347 * 58?"
        assert operation == "*" and 0 <= int(a) <= 999 and 0 <= int(b) <= 99
        assert int(row["answer"]) == int(a) * int(b)
    assert max(int(row["answer"]) for row in products) > 10_000  # beyond mental arithmetic
    # Level 7: the same products in two-step questions, worded four ways; each answer checked
    # against the question rewritten as Python by hand.
    spelled = {
        r"Multiply (\d+) by (\d+), then add (\d+)\.": "{} * {} + {}",
        r"Multiply (\d+) by (\d+), then take away (\d+)\.": "{} * {} - {}",
        r"What is the product of (\d+) and (\d+)\?": "{} * {}",
        r"What is (\d+) \* (\d+) minus (\d+) \* (\d+)\?": "{} * {} - {} * {}",
    }
    worded = synthetic_rows(200, split="train", difficulty=7, seed=0)
    seen = set()
    for row in worded:
        (pattern, expression), match = next(
            (item, m) for item in spelled.items() if (m := re.fullmatch(item[0], row["question"]))
        )
        seen.add(pattern)
        assert int(row["answer"]) == eval(expression.format(*match.groups()))
        assert 100 <= int(match[1]) <= 999 and 10 <= int(match[2]) <= 99
    assert len(seen) == 4
    with pytest.raises(ValueError, match="difficulty"):
        synthetic_rows(5, difficulty=9)
    with pytest.raises(ValueError, match="distinct"):
        synthetic_rows(100, split="test", difficulty=1)  # 100 problems, a fifth held out
    dataset = synthetic_dataset(4, split="test", system_prompt="")
    assert dataset.column_names == ["question", "answer", "prompt"]
    rewards = math_accuracy(
        completions=[rf"\boxed{{{a}}}" for a in dataset["answer"]], answer=dataset["answer"]
    )
    assert rewards == [1.0] * 4


def test_synthetic_through_the_loader():
    dataset = load_math_dataset("synthetic", "train", num_rows=16, seed=3, difficulty=3)
    assert len(dataset) == 16 and dataset[0]["prompt"][0]["role"] == "system"
    with pytest.raises(ValueError, match="num_rows"):
        load_math_dataset("synthetic")


def test_local_jsonl_with_custom_columns(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"q": "What is 2 + 3?", "a": "5"}, {"q": "What is 7 - 1?", "a": "6"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = load_math_dataset(
        str(path), question_column="q", answer_column="a", system_prompt=None
    )
    assert dataset["answer"] == ["5", "6"]
    assert dataset[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    with pytest.raises(ValueError, match="dataset_question_column"):
        load_math_dataset(str(path), question_column="question", answer_column="a")
    parquet = tmp_path / "mine.parquet"
    dataset.to_parquet(str(parquet))
    assert load_math_dataset(str(parquet), num_rows=1)["answer"] == ["5"]
    with pytest.raises(FileNotFoundError):
        load_math_dataset(str(tmp_path / "missing.jsonl"))


@needs_gsm8k
def test_gsm8k_file_as_a_local_path():
    dataset = load_math_dataset(GSM8K_TEST, num_rows=50)
    assert dataset[0]["answer"] == "18"
    assert dataset[0]["prompt"][-1]["content"].startswith("Janet")
    # Each reference solution scores as right against its own extracted answer.
    solutions = [row["answer"] for row in load_math_dataset(GSM8K_TEST, num_rows=50).to_list()]
    assert sum(math_accuracy(completions=solutions, answer=dataset["answer"])) == 50


@needs_math500
def test_math500_file_as_a_local_path():
    dataset = load_math_dataset(MATH500_TEST, question_column="problem", num_rows=20)
    assert dataset[0]["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    boxed = [rf"The answer is $\boxed{{{answer}}}$." for answer in dataset["answer"]]
    assert sum(math_accuracy(completions=boxed, answer=dataset["answer"])) >= 19


def test_chat_template_check(tiny_tokenizer):
    rendered = check_chat_template(tiny_tokenizer)
    assert rendered.endswith("<|im_start|>assistant\n")

    class Thinking:
        def apply_chat_template(self, messages, **kwargs):
            return tiny_tokenizer.apply_chat_template(messages, **kwargs) + "<think>\n"

    with pytest.raises(ValueError, match="<think>"):
        check_chat_template(Thinking())

    class ClosedThink:  # Qwen3 with enable_thinking=False: an empty, closed block is fine
        def apply_chat_template(self, messages, **kwargs):
            return (
                tiny_tokenizer.apply_chat_template(messages, **kwargs) + "<think>\n\n</think>\n\n"
            )

    check_chat_template(ClosedThink())


def test_hub_ids_for_the_model_card(tmp_path):
    from trl_grpo_ext.data import dataset_hub_id

    assert dataset_hub_id("gsm8k") == "openai/gsm8k"
    assert dataset_hub_id("math500") == "HuggingFaceH4/MATH-500"
    assert dataset_hub_id("someone/data") == "someone/data"
    assert dataset_hub_id("synthetic") is None
    assert dataset_hub_id(str(tmp_path / "x.jsonl")) is None
