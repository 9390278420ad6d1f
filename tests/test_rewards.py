"""Reward library: the built-ins on literal completions, the registry, hostile completions, and
scoring from threads and processes. (That `trl.GRPOTrainer` accepts our rewards is tested with
the tiny-model fixture elsewhere.)"""

from __future__ import annotations

import doctest
import importlib
import json
import math
import multiprocessing
import pickle
import random
import re
import signal
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
import pytest
import torch

from trl_grpo_ext.rewards import (
    _pool,
    _verify,
    completion_text,
    format_reward,
    get_reward,
    length_reward,
    list_rewards,
    math_accuracy,
    math_accuracy_reward,
    overlong_penalty,
    register_reward,
    tag_count_reward,
)

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
SLACK_S = 2.0  # scheduling slack on a loaded 2-core machine, on top of timeout + kill grace


def score(completions, answers, reward=math_accuracy):
    return reward(prompts=["q"] * len(completions), completions=completions, answer=answers)


# ---------------------------------------------------------------- math_accuracy: true and false


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("She makes 9 * 2 = $18 every day.\nThe answer is 18.", "9 * 2 = <<9*2=18>>18\n#### 18"),
        ("#### 1,234", "#### 1,234"),
        ("So the total is 1,234 dollars.", "#### 1234"),
        ("It takes 3 bolts.", "It takes 2+1=<<2+1=3>>3 bolts\n#### 3"),
        ("The answer is -3.", "#### -3"),
        (r"The answer is $\boxed{72}$", "72"),
        (r"\boxed{72 \text{ dollars}}", "72"),
        (r"\boxed{\$72}", "#### 72"),
        (r"\boxed{72.}", "72"),
        (r"\boxed{1{,}000{,}000}", "1,000,000"),
        (r"so $x = \boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\sqrt 2}", r"\sqrt{2}"),
        (r"\boxed{[1, 2)}", "[1, 2)"),
        (r"The answer is $(-\infty, 3]$.", r"(-\infty, 3]"),
        (r"\boxed{\{3, 2, 1\}}", r"\{1, 2, 3\}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}"),
        (r"first \boxed{5}, checked: \boxed{5}", "5"),  # the same answer twice is one answer
        (r"<think>maybe \boxed{3}</think> It is \boxed{5}", "5"),  # only after </think> counts
    ],
)
def test_math_accuracy_true(completion, reference):
    assert score([completion], [reference]) == [1.0]


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is 19.", "#### 18"),
        ("It is 50.", "#### 5"),
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"),
        (r"\boxed{(1, 2)}", "[1, 2)"),
        (r"\boxed{\sqrt 3}", r"\sqrt{2}"),
        (r"\boxed{\text{Bob}}", r"\text{Evelyn}"),
        ("I do not know.", "#### 18"),
        (r"The answer is \boxed{72", "72"),  # an unclosed box is no answer
    ],
)
def test_math_accuracy_false(completion, reference):
    assert score([completion], [reference]) == [0.0]


def test_restating_the_arithmetic_is_not_an_answer():
    # math-verify parses "52 + 6" without evaluating it and verify() finds it equal to 58: a
    # policy asked "What is 52 + 6?" would be paid for repeating the question.
    restated = [
        "The answer is 52 + 6.",
        "52 + 6 = 52 + 6 = 52 + 6",
        r"\boxed{52+6}",
        "It is 60 - 2",
        "It is -58 + 116",
        "The answer is 2*29.",
        r"\boxed{2^{10}}",
    ]
    references = ["58", "58", "#### 58", "58", "58", "58", "1024"]
    assert score(restated, references) == [0.0] * len(restated)
    # Results after the arithmetic, negative numbers, fractions and powers of ten still count.
    fine = [
        "52 + 6 = 58.",
        "-3 + 5 = 2, so -2 + -1 = -3",
        "so 1/2",
        r"\boxed{104/2}",
        r"\boxed{10^3}",
    ]
    assert score(fine, ["58", "-3", "0.5", "52", "1000"]) == [1.0] * len(fine)
    # A reference that is itself an expression is compared as before.
    assert score([r"\boxed{1 + \sqrt{2}}"], [r"1 + \sqrt{2}"]) == [1.0]


def test_worked_arithmetic_that_ends_in_its_result_is_an_answer():
    # verify() compares the last right-hand side of an equation with a number: that value alone
    # is judged for arithmetic left undone, not the work before it.
    worked = [
        r"Therefore, the answer is $12 - 5 = 7$.",
        r"\boxed{52+6=58}",
        r"Janet makes \(9 \times 2 = 18\) dollars every day.",
        r"\boxed{x = 52 + 6 = 58}",
        r"The area is $\frac{1}{2} \cdot 6 \cdot 4 = 12$ square units.",
    ]
    assert score(worked, ["7", "#### 58", "#### 18", "58", "12"]) == [1.0] * len(worked)
    # A chain or an equation that ends in the arithmetic restates it; a wrong result is wrong.
    restated = [r"\boxed{52 + 6}", r"\boxed{x = 50 + 8 = 52 + 6}", r"\boxed{52 + 6 = 59}"]
    assert score(restated, ["58"] * 3) == [0.0] * 3
    # Written the other way round, the last right-hand side is the restatement (see the docs).
    assert score([r"\boxed{58 = 52 + 6}"], ["58"]) == [0.0]


def test_latex_thousands_separators():
    completions = [
        r"\boxed{10\,000}",
        r"\boxed{10 000}",
        r"\boxed{10,\!000}",
        r"\boxed{10\ 000}",
        r"The total is $10\,000$ dollars.",
        r"She pays \(10~000\) dollars.",
        r"#### 10\,000",
        r"The profit is $80{,}000 - 70{,}000 = 10{,}000$.",
        r"He pays $4 \times 2,500 = 10,000$ dollars.",
    ]
    assert score(completions, ["10000"] * len(completions)) == [1.0] * len(completions)
    # The digits still count: 10,001 is not 10,000, and a reference 10\,000 is not 0.
    assert score([r"\boxed{10\,001}", "0", "10000"], ["10000", r"10\,000", r"10\,000"]) == [
        0.0,
        0.0,
        1.0,
    ]
    # A comma between numbers of a tuple or interval is not a thousands separator.
    interval = r"(2,12) \cup (12,102)"
    assert score([rf"\boxed{{{interval}}}", r"\boxed{(2,12102)}"], [interval] * 2) == [1.0, 0.0]


def test_math_accuracy_solution_column_and_configured_column():
    completions = [r"\boxed{14}", r"\boxed{15}"]
    solutions = [r"Adding, we get $\boxed{14}$.", r"Adding, we get $\boxed{14}$."]
    assert math_accuracy(completions=completions, solution=solutions) == [1.0, 0.0]
    reward = math_accuracy_reward(answer_column="target")
    assert reward(completions=completions, target=["14", "14"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="'answer' or 'solution'"):
        math_accuracy(completions=completions, question=["a", "b"])
    with pytest.raises(ValueError, match="2 values for 1 completions"):
        math_accuracy(completions=["1"], answer=["1", "2"])


def test_math_accuracy_unparseable_reference_is_none_not_zero():
    references = [None, "", "#### ", "???", r"\boxed{}"]
    # Words are not LaTeX: as LaTeX, a sentence would be the product of its letters.
    references += ["no numeric reference here at all", "The cat sat.", "none", "unknown"]
    assert score(["The answer is 1."] * len(references), references) == [None] * len(references)
    # A reference in words is read as text, as a completion is; single letters stay algebra.
    completions = ["18", r"\boxed{72}", r"\boxed{\text{Evelyn}}", r"\boxed{ab}", r"\boxed{x^2}"]
    references = ["The answer is 18", "72 dollars", r"\text{Evelyn}", "ab", "x^2"]
    assert score(completions, references) == [1.0] * len(completions)


def test_empty_and_whitespace_completions_score_zero():
    assert score(["", "   ", "\n\t", "<think>72</think>  "], ["72"] * 4) == [0.0] * 4


def test_conversational_completions():
    completions = [
        [{"role": "assistant", "content": r"\boxed{18}"}],
        [{"role": "user", "content": r"\boxed{18}"}, {"role": "assistant", "content": "19"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "The answer is 18."}]}],
        [{"role": "assistant", "content": None}],
        [],
    ]
    assert score(completions, ["#### 18"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert completion_text("plain") == "plain"
    assert format_reward()(completions=[[{"role": "assistant", "content": "<think>a</think>b"}]])
    with pytest.raises(TypeError, match="list of messages"):
        completion_text(42)


def test_replacement_characters_from_undecodable_tokens():
    garbled = b"\xff\xfe the answer is \\boxed{72}".decode("utf-8", errors="replace")
    assert garbled.startswith("\ufffd")
    inside_number = b"\\boxed{7\xff2}".decode("utf-8", errors="replace")
    only_garbage = bytes(range(0x80, 0xC0)).decode("utf-8", errors="replace")
    assert score([garbled, inside_number, only_garbage], ["72"] * 3) == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------- hedging and several answers


def test_several_boxed_answers():
    completions = [r"\boxed{3} then \boxed{5}", r"\boxed{5} then \boxed{3}", r"\boxed{5}\boxed{5}"]
    # Default: more than one distinct boxed answer is a hedge, whichever comes last.
    assert score(completions, ["5"] * 3) == [0.0, 0.0, 1.0]
    # Allowing two, the last one is the answer.
    assert score(completions, ["5"] * 3, math_accuracy_reward(max_distinct_boxed=2)) == [
        1.0,
        0.0,
        1.0,
    ]


def test_listing_many_boxed_candidates_is_not_rewarded():
    candidates = " ".join(rf"\boxed{{{n}}}" for n in range(1, 101))
    references = ["37", "1", "100"]  # the middle, the first and the last candidate
    assert score([candidates] * 3, references) == [0.0, 0.0, 0.0]
    permissive = math_accuracy_reward(max_distinct_boxed=1000)  # the last box still decides
    assert score([candidates] * 3, references, permissive) == [0.0, 0.0, 1.0]


def test_listing_many_plain_candidates_is_not_rewarded():
    listing = ", ".join(str(n) for n in range(1, 101))
    completions = [
        f"The answer is {listing}.",
        f"The answer is {listing}.",
        listing,
        "\n".join(str(n) for n in range(1, 101)),
        "The answer is 1, 2, ..., 100",
        "It could be 12 or 13 or 14.",
    ]
    references = ["1", "100", "100", "100", "1", "#### 14"]
    assert score(completions, references) == [0.0] * 6
    # Numbers in the reasoning are fine; a set-valued reference may be a list.
    fine = ["I have 3, 4 and 5 apples, so 12 in all.", r"The solutions are $1, 2, 3$."]
    assert score(fine, ["#### 12", r"\{1, 2, 3\}"]) == [1.0, 1.0]


# ---------------------------------------------------------------- format, tag_count, lengths


def test_format_reward():
    reward = format_reward()
    assert reward.__name__ == "format"
    completions = [
        "<think>9 * 2 = 18</think>\nThe answer is 18.",
        "  <think>\nwork\n</think>  18  ",
        "The answer is 18.",
        "<think>work</think>",  # no answer
        "<think>   </think> 18",  # no reasoning
        "<think>a</think> 18 <think>b</think> 19",  # two blocks
        "<think>a <think> b</think> 18",  # nested
        "work</think> 18",  # no opening tag
    ]
    assert reward(completions=completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    template_opened = format_reward(think_open=None)  # the chat template opened <think>
    assert template_opened(completions=["work</think> 18", "work 18"]) == [1.0, 0.0]
    tagged = format_reward(answer_open="<answer>", answer_close="</answer>")
    assert tagged(
        completions=[
            "<think>w</think><answer>18</answer>",
            "<think>w</think>18",
            "<think>w</think><answer> </answer>",
        ]
    ) == [1.0, 0.0, 0.0]
    custom = format_reward(think_open="<reasoning>", think_close="</reasoning>")
    assert custom(completions=["<reasoning>w</reasoning> 18", "<think>w</think> 18"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="both answer_open and answer_close"):
        format_reward(answer_open="<answer>")


def test_tag_count_reward():
    reward = tag_count_reward()
    assert reward.__name__ == "tag_count"
    completions = [
        "<think>\na\n</think>\n<answer>\nb\n</answer>",
        "<think>a</think> b",
        "<answer>b</answer> <think>a</think>",  # answer before think: think tags still count
        "<think>a</think><think>b</think><answer>c</answer>",  # think tags repeated
        "no tags",
    ]
    assert reward(completions=completions) == [1.0, 0.5, 0.5, 0.5, 0.0]
    two = tag_count_reward(tags=("<think>", "</think>"))
    assert two(completions=["<think>a</think>", "</think>"]) == [1.0, 0.5]


def test_overlong_penalty():
    reward = overlong_penalty(max_length=100, cache_length=20)
    lengths = [0, 80, 81, 90, 100, 101, 1000]
    ids = [[7] * n for n in lengths]
    assert reward(completions=["x"] * len(ids), completion_ids=ids) == [
        0.0,
        0.0,
        -0.05,
        -0.5,
        -1.0,
        -1.0,
        -1.0,
    ]
    step = overlong_penalty(max_length=10, cache_length=0)
    assert step(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="needs `completion_ids`"):
        reward(completions=["x"])
    with pytest.raises(ValueError, match="cache_length <= max_length"):
        overlong_penalty(max_length=10, cache_length=20)


def test_length_reward():
    assert length_reward()(completions=["abc", [{"role": "assistant", "content": "ab"}]]) == [
        3.0,
        2.0,
    ]
    tokens = length_reward(unit="tokens")
    assert tokens(completions=["a", "b"], completion_ids=[[1, 2], [3]]) == [2.0, 1.0]
    assert length_reward(target=10)(completions=["x" * 10, "x" * 5, "x" * 30]) == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="needs `completion_ids`"):
        tokens(completions=["a"])


REWARD_MODULES = ["_convention", "registry", "accuracy", "format", "length"]


@pytest.mark.parametrize("module", REWARD_MODULES)
def test_docstring_examples_run(module):
    module = importlib.import_module(f"trl_grpo_ext.rewards.{module}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- registry


def test_built_ins_are_picklable():
    # TRL's async rollout worker sends reward functions to a spawned process.
    for name in ("math_accuracy", "format", "tag_count", "length"):
        reward = pickle.loads(pickle.dumps(get_reward(name)))
        assert reward.__name__ == name
    penalty = pickle.loads(pickle.dumps(overlong_penalty(max_length=4, cache_length=2)))
    assert penalty(completion_ids=[[1] * 3]) == [-0.5]


def test_registry_names_and_metric_names():
    assert {"math_accuracy", "format", "tag_count", "overlong_penalty", "length"} <= set(
        list_rewards()
    )
    for name in ("math_accuracy", "format", "tag_count", "length", "answer_tags"):
        assert get_reward(name).__name__ == name
    assert get_reward(math_accuracy) is math_accuracy
    # answer_tags on conversational completions: the last message's text.
    assert get_reward("answer_tags")(
        completions=[[{"role": "assistant", "content": "3 + 4 = 7\n<answer>7</answer>\n"}]]
    ) == [1.0]


def test_registry_factories_kwargs_and_dict_spec():
    penalty = get_reward("overlong_penalty", max_length=512, cache_length=128)
    assert penalty.__name__ == "overlong_penalty" and penalty.max_length == 512
    from_yaml = get_reward({"name": "overlong_penalty", "max_length": 512, "cache_length": 128})
    assert from_yaml(completion_ids=[[0] * 448]) == [-0.5]
    accuracy = get_reward({"name": "math_accuracy", "answer_column": "solution", "timeout": 2})
    assert (accuracy.answer_column, accuracy.timeout) == ("solution", 2.0)
    with pytest.raises(TypeError, match="max_length"):
        get_reward("overlong_penalty")
    with pytest.raises(ValueError, match="'name' key"):
        get_reward({"max_length": 3})


def test_registry_dotted_paths():
    for path in (
        "trl_grpo_ext.rewards.accuracy:math_accuracy",
        "trl_grpo_ext.rewards.math_accuracy",
    ):
        assert get_reward(path) is math_accuracy
    factory_path = "trl_grpo_ext.rewards.length.overlong_penalty"
    assert get_reward(factory_path, max_length=8, cache_length=4).__name__ == "overlong_penalty"
    think = get_reward("trl.rewards.think_format_reward")  # TRL's rewards work unchanged
    assert think.__name__ == "think_format_reward"
    assert think(completions=[[{"role": "assistant", "content": "<think>a</think>b"}]]) == [1.0]
    trl_accuracy = get_reward("trl.rewards:accuracy_reward")
    messages = [[{"role": "assistant", "content": r"\boxed{\frac{1}{3}}"}]]
    assert trl_accuracy(completions=messages, solution=[r"$\frac{1}{3}$"]) == [1.0]


def test_registry_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown reward 'math_acuracy'") as error:
        get_reward("math_acuracy")
    assert "Did you mean 'math_accuracy'" in str(error.value)
    assert "format, " in str(error.value) and "overlong_penalty" in str(error.value)
    with pytest.raises(ImportError, match="no module named 'no_such_package'"):
        get_reward("no_such_package.rewards:score")
    with pytest.raises(ImportError, match="no module named 'no_such_package'"):
        get_reward("no_such_package.rewards.score")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        get_reward("trl_grpo_ext.rewards.accuracy:nope")
    (tmp_path / "broken_rewards.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="importing 'broken_rewards' failed.*not_installed"):
        get_reward("broken_rewards:score")
    register_reward("test_plain", overwrite=True)(lambda **kwargs: [])
    with pytest.raises(TypeError, match="takes no arguments"):
        get_reward("test_plain", scale=2)
    with pytest.raises(TypeError, match="not callable"):
        get_reward("trl_grpo_ext.rewards._verify:MAX_DIGITS")


def test_register_reward():
    @register_reward("test_shout", overwrite=True)
    def shout(prompts=None, completions=None, **kwargs):
        return [float(text.isupper()) for text in completions]

    @register_reward("test_scaled_length", factory=True, overwrite=True)
    def scaled_length(scale: float = 1.0):
        def scaled(prompts=None, completions=None, **kwargs):
            return [scale * len(text) for text in completions]

        return scaled

    assert "test_shout" in list_rewards()
    assert get_reward("test_shout")(completions=["HI", "hi"]) == [1.0, 0.0]
    assert get_reward("test_scaled_length", scale=2)(completions=["abc"]) == [6]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_shout")(shout)
    with pytest.raises(ValueError, match="may not"):
        register_reward("my.reward")


# ---------------------------------------------------------------- hostile completions

HOSTILE = {
    "100k-char expression": "1+" * 50_000 + "1",
    "100k-char boxed expression": r"\boxed{" + "1+" * 50_000 + "1}",
    "deeply nested braces": "{" * 50_000 + "72" + "}" * 50_000,
    "boxed nested braces": r"\boxed{" + "{" * 5_000 + "72" + "}" * 5_000 + "}",
    "frac nested 500": "$" + r"\frac{" * 500 + "1" + "}{2}" * 500 + "$",
    "boxed frac nested 500": r"\boxed{" + r"\frac{" * 500 + "1" + "}{2}" * 500 + "}",
    "boxed frac nested 20 (exponential parse)": r"\boxed{"
    + r"\frac{" * 20
    + "1"
    + "}{2}" * 20
    + "}",
    "nested parentheses": "(" * 20_000 + "72" + ")" * 20_000,
    "power tower (C-level bigint)": r"\boxed{10^{10^{10}}}",
    "huge binomial (slow sympy)": r"\boxed{\binom{10^{10}}{10^{5}}}",
    "slow expansion": r"\boxed{(x+1)^{1000}}",
    "100k dollars": "$" * 100_000,
    "display math soup": r"\[" * 30_000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_completion_scores_zero_within_bound(name):
    reward = math_accuracy_reward(timeout=1.0)
    start = time.monotonic()
    assert score([HOSTILE[name]], ["72"], reward) == [0.0]
    assert time.monotonic() - start < _pool.hard_deadline(1.0) + SLACK_S


def test_timeout_is_configurable():
    reward = math_accuracy_reward(timeout=0.2)
    start = time.monotonic()
    assert score([HOSTILE["slow expansion"]], ["72"], reward) == [0.0]
    assert time.monotonic() - start < _pool.hard_deadline(0.2) + SLACK_S
    with pytest.raises(ValueError, match="timeout"):
        math_accuracy_reward(timeout=0)


def test_threads_with_hostile_completions():
    batches = [
        (["The answer is 72.", r"\boxed{72}", "#### 71"], [1.0, 1.0, 0.0]),
        ([HOSTILE["power tower (C-level bigint)"], r"\boxed{72}"], [0.0, 1.0]),
        ([HOSTILE["slow expansion"], "72"], [0.0, 1.0]),
        ([HOSTILE["deeply nested braces"], "It is 72 apples."], [0.0, 1.0]),
        ([r"\boxed{\frac{144}{2}}"] * 4, [1.0] * 4),
    ] * 2

    def run(batch):
        completions, _ = batch
        assert threading.current_thread() is not threading.main_thread()
        return score(completions, ["#### 72"] * len(completions))

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as executor:
        results = list(executor.map(run, batches))
    assert results == [expected for _, expected in batches]
    # 2 slow completions at ~1 s of CPU each, plus slack
    assert time.monotonic() - start < 2 * _pool.hard_deadline(1.0) + 2 * SLACK_S


def test_in_process_scoring_off_the_main_thread():
    # Without worker processes (TRL_GRPO_EXT_VERIFY_WORKERS=0) there is no signal off the main
    # thread, but the input caps still keep the hostile inputs fast.
    def run():
        return [
            _verify.score_bounded("72", HOSTILE[name], 1.0, {})[0]
            for name in ("100k-char expression", "frac nested 500", "power tower (C-level bigint)")
        ] + [_verify.score_bounded("72", r"\boxed{72}", 1.0, {})[0]]

    with ThreadPoolExecutor(max_workers=1) as executor:
        assert executor.submit(run).result(timeout=30) == [0.0, 0.0, 0.0, 1.0]
    start = time.monotonic()  # in the main thread, a SIGALRM timer bounds it (wall clock)
    assert _verify.score_bounded("72", HOSTILE["slow expansion"], 0.3, {}) == [0.0, "timeout"]
    assert time.monotonic() - start < 0.3 + SLACK_S


def test_a_deadline_something_swallowed_fires_again():
    # Python prints and drops an exception raised in a garbage-collector callback or a finaliser;
    # when the timer's Deadline lands there, the scoring code must still be stopped.
    swallowed = []

    def slow():
        while True:
            try:
                while True:
                    pass
            except _verify.Deadline:
                if swallowed:
                    raise
                swallowed.append(time.monotonic())

    start = time.monotonic()
    with pytest.raises(_verify.Deadline):
        _verify.run_with_deadline(0.2, slow)
    assert len(swallowed) == 1
    assert time.monotonic() - start < 0.2 + _verify.RETRY_S + SLACK_S
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # disarmed after the call


def _score_in_child(completions):
    import os

    os.environ["TRL_GRPO_EXT_VERIFY_WORKERS"] = "1"
    return math_accuracy(completions=completions, answer=["72"] * len(completions))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_in_forked_daemon_processes():
    score([r"\boxed{72}"], ["72"])  # the parent's pool exists before the fork
    context = multiprocessing.get_context("fork")
    completions = [r"\boxed{72}", HOSTILE["slow expansion"], "71"]
    with context.Pool(1) as pool:  # pool workers are daemons
        assert pool.apply(_score_in_child, (completions,)) == [1.0, 0.0, 0.0]
    assert score([r"\boxed{72}"], ["72"]) == [1.0]  # the parent's workers are untouched


FAKE_WORKER = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        reference, completion, seconds, options = json.loads(line)
        if completion == "hang":
            while True:  # ignores signals, like sympy computing a huge integer in C
                pass
        if completion == "crash":
            os._exit(1)
        print(json.dumps([1.0, "ok"]), flush=True)
    """
)


def test_pool_kills_and_replaces_a_worker_that_hangs_or_dies(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    pool = _pool.VerifierPool(1, script=str(script))
    try:
        start = time.monotonic()
        results = pool.map([("1", "hang", {}), ("1", "fine", {}), ("1", "crash", {})], 0.3)
        assert results == [
            [0.0, "timeout (worker killed)"],
            [1.0, "ok"],
            [0.0, "error: verifier worker died"],
        ]
        assert pool.restarts == 2
        assert time.monotonic() - start < _pool.hard_deadline(0.3) + SLACK_S + 5  # + 2 restarts
        assert pool.map([("1", "fine", {})], 0.3) == [[1.0, "ok"]]
    finally:
        pool.close()


def test_pool_reports_a_worker_that_cannot_start(tmp_path):
    script = tmp_path / "broken_worker.py"
    script.write_text("import json\nprint(json.dumps({'error': 'no math-verify'}), flush=True)\n")
    with pytest.raises(_pool.WorkerStartError, match="no math-verify"):
        _pool.VerifierPool(1, script=str(script))


# ---------------------------------------------------------------- real data


def _sample(path: Path, size: int) -> list[dict]:
    with path.open() as file:
        rows = [json.loads(line) for line in file]
    return random.Random(0).sample(rows, min(size, len(rows)))


@pytest.mark.skipif(not (DATA / "gsm8k").is_dir(), reason="../shared/data/gsm8k is absent")
def test_gsm8k_reference_solutions_score_their_own_answers():
    rows = _sample(DATA / "gsm8k" / "test.jsonl", 200)
    scores = score([row["answer"] for row in rows], [row["answer"] for row in rows])
    assert sum(s == 1.0 for s in scores) / len(rows) >= 0.98


@pytest.mark.skipif(not (DATA / "math500").is_dir(), reason="../shared/data/math500 is absent")
def test_math500_reference_solutions_score_their_own_answers():
    rows = _sample(DATA / "math500" / "test.jsonl", 200)
    scores = score([row["solution"] for row in rows], [row["answer"] for row in rows])
    assert sum(s == 1.0 for s in scores) / len(rows) >= 0.98
    # and another row's answer is (nearly always) wrong
    others = ["\\boxed{" + rows[i - 1]["answer"] + "}" for i in range(len(rows))]
    scores = score(others, [row["answer"] for row in rows])
    assert sum(s == 1.0 for s in scores) / len(rows) < 0.05


# ---------------------------------------------------------------- what a reward function returns


def _call(*funcs, size: int = 4):
    from trl_grpo_ext.scoring import call_reward_funcs

    return call_reward_funcs(
        list(funcs),
        prompts=["q"] * size,
        completions=["c"] * size,
        completion_ids=[[1]] * size,
        trainer_state=None,
    )


def _returning(value, name="scorer"):
    def reward(completions, **kwargs):
        return value

    reward.__name__ = name
    return reward


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_score_is_an_error_naming_function_value_and_sample(bad):
    from trl_grpo_ext.scoring import RewardFunctionError

    value = re.escape(str(bad))
    message = rf"'scorer' returned {value} for sample 2; scores must be finite"
    for returned in ([1.0, None, bad, 0.0], torch.tensor([1.0, 0.0, bad, 0.0])):
        with pytest.raises(RewardFunctionError, match=message):
            _call(_returning(returned))
    # numpy scalars too (np.float32(nan) is a numbers.Real)
    with pytest.raises(RewardFunctionError, match=message):
        _call(_returning([1.0, 1.0, numpy.float32(bad), 1.0]))


def test_only_none_means_not_applicable():
    rewards = _call(_returning([None, 1.0, None, -2.5]))
    assert torch.isnan(rewards[[0, 2], 0]).all()
    assert rewards[[1, 3], 0].tolist() == [1.0, -2.5]


@pytest.mark.parametrize("returned", ["1.0", "1234", b"1.0", {"a": 1.0, "b": 2.0, "c": 3, "d": 4}])
def test_a_string_or_mapping_is_reported_as_such_not_as_a_wrong_length(returned):
    from trl_grpo_ext.scoring import RewardFunctionError

    kind = type(returned).__name__
    with pytest.raises(
        RewardFunctionError, match=rf"'scorer' returned a {kind} .*must return a list"
    ):
        _call(_returning(returned))


def test_booleans_count_as_one_and_zero_as_in_trl():
    expected = [[1.0, 0.0, 1.0, 0.0]] * 5
    rewards = _call(
        _returning([True, False, True, False], "python"),
        _returning(numpy.array([True, False, True, False]), "numpy_array"),
        _returning([numpy.bool_(True), numpy.bool_(False)] * 2, "numpy_scalars"),
        _returning(torch.tensor([True, False, True, False]), "torch_tensor"),
        _returning([torch.tensor(True), torch.tensor(False)] * 2, "torch_scalars"),
    )
    assert rewards.T.tolist() == expected
    # Mixed with floats and None in one list.
    assert _call(_returning([True, 0.5, None, False]))[:, 0].nan_to_num(-1).tolist() == [
        1.0, 0.5, -1.0, 0.0,
    ]  # fmt: skip


def test_per_function_metrics_are_nan_where_trl_logs_nan(tmp_path):
    from trainer_helpers import logged, make_trainer, odd_first_byte

    def never(completions, **kwargs):
        return [None] * len(completions)

    def once(completions, **kwargs):
        return [0.5] + [None] * (len(completions) - 1)

    trainer = make_trainer(tmp_path, reward_funcs=[odd_first_byte, never, once], max_steps=1)
    trainer.train()
    # A column that is None on every row has no mean and no std (TRL: nanmean, nanstd -> NaN),
    # not a mean of 0 that reads like "always wrong".
    assert math.isnan(logged(trainer, "rewards/never/mean")[0])
    assert math.isnan(logged(trainer, "rewards/never/std")[0])
    # One valid value: its mean, and a NaN std (Bessel's correction of one sample, as trl.nanstd).
    assert logged(trainer, "rewards/once/mean") == [0.5]
    assert math.isnan(logged(trainer, "rewards/once/std")[0])
    assert not math.isnan(logged(trainer, "rewards/odd_first_byte/std")[0])
