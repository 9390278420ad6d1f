r"""`math_accuracy` on every GSM8K and MATH-500 reference: each number, written as worked
arithmetic that ends in it (`15 + 3 = 18`), scores 1.0; the same arithmetic without its result
(`15 + 3`, restating the question) scores 0.0.

The equations are built from the reference's exact value (fractions.Fraction), so `a op b`
equals the reference by construction; which references are numbers is decided here from the text
alone, not by the reward's own parser. The data is read from `../shared/data` (see its README),
never copied into the project; the tests skip when it is absent. GSM8K test and MATH-500 run by
default (about 40 s on a loaded 2-core machine), GSM8K train (7,473 references) under `slow`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from trl_grpo_ext.rewards import math_accuracy_reward

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
# A generous timeout: this checks the rules, not the speed of a loaded machine.
reward = math_accuracy_reward(timeout=10.0)

_SEPARATOR = r"(?:,\\!\s*|\{,\}|,)"
_GROUPED = re.compile(rf"-?\d{{1,3}}(?:{_SEPARATOR}\d{{3}})+(?:\.\d+)?")
_FRACTION = re.compile(r"(-?)\\d?frac\s*(?:\{(\d+)\}|(\d))\s*(?:\{(\d+)\}|(\d))")
_DECIMAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")
# A number followed by a unit or preceded by a currency sign; kept as written on the right-hand side.
_UNIT = re.compile(r"(\\\$)?(.*?)(\^\\circ|\s*\\(?:text|mbox)\{[^{}]*\}(?:\^2)?|\\%)?")


def number_value(answer: str) -> tuple[Fraction, bool] | str:
    """(exact value, is a decimal) of a reference that is one real number, else why it is not."""
    match = _UNIT.fullmatch(answer.strip())
    text = match.group(2).strip()
    if _GROUPED.fullmatch(text):  # thousands: 58,500 and 10,\!080
        text = re.sub(_SEPARATOR, "", text)
    if re.fullmatch(r"\d+_\{?\d+\}?", text):
        return "a number in another base"
    if re.fullmatch(r"-?\d+\s*\\d?frac.*", text):
        return "a mixed number (LaTeX reads 1\\frac{4}{5} as a product)"
    if _DECIMAL.fullmatch(text):
        return Fraction(Decimal(text)), "." in text
    fraction = _FRACTION.fullmatch(text)
    if fraction:
        sign, num1, num2, den1, den2 = fraction.groups()
        return Fraction(int(num1 or num2), int(den1 or den2)) * (-1 if sign else 1), False
    return "not a single real number (an expression, tuple, interval, matrix or text)"


def latex(value: Fraction, decimal: bool) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    if decimal:
        return format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    sign = "-" if value < 0 else ""
    return rf"{sign}\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def worked_arithmetic(value: Fraction, decimal: bool, index: int, plain: bool) -> str:
    """`a op b` that equals `value` exactly; the operation cycles with `index`."""
    times = "*" if plain else (r"\times", r"\cdot")[index // 3 % 2]
    operation = index % 3
    if operation == 2 and value.denominator == 1 and abs(value) >= 4:
        factor = next((p for p in range(2, 100) if value.numerator % p == 0), None)
        if factor and factor != abs(value):
            return f"{latex(value / factor, decimal)} {times} {factor}"
    if operation == 1 or value - 3 < 0:
        return f"{latex(value + 7, decimal)} - 7"
    return f"{latex(value - 3, decimal)} + 3"


WORKED = [
    r"\boxed{{{work} = {result}}}",
    r"Therefore, the answer is ${work} = {result}$.",
    r"So she pays \({work} = {result}\) in all.",
    "So the total is {work} = {result}.",  # plain text: only for plain numbers
]
RESTATED = [
    r"\boxed{{{work}}}",
    r"Therefore, the answer is ${work}$.",
    r"So she pays \({work}\) in all.",
    "The answer is {work}.",
]


def build_cases(answers: list[str]) -> tuple[list[tuple[str, str, str]], Counter]:
    """(reference, worked completion, restated completion) for each number; skipped: reasons."""
    cases, skipped = [], Counter()
    for index, answer in enumerate(answers):
        parsed = number_value(answer)
        if isinstance(parsed, str):
            skipped[parsed] += 1
            continue
        value, decimal = parsed
        plain = re.fullmatch(r"-?[\d.,]+", answer) is not None
        work = worked_arithmetic(value, decimal, index, plain)
        template = index % (4 if plain else 3)
        cases.append(
            (
                answer,
                WORKED[template].format(work=work, result=answer),
                RESTATED[template].format(work=work),
            )
        )
    return cases, skipped


def check_corpus(answers: list[str], column: str = "answer") -> tuple[int, Counter]:
    cases, skipped = build_cases(answers)
    references = [reference for reference, _, _ in cases]
    worked = reward(completions=[c for _, c, _ in cases], **{column: references})
    restated = reward(completions=[c for _, _, c in cases], **{column: references})
    wrong_worked = [case[:2] for case, got in zip(cases, worked) if got != 1.0]
    wrong_restated = [case[::2] for case, got in zip(cases, restated) if got != 0.0]
    assert not wrong_worked, f"{len(wrong_worked)} worked answers not paid: {wrong_worked[:10]}"
    assert not wrong_restated, f"{len(wrong_restated)} restatements paid: {wrong_restated[:10]}"
    return len(cases), skipped


def _gsm8k_answers(split: str) -> list[str]:
    with (DATA / "gsm8k" / f"{split}.jsonl").open() as file:
        rows = [json.loads(line) for line in file]
    return [row["answer"].rsplit("####", 1)[1].strip() for row in rows]  # 1,080 as written


needs_gsm8k = pytest.mark.skipif(
    not (DATA / "gsm8k").is_dir(), reason="../shared/data/gsm8k is absent"
)


def test_the_equations_equal_their_references():
    # The builder itself, on hand-checked values.
    assert number_value(r"\$32,\!348") == (Fraction(32348), False)
    assert number_value(r"-\frac{35}{9}") == (Fraction(-35, 9), False)
    assert number_value(r"\frac43") == (Fraction(4, 3), False)
    assert number_value(".0000672") == (Fraction(672, 10_000_000), True)
    assert number_value("90^\\circ") == (Fraction(90), False)
    assert number_value(r"5.4 \text{ cents}") == (Fraction(54, 10), True)
    assert isinstance(number_value(r"1\frac{4}{5}"), str)
    assert isinstance(number_value("52_8"), str) and isinstance(number_value("p - q"), str)
    assert worked_arithmetic(Fraction(18), False, 0, True) == "15 + 3"
    assert worked_arithmetic(Fraction(18), False, 1, True) == "25 - 7"
    assert worked_arithmetic(Fraction(18), False, 2, True) == "9 * 2"
    assert worked_arithmetic(Fraction(17), False, 2, False) == r"14 + 3"  # a prime: no product
    assert worked_arithmetic(Fraction(1, 2), False, 0, False) == r"\frac{15}{2} - 7"
    assert worked_arithmetic(Fraction(5, 4), True, 4, False) == "8.25 - 7"


@needs_gsm8k
def test_gsm8k_test_references_as_worked_arithmetic():
    count, skipped = check_corpus(_gsm8k_answers("test"))
    assert (count, sum(skipped.values())) == (1319, 0)


@pytest.mark.slow
@needs_gsm8k
def test_gsm8k_train_references_as_worked_arithmetic():
    count, skipped = check_corpus(_gsm8k_answers("train"))
    assert (count, sum(skipped.values())) == (7473, 0)


@pytest.mark.skipif(not (DATA / "math500").is_dir(), reason="../shared/data/math500 is absent")
def test_math500_number_references_as_worked_arithmetic():
    with (DATA / "math500" / "test.jsonl").open() as file:
        answers = [json.loads(line)["answer"] for line in file]
    count, skipped = check_corpus(answers)
    # 398 answers are numbers (311 integers, fractions, decimals, thousands, degrees, dollars);
    # the rest are skipped, and a change to what is skipped must show up here.
    assert count == 398
    assert sorted(skipped.values()) == [2, 6, 94], skipped  # mixed numbers, bases, the rest
