"""The result of a tool call, the chat message TRL makes of it, and TRL's tool metrics."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolResult:
    """What one tool call gave: the tool's `name` and the raw `content` it returned, or
    `{"error": message}` when `failed`."""

    name: str
    content: Any
    failed: bool = False

    def message(self) -> dict:
        return tool_message(self.name, self.content)


def tool_message(name: str, result: Any) -> dict:
    """The chat message of a tool's result, as TRL writes it: a list (content parts, e.g. an image
    and text) or a string (a `ProgramResult` with its fields) is kept, anything else becomes its
    `str`."""
    return {
        "role": "tool",
        "name": name,
        "content": result if isinstance(result, (list, str)) else str(result),
    }


# Starts every line that the trainer's side of `run_python` adds to a program's output; a line of
# the program's own output that starts with it is escaped ("\[run_python]"), so none can pass for
# one.
NOTE = "[run_python]"
# Control characters (C0 but tab and newline, DEL, C1), bidirectional overrides and isolates, and
# line separators, which would act on a terminal or a log viewer: shown escaped (\x1b, \u202e).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def escape_output(text: str) -> str:
    """A program's output as the model and the logs see it: control characters escaped, and its
    lines that start with `NOTE` escaped."""
    text = _CONTROL.sub(lambda match: ascii(match.group())[1:-1], text)
    return re.sub(f"^(?={re.escape(NOTE)})", r"\\", text, flags=re.MULTILINE)


class ProgramResult(str):
    """What `run_python` gives back: the text the model reads (the program's output, then the
    notes of the trainer's side, each on a line that starts with `[run_python]`), with what the
    trainer saw as fields that a reward function can read from the `tool` message's content
    (`getattr(message["content"], "limit", None)`), which no output of the program can forge.

    Attributes:
        output: what the program printed (stdout and stderr, cut at `max_output_bytes`, control
            characters escaped).
        exit_status: its exit code; None when a signal or the trainer stopped it, or it never ran.
        signal: the name of the signal that killed it (`"SIGKILL"`), or None.
        limit: the limit it ran past: `"wall_seconds"`, `"cpu_seconds"`, `"memory_mb"`,
            `"file_size"`, or None.
        truncated: whether its output was cut at `max_output_bytes`.
        failed: whether the call failed: no exit status 0 (an exception, a signal, a limit, no
            run) or a process of it killed at the memory limit.
    """

    def __new__(
        cls,
        text: str,
        *,
        output: str = "",
        exit_status: int | None = None,
        signal: str | None = None,
        limit: str | None = None,
        truncated: bool = False,
    ) -> ProgramResult:
        result = super().__new__(cls, text)
        result.output, result.exit_status, result.signal = output, exit_status, signal
        result.limit, result.truncated = limit, truncated
        result.failed = exit_status != 0 or limit is not None
        return result


def tool_counts(results: list[list[ToolResult]]) -> tuple[int, int]:
    """`(calls, failures)` of a batch's results (see `tool_metrics`)."""
    calls = sum(len(rollout) for rollout in results)
    return calls, sum(result.failed for rollout in results for result in rollout)


def error_result(name: str, message: str) -> ToolResult:
    """A failed call's result: `{"error": message}`, as TRL gives the model."""
    return ToolResult(name, {"error": message}, failed=True)


# A line that reports a failure: `NameError: ...` (a traceback's last line, a SyntaxError) or
# `run_python`'s `[run_python] Error: the program ran past ...`.
_FAILURE_LINE = re.compile(r"^(\w*Error|\w*Exception|\[run_python\] Error)\b", re.MULTILINE)


def is_failure(message: dict) -> bool:
    """Whether a `tool` message reports a failure: a call that raised or timed out (its content
    is `{"error": ...}`, as a dict or its text), or a program run by `run_python` that failed
    (`ProgramResult.failed`; in a text, a line starting with `...Error`)."""
    content = message.get("content")
    if isinstance(content, dict):
        return "error" in content
    if isinstance(content, ProgramResult):
        return content.failed
    text = content if isinstance(content, str) else ""
    return text.startswith("{'error': ") or bool(_FAILURE_LINE.search(text))


def tool_metrics(calls: int, failures: int, num_rollouts: int) -> dict[str, float]:
    """TRL's tool metrics from counts summed over every process: `tools/call_frequency`, calls
    per rollout, and `tools/failure_frequency`, the share of calls that failed (0 without calls)."""
    return {
        "tools/call_frequency": calls / num_rollouts,
        "tools/failure_frequency": failures / calls if calls > 0 else 0.0,
    }
