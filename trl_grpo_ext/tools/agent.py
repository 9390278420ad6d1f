"""`Agent`: the user's tools and environments, as the multi-turn loop of generation uses them.

For each generation batch, `start` gives every rollout (G per dataset row) its prompt, its tools
and its environment: an instance of its own from the pool, reset with the row, whose text is
appended to the prompt. `runner` runs the batch's tool calls: sync ones on the calling thread by
default, as in TRL; with `workers` > 1, on threads, each environment made, reset and called on
one of them. A batch takes its instances from a slot of the pool (`Environments.acquire`):
batches alive at the same time, with asynchronous rollouts, take different slots.
"""

from __future__ import annotations

from .environments import Environments, append_observation, environment_prompt
from .functions import ToolSet
from .runner import ToolRunner


class Agent:
    """Tools and environments of a run (TRL's `tools` and `environment_factory`).

    Args:
        tools (`list[Callable]`, *optional*): functions every rollout may call.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): one environment
            per rollout (`environments.Environments`).
        timeout (`float`, *optional*): seconds a call may take (`tool_call_timeout`).
        workers (`int`, defaults to `1`): threads for synchronous calls (`tool_call_workers`);
            1 runs them on the calling thread.
    """

    def __init__(self, tools=None, environment_factory=None, *, timeout=60.0, workers=1):
        self.tools = ToolSet(tools or [])
        self.environments = None
        self.runner = ToolRunner(
            max_workers=workers,
            timeout=timeout,
            timeout_setting="tool_call_timeout",
            workers_setting="tool_call_workers=...",
        )
        if environment_factory is not None:
            threaded = self.runner.threaded
            self.environments = Environments(
                environment_factory,
                create=self.runner.create if threaded else None,
                call_on=self.runner.call_on if threaded else None,
            )
            for name in self.environments.names:  # a tool named like a method fails now
                self.environments.tools_for(name, self.tools)

    @property
    def functions(self) -> list:
        """Every tool of the run, as TRL's `GRPOTrainer.tools` lists them: the standalone tools,
        then the tool methods of each environment (bound to its first instance)."""
        functions = self.tools.functions
        if self.environments is not None:
            for name in self.environments.names:
                functions += [m for m in self.environments.tools_for(name) if m not in functions]
        return functions

    def reward_functions(self) -> list[tuple[str, object]]:
        """`(name, function)` of each environment class with a `get_reward`."""
        return [] if self.environments is None else self.environments.reward_functions()

    def start(
        self, rows: list[dict], group: int, slot=0
    ) -> tuple[list, list[ToolSet], list | None]:
        """Each rollout's prompt, tools and environment (None without environments), `group`
        consecutive rollouts per row; the environments are those of `slot`, reset with the rows
        (the previous batch of that slot is done with them)."""
        expanded = [row for row in rows for _ in range(group)]
        if self.environments is None:
            return [row["prompt"] for row in expanded], [self.tools] * len(expanded), None
        environments = self.environments
        instances = environments.acquire((environments.name_of_row(row) for row in expanded), slot)
        prompts = [
            append_observation(environment_prompt(row), environments.reset(instance, row))
            for row, instance in zip(expanded, instances)
        ]
        tools = [environments.toolset_for_instance(i, self.tools) for i in instances]
        return prompts, tools, instances

    def close(self) -> None:
        self.runner.close()
