"""Tools and environments (`trl_grpo_ext.tools`): TRL's contract for `tools=` and
`environment_factory`, and the runner that executes a batch's tool calls concurrently under a
timeout; `run_python` as a tool at the end (its sandbox: test_run_python.py). CPU only, no
model."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from agent_helpers import ScriptedEngine, encode, needs_trl_1_16, qwen3_tokenizer
from agent_helpers import call as qwen3_call
from test_layout import PACKAGE, imported_modules, module_files, outside
from transformers import GenerationConfig
from transformers.utils import get_json_schema

from trl_grpo_ext.generation.multi_turn import ToolCallFormat, ToolLoop
from trl_grpo_ext.tools import (
    Environments,
    PythonSandbox,
    ToolResult,
    ToolRunner,
    ToolSet,
    append_observation,
    environment_prompt,
    run_python,
    tool_counts,
    tool_message,
    tool_metrics,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def fail(reason: str) -> str:
    """Always raise.

    Args:
        reason: What the error says.
    """
    raise RuntimeError(reason)


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


async def async_nap(seconds: float) -> str:
    """Sleep without blocking the loop, then say so.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return f"awoke after {seconds}"


def call(name: str, **arguments) -> dict:
    """A tool call as `transformers`' `parse_response` returns it."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ToolSet


def test_toolset_names_functions_and_schemas():
    tools = ToolSet([add, async_nap])
    assert tools.names == ["add", "async_nap"]
    assert tools.functions == [add, async_nap]
    assert "add" in tools and "missing" not in tools and tools["add"] is add
    assert not tools.is_async("add") and tools.is_async("async_nap")
    schema = tools.schemas[0]["function"]
    assert schema["name"] == "add" and schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first integer.",
    }


def test_toolset_rejects_a_function_the_model_cannot_see():
    def no_hints(x):
        """Echo.

        Args:
            x: The value.
        """
        return x

    def no_docstring(x: int) -> int:
        return x

    for tool in (no_hints, no_docstring):
        with pytest.raises(ValueError, match=rf"`{tool.__name__}`.*type hint.*`Args:`"):
            ToolSet([tool])


def test_toolset_rejects_two_tools_with_one_name():
    def add(x: int) -> int:  # noqa: F811 - the clash is the point
        """Another add.

        Args:
            x: The value.
        """
        return x

    with pytest.raises(ValueError, match="Two tools are named `add`"):
        ToolSet([globals()["add"], add])


# Environments


class Counter:
    """An environment: its tools act on its own count; `get_reward` reads it."""

    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.count, self.rows = 0, []

    def reset(self, **row) -> str | None:
        self.count = row.get("start", 0)
        self.rows.append(row)
        return row.get("observation")

    def increment(self, step: int) -> int:
        """Increase the count.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

    def _private(self) -> None:
        raise AssertionError("private methods are not tools")

    @property
    def exploding(self) -> int:
        raise AssertionError("properties must not be evaluated while listing tools")


class Maze:
    def reset(self, **row) -> None:
        return None

    def move(self, direction: str) -> str:
        """Move one step.

        Args:
            direction: One of north, south, east, west.
        """
        return direction

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return -1.0


class CounterSubclass(Counter):
    pass


def test_environment_without_reset_is_rejected():
    class NoReset:
        def step(self, x: int) -> int:
            """Step.

            Args:
                x: The value.
            """
            return x

    with pytest.raises(
        ValueError, match=r"NoReset.*has no `reset` method.*define `reset\(self, \*\*row\)"
    ):
        Environments(NoReset)


def test_public_methods_are_the_tools_bound_to_each_instance():
    environments = Environments(Counter)  # the `exploding` property would raise if evaluated
    first, second = environments.acquire([None, None])
    tools = environments.toolset_for_instance(first, standalone=[add])
    assert tools.names == ["add", "increment"]
    assert tools["increment"](step=3) == 3 and first.count == 3 and second.count == 0
    assert environments.tools_for(None, [add]).names == ["add", "increment"]


def test_tool_method_without_docstring_fails_at_construction():
    class Bare:
        def reset(self, **row):
            return None

        def act(self, x):
            return x

    with pytest.raises(ValueError, match="`act`"):
        Environments(Bare)


def test_dict_factory_routes_rows_by_their_environment_field():
    environments = Environments({"counter": Counter, "maze": Maze})
    rows = [{"environment": "maze"}, {"environment": "counter", "start": 2}]
    names = [environments.name_of_row(row) for row in rows]
    assert names == ["maze", "counter"]
    maze, counter = environments.acquire(names)
    assert type(maze) is Maze and type(counter) is Counter
    assert environments.tools_for("maze").names == ["move"]
    environments.reset(counter, rows[1])
    assert counter.rows[-1] == {"start": 2}  # the routing field is not passed to reset
    with pytest.raises(
        ValueError, match=r"environment='chess'.*Expected one of: \['counter', 'maze'\]"
    ):
        environments.name_of_row({"environment": "chess"})
    with pytest.raises(ValueError, match="Expected one of"):
        environments.acquire(["chess"])


def test_single_factory_passes_the_whole_row_to_reset():
    environments = Environments(Counter)
    assert environments.name_of_row({"environment": "anything"}) is None
    (counter,) = environments.acquire([None])
    row = {"prompt": [{"role": "user", "content": "hi"}], "start": 5, "environment": "x"}
    assert environments.reset(counter, row) is None
    assert counter.rows[-1] == row and counter.count == 5


def test_pool_reuses_instances_across_batches_and_grows_on_demand():
    Counter.instances = 0
    environments = Environments(Counter)
    assert Counter.instances == 1  # the probe
    first = environments.acquire([None] * 3)
    second = environments.acquire([None] * 3)
    assert len({id(e) for e in first}) == 3  # distinct within a batch
    assert all(a is b for a, b in zip(first, second))  # the same objects next batch
    assert Counter.instances == 3  # the probe was reused, two more were made
    assert len(environments.acquire([None] * 4)) == 4 and Counter.instances == 4


def test_reset_must_return_none_str_or_content_parts():
    environments = Environments(Counter)
    (counter,) = environments.acquire([None])
    assert environments.reset(counter, {"observation": "You are at 0."}) == "You are at 0."
    parts = [{"type": "text", "text": "look"}]
    assert environments.reset(counter, {"observation": parts}) == parts
    with pytest.raises(TypeError, match="Counter.reset returned a int; it must return None"):
        environments.reset(counter, {"observation": 7})


def test_observation_is_appended_to_the_last_message_as_in_trl():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Go."}]
    assert append_observation(prompt, " Now at 0.") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Go. Now at 0."},  # no separator added
    ]
    assert prompt[1]["content"] == "Go."  # the row is untouched
    assert append_observation(prompt, None) == prompt
    image_prompt = [{"role": "user", "content": [{"type": "image"}]}]
    assert append_observation(image_prompt, "Hi")[-1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Hi"},
    ]
    assert append_observation(prompt, [{"type": "image"}])[-1]["content"] == [
        {"type": "text", "text": "Go."},
        {"type": "image"},
    ]
    assert environment_prompt({}) == [{"role": "user", "content": ""}]


def test_get_reward_becomes_one_reward_function_per_class():
    environments = Environments({"a": Counter, "b": Counter, "sub": CounterSubclass, "maze": Maze})
    rewards = dict(environments.reward_functions())
    assert list(rewards) == ["Counter", "CounterSubclass", "Maze"]  # Counter once for two names
    assert rewards["Counter"].__name__ == "Counter"
    counter, sub, maze = environments.acquire(["a", "sub", "maze"])
    counter.count, sub.count = 4, 9
    environments_of_batch = [counter, sub, maze]
    # exact class match: the subclass instance is not scored by Counter's function
    assert rewards["Counter"](environments=environments_of_batch, prompts=None) == [4.0, None, None]
    assert rewards["CounterSubclass"](environments=environments_of_batch) == [None, 9.0, None]
    assert asyncio.iscoroutinefunction(rewards["Maze"])
    assert asyncio.run(rewards["Maze"](environments=environments_of_batch)) == [None, None, -1.0]


# ToolRunner


@pytest.fixture(params=[1, 4], ids=["calling thread", "threads"])
def runner(request):
    with ToolRunner(max_workers=request.param, timeout=5.0) as runner:
        yield runner


def test_results_keep_call_order_per_rollout(runner):
    tools = ToolSet([add, async_nap, nap])
    calls = [
        [(tools, call("async_nap", seconds=0.05)), (tools, call("add", a=1, b=2))],
        [],
        [(tools, call("nap", seconds=0.01)), (tools, call("add", a=3, b=4))],
    ]
    results = runner.run(calls)
    assert results == [
        [ToolResult("async_nap", "awoke after 0.05"), ToolResult("add", 3)],
        [],
        [ToolResult("nap", "slept 0.01"), ToolResult("add", 7)],
    ]
    assert tool_counts(results) == (4, 0)


def test_failures_are_error_results_for_the_model(runner):
    tools = ToolSet([add, fail])
    results = runner.run(
        [
            [(tools, call("fail", reason="disk full"))],
            [(tools, call("missing"))],
            [(tools, {"type": "retrieval", "name": "search"})],
            [(tools, call("add", a=1))],
            [(tools, call("add", a=1, b=2, c=3))],
            [(tools, call("add", a=1, b=2))],
        ]
    )
    contents = [rollout[0].content for rollout in results]
    assert contents[0] == {"error": "disk full"}
    assert contents[1] == {"error": "Tool missing not found."}
    assert contents[2] == {"error": "Unsupported tool call type: retrieval"}
    assert results[2][0].name == "search"
    assert "missing a required argument: 'b'" in contents[3]["error"]
    assert "unexpected keyword argument 'c'" in contents[4]["error"]
    assert contents[5] == 3
    assert [rollout[0].failed for rollout in results] == [True] * 5 + [False]
    assert tool_counts(results) == (6, 5)


def test_async_tool_exceptions_are_errors(runner):
    async def async_fail(reason: str) -> str:
        """Raise.

        Args:
            reason: The message.
        """
        raise ValueError(reason)

    tools = ToolSet([async_fail])
    (result,) = runner.run([[(tools, call("async_fail", reason="bad"))]])[0]
    assert result == ToolResult("async_fail", {"error": "bad"}, failed=True)


def recorder(log: list, name: str = "record"):
    """A sync tool that logs `(its label, the thread it ran on)`."""

    def record(label: str) -> str:
        """Record a label.

        Args:
            label: What to record.
        """
        log.append((label, threading.current_thread()))
        return label

    record.__name__ = name
    return record


def test_by_default_sync_tools_run_on_the_calling_thread_one_rollout_after_another():
    """As TRL: rollout 0's calls in the model's order, then rollout 1's, on the caller's thread."""
    log = []
    tools = ToolSet([recorder(log)])
    with ToolRunner() as runner:
        assert runner.max_workers == 1
        results = runner.run(
            [[(tools, call("record", label=f"{i}.{j}")) for j in range(3)] for i in range(2)]
        )
    assert [label for label, _ in log] == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"]
    assert {thread for _, thread in log} == {threading.current_thread()}
    assert [[r.content for r in rollout] for rollout in results] == [
        ["0.0", "0.1", "0.2"],
        ["1.0", "1.1", "1.2"],
    ]


def gate(expected: int):
    """An async tool that returns "together" once `expected` calls are waiting in it at once,
    or "alone" after 5 s (so a runner that does not overlap them fails, and does not hang)."""
    state = {"waiting": 0, "most": 0}
    everyone = asyncio.Event()

    async def meet(label: str) -> str:
        """Wait for the others.

        Args:
            label: Who is waiting.
        """
        state["waiting"] += 1
        state["most"] = max(state["most"], state["waiting"])
        if state["waiting"] == expected:
            everyone.set()
        try:
            await asyncio.wait_for(everyone.wait(), 5.0)
            return "together"
        except asyncio.TimeoutError:
            return "alone"
        finally:
            state["waiting"] -= 1

    return meet, state


@pytest.mark.parametrize("workers", [1, 4])
def test_async_calls_of_different_rollouts_overlap(workers):
    meet, _ = gate(expected=6)
    tools = ToolSet([meet])
    with ToolRunner(max_workers=workers, timeout=10.0) as runner:
        results = runner.run([[(tools, call("meet", label=str(i)))] for i in range(6)])
    assert results == [[ToolResult("meet", "together")]] * 6


def test_the_calls_of_one_rollout_never_overlap_even_async():
    """A rollout's second call starts when its first has returned (TRL awaits a rollout's async
    calls together): with two rollouts of three calls, at most two calls wait at once."""
    meet, state = gate(expected=2)
    tools = ToolSet([meet])
    with ToolRunner(timeout=10.0) as runner:
        results = runner.run(
            [[(tools, call("meet", label=f"{i}.{j}")) for j in range(3)] for i in range(2)]
        )
    assert state["most"] == 2
    assert results == [[ToolResult("meet", "together")] * 3] * 2


def test_with_threads_the_sync_calls_of_different_rollouts_overlap():
    barrier = threading.Barrier(4, timeout=5.0)

    def wait_for_all(label: str) -> str:
        """Wait for the others.

        Args:
            label: Who is waiting.
        """
        barrier.wait()  # BrokenBarrierError (an error result) unless all 4 run at once
        return label

    tools = ToolSet([wait_for_all])
    with ToolRunner(max_workers=4, timeout=10.0) as runner:
        results = runner.run([[(tools, call("wait_for_all", label=str(i)))] for i in range(4)])
    assert [rollout[0].content for rollout in results] == ["0", "1", "2", "3"]


def test_with_threads_a_rollouts_calls_run_in_order_on_one_thread():
    log = []
    tools = ToolSet([recorder(log)])
    with ToolRunner(max_workers=3, timeout=10.0) as runner:
        runner.run(
            [[(tools, call("record", label=f"{i}.{j}")) for j in range(4)] for i in range(6)]
        )
    for i in range(6):
        labels = [label for label, _ in log if label.startswith(f"{i}.")]
        threads = {thread for label, thread in log if label.startswith(f"{i}.")}
        assert labels == [f"{i}.{j}" for j in range(4)]
        assert len(threads) == 1 and threading.current_thread() not in threads


def test_a_threaded_sync_call_past_its_timeout_does_not_hold_up_the_batch():
    release = threading.Event()

    def hang(seconds: float) -> str:
        """Wait to be released.

        Args:
            seconds: How long at most.
        """
        release.wait(seconds)
        return "released"

    tools = ToolSet([hang, add])
    try:
        with ToolRunner(max_workers=2, timeout=0.3, timeout_setting="tool_timeout") as runner:
            results = runner.run(
                [[(tools, call("hang", seconds=30))], [(tools, call("add", a=2, b=2))]]
            )
            # both workers are free for a batch of rollouts without environments
            again = runner.run([[(tools, call("add", a=1, b=1))]] * 2)
    finally:
        release.set()
    assert results[1] == [ToolResult("add", 4)]
    assert again == [[ToolResult("add", 2)]] * 2
    assert results[0][0].failed
    assert results[0][0].content["error"] == (
        "Tool hang timed out after 0.3 s. Raise the limit with `tool_timeout` if the tool needs longer."
    )


def test_a_sync_call_on_the_calling_thread_is_not_cut_at_the_timeout():
    """As in TRL (which has no timeout): it cannot be stopped, so its result is the model's."""
    with ToolRunner(timeout=0.05) as runner:
        results = runner.run([[(ToolSet([nap]), call("nap", seconds=0.3))]])
    assert results == [[ToolResult("nap", "slept 0.3")]]


def test_an_async_tool_past_its_timeout_is_cancelled():
    cancelled = threading.Event()

    async def hang(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "done"

    with ToolRunner(timeout=0.3) as runner:
        (result,) = runner.run([[(ToolSet([hang]), call("hang", seconds=30))]])[0]
        assert cancelled.wait(5.0)
    assert "timed out after 0.3 s" in result.content["error"]


def test_close_leaves_no_threads():
    before = set(threading.enumerate())
    runner = ToolRunner(max_workers=4)
    tools = ToolSet([nap, async_nap])
    runner.run([[(tools, call("nap", seconds=0.01)), (tools, call("async_nap", seconds=0.01))]])
    assert len(set(threading.enumerate()) - before) == 5  # 4 workers and the event loop
    runner.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run([[(tools, call("nap", seconds=0.01))]])


def test_by_default_only_async_tools_start_a_thread():
    before = set(threading.enumerate())
    with ToolRunner() as runner:
        runner.run([[(ToolSet([add]), call("add", a=1, b=1))]])
        assert set(threading.enumerate()) - before == set()
        runner.run([[(ToolSet([async_nap]), call("async_nap", seconds=0.01))]])
        assert len(set(threading.enumerate()) - before) == 1  # the event loop
    assert set(threading.enumerate()) - before == set()


def test_tool_metrics_match_trl():
    assert tool_metrics(calls=6, failures=3, num_rollouts=4) == {
        "tools/call_frequency": 1.5,
        "tools/failure_frequency": 0.5,
    }
    assert tool_metrics(0, 0, 4)["tools/failure_frequency"] == 0.0


def test_tool_messages_match_trl():
    assert tool_message("add", 3) == {"role": "tool", "name": "add", "content": "3"}
    assert tool_message("f", {"error": "x"})["content"] == "{'error': 'x'}"
    parts = [{"type": "text", "text": "a"}]
    assert ToolResult("look", parts).message() == {"role": "tool", "name": "look", "content": parts}


def test_runner_calls_environment_methods_on_each_rollouts_own_instance(runner):
    environments = Environments(Counter)
    instances = environments.acquire([None, None])
    calls = [
        [(environments.toolset_for_instance(e), call("increment", step=step))]
        for e, step in zip(instances, (1, 10))
    ]
    assert runner.run(calls) == [[ToolResult("increment", 1)], [ToolResult("increment", 10)]]
    assert [e.count for e in instances] == [1, 10]


@pytest.mark.parametrize(
    "path, module, is_package",
    list(module_files(PACKAGE / "tools")),
    ids=lambda value: value.name if isinstance(value, Path) else None,
)
def test_tools_import_nothing_else_from_the_package(path, module, is_package):
    names = imported_modules(path.read_text(encoding="utf-8"), module, is_package)
    assert not outside(names, ("trl_grpo_ext.tools",))


def test_tools_need_trl_1_16(monkeypatch):
    """Older TRL releases parse tool calls differently: tools are a clear error there."""
    import trl

    from trl_grpo_ext.generation.multi_turn import ToolCallFormat
    from trl_grpo_ext.tiny import build_tiny_tokenizer

    monkeypatch.setattr(trl, "__version__", "1.7.0")
    with pytest.raises(ImportError, match=r"trl>=1\.16.*trl 1\.7\.0 is installed"):
        ToolCallFormat(build_tiny_tokenizer())


# --- run_python as a tool (its sandbox: test_run_python.py) -------------------------------


def test_run_python_is_a_tool_described_by_its_docstring():
    schema = get_json_schema(run_python)["function"]
    assert schema["name"] == "run_python"
    assert schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    # an instance with other limits is the same tool
    assert get_json_schema(PythonSandbox(cpu_seconds=1))["function"] == schema
    assert ToolSet([PythonSandbox()]).names == ["run_python"]
    assert run_python("print(6 * 7)") == "42"


@needs_trl_1_16
def test_the_model_calls_run_python_and_reads_its_output():
    tokenizer = qwen3_tokenizer()
    tools = ToolSet([run_python])
    messages = [{"role": "user", "content": "What is 2**100?"}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools.functions, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    turns = [
        encode(tokenizer, qwen3_call("run_python", code="print(2**100)")),
        encode(tokenizer, "1267650600228229401496703205376"),
    ]
    with ToolRunner(max_workers=2, timeout=30.0) as runner:
        loop = ToolLoop(
            ToolCallFormat(tokenizer),
            runner,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            max_completion_length=1024,
            max_model_len=8192,
        )
        result = loop.run(
            ScriptedEngine(turns),
            GenerationConfig(),
            None,
            prompt_ids,
            torch.ones_like(prompt_ids),
            [tools],
        )
    tool_message = result.completions[0][1]
    assert tool_message == {"role": "tool", "name": "run_python", "content": str(2**100)}
    assert result.calls == [1] and result.failures == [0]
