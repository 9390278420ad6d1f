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
    and text) is kept, anything else becomes its `str`."""
    return {
        "role": "tool",
        "name": name,
        "content": result if isinstance(result, list) else str(result),
    }


def tool_counts(results: list[list[ToolResult]]) -> tuple[int, int]:
    """`(calls, failures)` of a batch's results (see `tool_metrics`)."""
    calls = sum(len(rollout) for rollout in results)
    return calls, sum(result.failed for rollout in results for result in rollout)


def error_result(name: str, message: str) -> ToolResult:
    """A failed call's result: `{"error": message}`, as TRL gives the model."""
    return ToolResult(name, {"error": message}, failed=True)


# A line that reports a failure: `NameError: ...` (a traceback's last line, a SyntaxError) or
# `run_python`'s `Error: the program ran past ...`.
_FAILURE_LINE = re.compile(r"^(\w*Error|\w*Exception)\b", re.MULTILINE)


def is_failure(message: dict) -> bool:
    """Whether a `tool` message reports a failure: a call that raised or timed out (its content
    is `{"error": ...}`, as a dict or its text), or a program run by `run_python` that raised or
    ran past a limit (a line starting with `...Error`)."""
    content = message.get("content")
    if isinstance(content, dict):
        return "error" in content
    text = content if isinstance(content, str) else ""
    return text.startswith("{'error': ") or bool(_FAILURE_LINE.search(text))


def tool_metrics(calls: int, failures: int, num_rollouts: int) -> dict[str, float]:
    """TRL's tool metrics from counts summed over every process: `tools/call_frequency`, calls
    per rollout, and `tools/failure_frequency`, the share of calls that failed (0 without calls)."""
    return {
        "tools/call_frequency": calls / num_rollouts,
        "tools/failure_frequency": failures / calls if calls > 0 else 0.0,
    }
