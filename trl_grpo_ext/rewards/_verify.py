"""Score one completion against one reference answer with math-verify: the pure core of
`math_accuracy`.

This file is self-contained on purpose (it imports nothing from `trl_grpo_ext`): `_pool.py` runs it
as the main program of each verifier worker process, where importing the package would also
import torch. `score()` is also called in-process when worker processes are disabled.

What is compared (documented for users in docs/rewards.md):

0. The reference: a GSM8K answer (the number after `####`), a solution with `\\boxed{}` (the last
   box), or a bare answer, read as LaTeX unless it holds words ("72 dollars", "The answer is 18"
   are read as text, as math-verify reads a completion). A reference with nothing to parse ("The
   cat sat.") gives None, never 0.0. LaTeX thousands separators (`10\\,000`, `10{,}000`,
   `10,\\!000`) are removed from the reference and the answer alike: LaTeX reads `10\\,000` as
   10*000.
1. The answer section is the text after the last `</think>` (the whole text when there is none).
2. If it holds complete `\\boxed{...}` (or `\\fbox{...}`) answers, the last one is the answer; more
   than `max_distinct_boxed` distinct boxed answers (compared as text without spaces) is a hedge
   and scores 0.0. A boxed answer that is one number with commas or spaces between groups of
   three digits (`1,234`, `10 000`) is that number. Otherwise, the text after the last `####`
   (GSM8K style) is the answer; otherwise math-verify searches the last `TAIL_CHARS` characters
   ("answer is ...", the last number or LaTeX expression). With a single-number reference,
   comma-grouped digits anywhere in the answer are one number (`= 58,500`, which LaTeX would
   read as the set {58, 500}).
3. Without a boxed answer and with a single-number reference, a list of three or more distinct
   numbers that ends the completion or follows "answer"/"####" is a hedge and scores 0.0:
   math-verify would pick one of them (the first after "answer", else the last).
4. With a single-number reference, an answer whose compared value is unevaluated arithmetic on
   numbers (`52 + 6`, `52*6`, `2^2`) scores 0.0: math-verify parses without evaluating and
   `verify` then finds `52 + 6` equal to 58, so restating the question ("What is 52 + 6?" ->
   "The answer is 52 + 6.") would be paid as a right answer. The compared value is what `verify`
   compares with a number: the last right-hand side of an equation or chain (`52 + 6 = 58` ->
   58, a right answer; `x = 52 + 6` -> `52 + 6`), else the whole answer. Fractions (`104/2`) and
   powers of ten stay answers.
5. Cheap caps run before math-verify so that it never sees an input that explodes: an answer over
   `MAX_ANSWER_CHARS` characters, nesting deeper than `MAX_NESTING`, or a parsed number with more
   than `MAX_DIGITS` digits (`10^{10^{10}}`, which sympy would compute in C, beyond any signal)
   scores 0.0.
"""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import sys
import threading
from functools import lru_cache

MAX_ANSWER_CHARS = 1_000  # a final answer longer than this is not an answer
MAX_NESTING = 12  # deeper {} () [] nesting is not an answer (and parses in exponential time)
TAIL_CHARS = 2_000  # without a boxed answer, only the end of the completion is searched
MAX_DIGITS = 100_000  # numbers with more digits are not computed (sympy would compute them in C)
HEDGE_MIN_NUMBERS = 3  # this many distinct numbers in a final list is a hedge, not an answer

_BRACE_TOKEN = re.compile(r"\\[{}]|\\(?:boxed|fbox)\s*\{|[{}]")
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_SEPARATOR = r"(?:[\s,;$]|\bor\b|\band\b|\.\.\.|…|\\[lc]?dots)+"
_NUMBER_LIST = re.compile(
    rf"(?<![\w.]){_NUMBER}(?:{_SEPARATOR}{_NUMBER}){{{HEDGE_MIN_NUMBERS - 1},}}"
)
_ANCHOR_BEFORE = re.compile(r"(?i:answer|####|\bis\b|=)[^\n]{0,60}$")
_TRAILING = re.compile(r"[\s.!$)\]}*]*$")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_MATH_DOLLAR = re.compile(r"(?<!\\)\$")
# Thousands separators. LaTeX's spacings (`10\,000`, `10{,}000`, `10,\!000`) count anywhere
# between groups of 3 digits: the LaTeX parser reads `10\,000` as 10*000 = 0. A comma or a plain
# space only counts in a boxed answer that is one number, since elsewhere it separates items.
_GROUP_SEPARATOR = r"(?:\{,\}|,\\!\s*|\\[,;: ]|~|[\u00a0\u2009\u202f])"
_GROUPED_DIGITS = re.compile(rf"(?<![\d.])\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?!\d)")
_THOUSANDS = re.compile(rf"-?\d{{1,3}}(?:(?:{_GROUP_SEPARATOR}|,| )\d{{3}})+(?:\.\d+)?")
_ANY_SEPARATOR = re.compile(rf"{_GROUP_SEPARATOR}|[, ]")
_COMMA_GROUPS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?!\d|,\d)")
# A bare reference is LaTeX unless it holds words (outside commands and `\text{}`): as LaTeX,
# "72 dollars" is 72 times the letters of "dollars", and a sentence is a product of its letters.
_TEXT_GROUP = re.compile(r"\\(?:text\w*|mbox|mathrm|operatorname|begin|end)\s*\{[^{}]*\}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


RETRY_S = 0.05  # how soon a Deadline fires again when something swallowed it


class Deadline(BaseException):
    """Raised by the timer signal. A BaseException so that math-verify's `except Exception`
    blocks do not swallow it and carry on with the next comparison."""


def _extraction_configs(latex_first: bool):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(boxed_match_priority=0)
    return [latex, ExprExtractionConfig()] if latex_first else [ExprExtractionConfig(), latex]


def _parse(text: str, latex_first: bool = True) -> list:
    from math_verify import parse

    # parsing_timeout=None: no signal.alarm inside math-verify; the caller bounds the time.
    return parse(text, _extraction_configs(latex_first), parsing_timeout=None)


def boxed_answers(text: str) -> list[tuple[str, int]]:
    r"""Contents of the complete `\boxed{...}`/`\fbox{...}` groups in `text`, in order, each with
    its brace nesting depth. One linear pass, whatever the input (no regex backtracking)."""
    found: list[tuple[int, int, int]] = []  # (start, end, depth) of each boxed content
    stack: list[list] = []  # [is_boxed, content_start, deepest_child_depth]
    for token in _BRACE_TOKEN.finditer(text):
        symbol = token.group()
        if symbol.startswith("\\") and len(symbol) == 2:  # \{ or \}: a literal brace
            continue
        if symbol == "}":
            if not stack:
                continue
            is_boxed, start, depth = stack.pop()
            if stack:
                stack[-1][2] = max(stack[-1][2], depth + 1)
            if is_boxed:
                found.append((start, token.start(), depth))
        else:
            stack.append([symbol != "{", token.end(), 0])
    found.sort()
    return [(text[start:end], depth) for start, end, depth in found]


def nesting_depth(text: str) -> int:
    """Deepest nesting of (), [] and {} in `text`; stray closing brackets are ignored."""
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}" and depth:
            depth -= 1
    return deepest


def join_digit_groups(text: str) -> str:
    r"""Remove LaTeX thousands separators between groups of 3 digits: `10\,000`, `10{,}000`,
    `10,\!000`, `10~000` -> `10000`."""
    return _GROUPED_DIGITS.sub(lambda match: _ANY_SEPARATOR.sub("", match.group()), text)


def reads_as_text(text: str) -> bool:
    """True when a bare reference holds words: two or more runs of letters, or one of four or more
    letters, outside LaTeX commands and `\\text{}` (`ab`, `xyz` and `2\\pi r` stay algebra)."""
    words = _WORD.findall(_LATEX_COMMAND.sub(" ", _TEXT_GROUP.sub(" ", text)))
    return len(words) >= 2 or any(len(word) >= 4 for word in words)


@lru_cache(maxsize=4096)
def parse_reference(reference: str) -> tuple | None:
    r"""Parse a reference answer: GSM8K (`... #### 72`), a solution with `\boxed{}` (MATH), or a
    bare answer (`\frac{1}{2}`, `72`). Returns None when no mathematical object can be parsed."""
    text = join_digit_groups(reference.strip())
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
        parsed = _parse(text, latex_first=False)
    elif "\\boxed" in text or "\\fbox" in text:
        boxed = boxed_answers(text)
        parsed = _parse(f"\\boxed{{{boxed[-1][0]}}}") if boxed else _parse(text)
    elif _MATH_DOLLAR.search(text):  # already has $...$ math (a \$ is a currency sign)
        parsed = _parse(text)
    elif reads_as_text(text):  # "The answer is 18", "72 dollars": no LaTeX product of letters
        parsed = _parse(text, latex_first=False)
    else:
        parsed = _parse(f"${text}$") or _parse(text, latex_first=False)
    import sympy

    # Only a fallback string (math-verify's "first_match") means nothing was parsed.
    if not any(isinstance(item, (sympy.Basic, sympy.MatrixBase)) for item in parsed):
        return None
    return tuple(parsed)


def _number_type():
    import sympy

    return sympy.Number


def _is_scalar(parsed: tuple) -> bool:
    import sympy

    return any(isinstance(item, sympy.Expr) for item in parsed)


def _is_hedge(region: str) -> bool:
    """A list of >= HEDGE_MIN_NUMBERS distinct numbers that ends `region` or follows an anchor."""
    for match in _NUMBER_LIST.finditer(region):
        numbers = set(re.findall(_NUMBER, match.group()))
        if len(numbers) < HEDGE_MIN_NUMBERS:
            continue
        at_end = _TRAILING.fullmatch(region, match.end()) is not None
        if at_end or _ANCHOR_BEFORE.search(region, max(0, match.start() - 80), match.start()):
            return True
    return False


def _log10(expr) -> float:
    """An estimate of log10|expr| for a sympy tree, computed without the exact value: sympy computes
    `10**(10**10)` exactly, in C, where no signal can stop it. Symbols count as magnitude 1."""
    import mpmath
    import sympy

    if expr.is_Number:
        if expr.is_zero:
            return -math.inf
        if expr.is_Rational:
            return math.log10(abs(expr.p)) - math.log10(expr.q)
        return float(mpmath.log10(abs(mpmath.mpf(sympy.Float(expr)._mpf_))))
    if isinstance(expr, sympy.Pow):
        base = _log10(expr.base)
        return 0.0 if base == 0 else _value(expr.exp) * base
    if isinstance(expr, sympy.Mul):
        return sum(_log10(arg) for arg in expr.args)
    if isinstance(expr, sympy.Add):
        return max(_log10(arg) for arg in expr.args) + math.log10(len(expr.args))
    if isinstance(expr, sympy.factorial):
        n = _value(expr.args[0])
        return math.lgamma(n + 1) / math.log(10) if 0 <= n < 1e300 else math.inf
    return max((_log10(arg) for arg in expr.args if isinstance(arg, sympy.Basic)), default=0.0)


def _value(expr) -> float:
    """The value of a (real part of a) sympy number as a float, +-inf when it is too large."""
    magnitude = _log10(expr)
    if magnitude > 300:
        return -math.inf if expr.is_negative else math.inf
    if not expr.is_number:
        return 10.0**magnitude
    value = complex(expr.evalf(15))
    return value.real if value.imag == 0 else abs(value)


def compared_value(item):
    """What `verify` compares with a reference that is not an equation: the last right-hand side
    of an equation or a chain of them (`52 + 6 = 58` -> `58`, `a = b = 52 + 6` -> `52 + 6`), else
    the item itself. Mirrors math-verify's grader, which unwraps equations the same way."""
    import sympy

    relations = getattr(item, "_unsorted_args", item.args) if isinstance(item, sympy.And) else ()
    if relations and all(isinstance(relation, sympy.Eq) for relation in relations):
        return relations[-1].rhs
    return item.rhs if isinstance(item, sympy.Eq) else item


def unevaluated_arithmetic(parsed) -> bool:
    """True when the value that `verify` compares (`compared_value`) holds arithmetic left undone
    on plain numbers: a sum (`52 + 6`, `58 - 6`), a product of two numbers (`52*6`), or a power of
    a number other than ten (`2^2`). A fraction (`1/2`, a product with a power -1) and `10^3` are
    not, and neither is worked arithmetic that ends in its result (`52 + 6 = 58`)."""
    import sympy

    def is_number(node):  # 6, or -6 written as (-1)*6 by the unevaluated parser
        if isinstance(node, sympy.Mul) and len(node.args) == 2 and -1 in node.args:
            return all(isinstance(arg, sympy.Number) for arg in node.args)
        return isinstance(node, sympy.Number)

    def numbers(node):
        return [arg for arg in node.args if is_number(arg)]

    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(compared_value(item)):
            if isinstance(node, sympy.Add) and len(numbers(node)) >= 2:
                return True
            if isinstance(node, sympy.Mul) and len([n for n in numbers(node) if n != -1]) >= 2:
                return True
            if (
                isinstance(node, sympy.Pow)
                and len(numbers(node)) == 2
                and node.base != 10
                and node.exp != -1
            ):
                return True
    return False


def too_large(parsed) -> bool:
    """True when a parsed answer holds a power or factorial with more than MAX_DIGITS digits."""
    import sympy

    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        try:
            for node in sympy.preorder_traversal(item):
                if (
                    isinstance(node, (sympy.Pow, sympy.factorial))
                    and abs(_log10(node)) > MAX_DIGITS
                ):
                    return True
        except (ArithmeticError, TypeError, ValueError, AttributeError, RecursionError):
            continue  # an odd object: let math-verify try, under the time bound
    return False


def extract_answer(completion: str, max_distinct_boxed: int = 1) -> tuple[str | None, str]:
    """Pick the part of `completion` to parse. Returns (text to parse or None, note)."""
    section = completion.rsplit("</think>", 1)[-1]
    if not section.strip():
        return None, "empty"
    boxed = boxed_answers(section)
    if boxed:
        distinct = {re.sub(r"\s+", "", content) for content, _ in boxed}
        if len(distinct) > max_distinct_boxed:
            return None, f"hedge: {len(distinct)} distinct boxed answers"
        answer, depth = boxed[-1]
        answer = answer.strip().rstrip(".").strip()
        if len(answer) > MAX_ANSWER_CHARS or depth > MAX_NESTING:
            return None, "boxed answer too long or too deeply nested"
        if _THOUSANDS.fullmatch(answer):
            return _ANY_SEPARATOR.sub("", answer), "boxed"
        return join_digit_groups(answer), "boxed"
    if "####" in section:
        answer = section.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        return join_digit_groups(answer[:MAX_ANSWER_CHARS]), "####"
    return join_digit_groups(section[-TAIL_CHARS:]), "tail"


def score(reference, completion: str, max_distinct_boxed: int = 1) -> tuple[float | None, str]:
    """Score one completion: (1.0 | 0.0 | None, note). None means the reference cannot be parsed."""
    from math_verify import verify

    gold = parse_reference(str(reference)) if reference is not None else None
    if gold is None:
        return None, "reference unparseable"
    text, note = extract_answer(completion, max_distinct_boxed)
    if text is None:
        return 0.0, note
    if nesting_depth(text) > MAX_NESTING:
        return 0.0, "answer too deeply nested"
    number_reference = any(isinstance(item, _number_type()) for item in gold)
    if number_reference:  # `= 58,500` is 58500, not the set {58, 500} that LaTeX reads there
        text = _COMMA_GROUPS.sub(lambda match: match.group().replace(",", ""), text)
    if note != "boxed" and _is_scalar(gold) and _is_hedge(text):
        return 0.0, "hedge: list of candidate numbers"
    if note == "boxed":  # a plain number skips the (slow) LaTeX parser
        plain = _PLAIN_NUMBER.fullmatch(text)
        predicted = _parse(text, latex_first=False) if plain else _parse(f"\\boxed{{{text}}}")
    else:
        predicted = _parse(text, latex_first=note != "####")
    if not predicted:
        return 0.0, "no answer found"
    if too_large(predicted):
        return 0.0, "answer too large to compute"
    if number_reference and unevaluated_arithmetic(predicted):
        return 0.0, f"unevaluated arithmetic: {predicted[-1]}"[:200]
    correct = verify(list(gold), predicted, timeout_seconds=None)
    return (1.0 if correct else 0.0), f"{note}: {predicted[-1]}"[:200]


def run_with_deadline(seconds: float, function, cpu_time: bool = False):
    """Call `function()`, raising `Deadline` after `seconds` when a signal timer can be used (the
    main thread of a POSIX process); elsewhere it runs unbounded. With `cpu_time`, the seconds
    are the process's CPU time (SIGPROF), so a loaded machine does not turn slow into wrong."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or not seconds or seconds <= 0:
        return function()
    timer, signum = (
        (signal.ITIMER_PROF, signal.SIGPROF) if cpu_time else (signal.ITIMER_REAL, signal.SIGALRM)
    )

    def on_timer(signum, frame):
        raise Deadline

    previous = signal.signal(signum, on_timer)
    # The timer repeats: a Deadline raised inside a garbage-collector callback or a finaliser is
    # printed and dropped by Python, so the next tick raises it again in the scoring code.
    signal.setitimer(timer, seconds, RETRY_S)
    try:
        return function()
    finally:
        signal.setitimer(timer, 0)
        signal.signal(signum, previous)


def score_bounded(
    reference, completion, seconds: float, options: dict, cpu_time: bool = False
) -> list:
    """`score` under a deadline; anything that goes wrong is a wrong answer, never a crash."""
    try:
        scored = run_with_deadline(
            seconds, lambda: score(reference, completion, **options), cpu_time
        )
        return list(scored)
    except Deadline:
        return [0.0, "timeout"]
    except Exception as error:  # a reward must not crash the run; the note says why
        return [0.0, f"error: {type(error).__name__}"]


def serve() -> None:
    """Worker loop: one JSON request per stdin line, `[reference, completion, seconds, options]`,
    one JSON reply per stdout line, `[score, note]`. Exits when stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which then closes us
    logging.disable(logging.CRITICAL)  # math-verify logs every failed parse
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        score("72", "#### 72")  # import sympy, math-verify and the LaTeX parser before "ready"
    except Exception as error:
        stdout.write(json.dumps({"error": repr(error)}).encode() + b"\n")
        stdout.flush()
        return
    stdout.write(b'"ready"\n')
    stdout.flush()
    for line in stdin:
        try:
            reference, completion, seconds, options = json.loads(line)
            reply = score_bounded(reference, completion, seconds, options, cpu_time=True)
        except Exception as error:
            reply = [0.0, f"error: {type(error).__name__}"]
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
