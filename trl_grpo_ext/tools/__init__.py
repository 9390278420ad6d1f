"""Tools and environments for multi-turn rollouts, with the contract of TRL's `GRPOTrainer`.

- `Agent`: the tools and environments of a run, as the trainer's multi-turn rollouts use them.
- `ToolSet`: named tool functions and their JSON schemas (`tools=` of TRL).
- `Environments`: `environment_factory` of TRL: a pool of instances, `reset(**row)`, their public
  methods as tools, `get_reward()` as reward functions.
- `run_python`, `PythonSandbox`: a tool that runs model-written Python in a sandbox (Linux
  namespaces, resource limits) and returns its output as a `ProgramResult` (a string whose
  fields say how the program ended, which a reward function can read).
- `code_block_format`: the tool format of tool-integrated reasoning (calls written as Markdown
  code blocks) for a ChatML model whose template has no tool format.
- `ToolRunner`: runs the tool calls of a batch, each rollout's in the model's order: sync tools
  on the calling thread as TRL does (or on worker threads, opt-in), async tools overlapping
  across rollouts on one event loop; a failure is an `{"error": ...}` result for the model;
  `tool_message` and `tool_metrics` as TRL makes them.

This package imports nothing from generation or training: the multi-turn loop and the trainer
call it.
"""

from .agent import Agent
from .environments import (
    ENVIRONMENT_FIELD,
    EnvironmentFactory,
    Environments,
    append_observation,
    environment_prompt,
    tool_method_names,
)
from .formats import code_block_format
from .functions import ToolSet, as_toolset, is_async_callable
from .python import PythonSandbox, run_python
from .results import (
    ProgramResult,
    ToolResult,
    error_result,
    tool_counts,
    tool_message,
    tool_metrics,
)
from .runner import ToolCall, ToolRunner

__all__ = [
    "Agent",
    "ENVIRONMENT_FIELD",
    "EnvironmentFactory",
    "Environments",
    "ProgramResult",
    "PythonSandbox",
    "ToolCall",
    "ToolResult",
    "ToolRunner",
    "ToolSet",
    "append_observation",
    "as_toolset",
    "code_block_format",
    "environment_prompt",
    "error_result",
    "is_async_callable",
    "run_python",
    "tool_counts",
    "tool_message",
    "tool_method_names",
    "tool_metrics",
]
