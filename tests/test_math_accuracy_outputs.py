r"""`math_accuracy` on what models write, right and wrong: each completion must score what a human
grader gives it. TRL's `accuracy_reward` scores the same cases; every case where it disagrees
with the grader carries the reason, one of those listed in docs/rewards.md ("Using TRL's
rewards")."""

from __future__ import annotations

import logging

import pytest

from trl_grpo_ext.rewards import math_accuracy

RIGHT, WRONG = 1.0, 0.0

# Why TRL's accuracy_reward (math-verify with its settings) scores a case other than a grader.
PLAIN = "TRL reads only LaTeX answers: plain text and `#### 18` score 0"
UNANCHORED = "TRL reads unboxed LaTeX only after 'the answer is'"
THOUSANDS = r"TRL reads `10\,000` as 10*000, and `= 3,600` in an equation as a list"
BARE_REFERENCE = r"TRL reads a reference outside `$...$` as plain text: `10,\!080` is 10"
RESTATED = "TRL pays arithmetic left undone (`52 + 6` for 58): verify finds it equal"
HEDGE = "TRL pays the first of several boxed answers"

JANET = (
    "Janet's ducks lay 16 eggs per day. She eats 3 for breakfast and bakes muffins with 4, "
    "so she has 16 - 3 - 4 = 9 eggs left. She sells them at $2 each, so she makes 9 * 2 = $18."
)
GSM8K_STYLE = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18"
)

# (completion, reference, the grader's score, why TRL differs or None)
CASES = [
    # Right, in the forms models end their solutions with.
    (JANET + "\nThe answer is 18.", "#### 18", RIGHT, PLAIN),
    (GSM8K_STYLE, "#### 18", RIGHT, PLAIN),
    ("The answer is: 18", "#### 18", RIGHT, PLAIN),
    ("**Answer:** 18 dollars", "#### 18", RIGHT, PLAIN),
    ("So she makes 18 dollars a day.", "#### 18", RIGHT, PLAIN),
    (r"She makes $9 \times 2 = \boxed{18}$ dollars.", "#### 18", RIGHT, None),
    (r"\boxed{9 \times 2 = 18}", "#### 18", RIGHT, None),
    (r"So she makes \boxed{\$18} every day.", "#### 18", RIGHT, None),
    (r"\boxed{18} dollars", "#### 18", RIGHT, None),
    ("<think>16-3-4=9, 9*2=18</think>\nThe answer is \\boxed{18}.", "#### 18", RIGHT, None),
    (r"Therefore, the answer is $12 - 5 = 7$.", "#### 7", RIGHT, None),
    (r"Janet makes \(9 \times 2 = 18\) dollars every day.", "#### 18", RIGHT, UNANCHORED),
    (r"The area is $\frac{1}{2} \cdot 6 \cdot 4 = 12$ square units.", "12", RIGHT, UNANCHORED),
    (r"So $x = \frac{14}{3}$.", r"\frac{14}{3}", RIGHT, UNANCHORED),
    (r"The probability is $\frac{3}{6} = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}", RIGHT, None),
    (r"The answer is $\frac{1}{2}$.", "0.5", RIGHT, None),
    ("x = 52 + 6 = 58", "58", RIGHT, PLAIN),
    ("Each ticket costs 7.50 / 3 = 2.50 dollars.\nThe answer is 2.5.", "#### 2.5", RIGHT, PLAIN),
    ("The answer is 25%.", "#### 25", RIGHT, PLAIN),
    ("It falls to 5 - 8 = -3 degrees. The answer is -3.", "#### -3", RIGHT, PLAIN),
    # Thousands, as models and LaTeX write them.
    ("The house cost $80,000 + $50,000 = $130,000.\n#### 130,000", "#### 130,000", RIGHT, PLAIN),
    ("The profit is $200,000 - $130,000 = $70,000.", "#### 70000", RIGHT, PLAIN),
    (r"The answer is $\boxed{70{,}000}$.", "#### 70000", RIGHT, None),
    (r"The answer is $200{,}000 - 130{,}000 = 70{,}000$.", "#### 70000", RIGHT, THOUSANDS),
    (r"The answer is $3 \times 1,200 = 3,600$.", "#### 3600", RIGHT, THOUSANDS),
    (r"\boxed{10\,000}", "10000", RIGHT, THOUSANDS),
    (r"\boxed{10 000}", "10000", RIGHT, THOUSANDS),
    (r"The answer is $10\,000$.", "10000", RIGHT, THOUSANDS),
    (r"\boxed{10,\!080}", r"10,\!080", RIGHT, BARE_REFERENCE),
    # Wrong: another number, a wrong last step, no answer.
    ("#### 17", "#### 18", WRONG, None),
    ("She has 18 eggs at first.\nThe answer is 9.", "#### 18", WRONG, None),
    ("The answer is 1800.", "#### 18", WRONG, None),
    (r"\boxed{52 + 6 = 59}", "58", WRONG, None),
    (r"She makes $9 \times 2 = 18$, then $18 + 2 = 20$.", "#### 18", WRONG, None),
    (r"\boxed{10\,001}", "10000", WRONG, None),
    ("I don't know.", "#### 18", WRONG, None),
    ("She sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 =", "#### 18", WRONG, None),
    # Wrong: the question restated ("What is 52 + 6?").
    ("The answer is 52 + 6.", "58", WRONG, None),
    (r"\boxed{52 + 6}", "58", WRONG, RESTATED),
    ("52 + 6 = 52 + 6", "58", WRONG, None),
    (r"What is $9 \times 2$? The answer is $9 \times 2$.", "#### 18", WRONG, RESTATED),
    (r"The answer is $2^{10}$.", "1024", WRONG, RESTATED),
    # Wrong: hedges.
    ("The answer is 16, 17 or 18.", "#### 18", WRONG, None),
    (r"\boxed{17} or maybe \boxed{18}", "#### 18", WRONG, None),
    (r"\boxed{16}, \boxed{17} or \boxed{18}", "#### 16", WRONG, HEDGE),
]
REASONS = {PLAIN, UNANCHORED, THOUSANDS, BARE_REFERENCE, RESTATED, HEDGE}


def _ids():
    return [f"{index}-{completion[-30:]}" for index, (completion, *_) in enumerate(CASES)]


@pytest.mark.parametrize("completion, reference, expected, trl_differs", CASES, ids=_ids())
def test_scores_what_a_grader_gives(completion, reference, expected, trl_differs):
    assert math_accuracy(completions=[completion], answer=[reference]) == [expected]


def test_references_with_nothing_to_parse_are_not_applicable():
    references = ["no numeric reference here at all", "The cat sat.", "", None]
    completions = ["The answer is 18."] * len(references)
    assert math_accuracy(completions=completions, answer=references) == [None] * len(references)


def test_every_disagreement_with_trl_is_explained():
    from trl.rewards import accuracy_reward

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    trl_scores = accuracy_reward(
        completions=[[{"role": "assistant", "content": completion}] for completion, *_ in CASES],
        solution=[reference for _, reference, *_ in CASES],
    )
    unexplained = [
        (completion, trl_score)
        for (completion, _, expected, reason), trl_score in zip(CASES, trl_scores)
        if trl_score != expected and reason is None
    ]
    assert not unexplained
    assert {reason for *_, reason in CASES} - {None} == REASONS
