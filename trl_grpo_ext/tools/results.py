"""The result of a tool call, the chat message TRL makes of it, and TRL's tool metrics."""

from __future__ import annotations

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


def tool_metrics(calls: int, failures: int, num_rollouts: int) -> dict[str, float]:
    """TRL's tool metrics from counts summed over every process: `tools/call_frequency`, calls
    per rollout, and `tools/failure_frequency`, the share of calls that failed (0 without calls)."""
    return {
        "tools/call_frequency": calls / num_rollouts,
        "tools/failure_frequency": failures / calls if calls > 0 else 0.0,
    }
