"""A verifiers (`verifiers.v1`) environment or taskset as the trainer's keyword arguments.

`from_verifiers(env)` takes a `vf.Env` (what `vf.load_environment` returns; its `taskset` is
used) or a `vf.Taskset`, and maps:

- dataset: one row per task, in the taskset's order (a bounded taskset, or view of one such as
  `taskset.take(1000)`); `prompt` is the task's system prompt as a system message, then its
  prompt (a string as one user message, or its messages); the task data's own fields (those a
  `TaskData` subclass adds, e.g. `answer`) as columns; `verifiers_index`, the task's position;
- rewards: one reward function per `@vf.reward` method (and per reward plugged by the task's
  config), under the method's name: the score that `Task.score` records for a trace whose
  prompt is the task's and whose reply is the completion (its messages, tool calls and results
  included); each trace is scored once for all the functions. Their weights are the methods'
  (`@vf.reward(weight=...)`): `from_verifiers(env, args=args)` writes them into
  `args.reward_weights`, and the returned dict's `reward_weights` attribute lists them;
- tools: the `@vf.tool` methods of the task's toolsets (`Task.toolsets`, new ones for each
  rollout, set up for its task) and of the taskset's (`Taskset.toolsets`, shared), named as
  verifiers advertises them (`<server>_<tool>`), as an `environment_factory` whose `reset`
  starts the rollout's toolsets. They run in this process, not as MCP servers.

Rewards and metrics that need a verifiers runtime (a sandbox) are left out, with a warning, as
`Task.score` leaves them out without one; verifiers' own harnesses (its multi-turn programs)
are out of scope: the trainer's multi-turn loop samples the turns.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any, get_type_hints

from ._imports import require
from ._tool_environment import ToolSpec, environment_class, run_sync

logger = logging.getLogger(__name__)

INDEX_COLUMN = "verifiers_index"


class TrainerArguments(dict):
    """Keyword arguments of `GroupRelativeTrainer`; `reward_weights` (an attribute, not a key)
    holds the weights of the reward functions, in order, for `args.reward_weights`."""

    reward_weights: list[float] | None = None


def _taskset_of(env):
    vf = require("verifiers.v1", "verifiers")
    if isinstance(env, vf.Env):
        return env.taskset
    if isinstance(env, vf.Taskset):
        return env
    raise TypeError(
        f"from_verifiers: got a {type(env).__name__}; expected a verifiers.v1 Env (what "
        "vf.load_environment returns) or a vf.Taskset."
    )


def _message_dicts(messages) -> list[dict]:
    return [message.model_dump(exclude_none=True) for message in messages]


def task_prompt(task) -> list[dict]:
    """The conversational prompt of a task: its system prompt, then its prompt."""
    data = task.data
    messages = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += _message_dicts(data.prompt)
    if not messages or messages[-1]["role"] == "system":
        raise ValueError(
            f"from_verifiers: task {data.idx} has no prompt; the trainer samples a reply to the "
            "task's prompt, so each task needs one."
        )
    return messages


def own_fields(task) -> list[str]:
    """The fields a `TaskData` subclass adds to verifiers' own."""
    vf = require("verifiers.v1", "verifiers")
    return [name for name in type(task.data).model_fields if name not in vf.TaskData.model_fields]


def _column_value(value):
    """A task field as a dataset column: plain values as they are, models and nested values as
    JSON-compatible data."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def _needs_runtime(function) -> bool:
    parameter = inspect.signature(function).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


# ------------------------------------------------------------------ traces and scores


def _vf_messages(messages: list[dict]) -> list:
    """Chat messages (the trainer's dicts) as verifiers messages; tool calls get ids that tie
    each result to its call."""
    vf = require("verifiers.v1", "verifiers")
    converted, pending_ids = [], []
    for number, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role == "system":
            converted.append(vf.SystemMessage(content=content or ""))
        elif role == "user":
            converted.append(vf.UserMessage(content=content or ""))
        elif role == "assistant":
            calls = []
            for index, call in enumerate(message.get("tool_calls") or []):
                function = call.get("function", call)
                arguments = function.get("arguments", {})
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments)
                call_id = call.get("id") or f"call_{number}_{index}"
                calls.append(vf.ToolCall(id=call_id, name=function["name"], arguments=arguments))
            pending_ids = [call.id for call in calls]
            text = content if isinstance(content, str) or content is None else str(content)
            converted.append(vf.AssistantMessage(content=text, tool_calls=calls or None))
        elif role == "tool":
            call_id = message.get("tool_call_id") or (pending_ids.pop(0) if pending_ids else "")
            converted.append(
                vf.ToolMessage(
                    tool_call_id=call_id, content=content or "", name=message.get("name")
                )
            )
        else:
            raise ValueError(f"A message with role {role!r} cannot be scored by verifiers.")
    return converted


def completion_messages(completion) -> list[dict]:
    """A completion as chat messages: a string is one assistant message."""
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    return list(completion)


def trace_of(task, completion) -> Any:
    """A verifiers trace of `task` whose prompt is the task's and whose reply (the sampled
    messages) is `completion`."""
    vf = require("verifiers.v1", "verifiers")
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask

    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=vf.AgentConfig(), name="trl_grpo_ext", trainable=True),
    )
    prompt = _vf_messages(task_prompt(task))
    reply = _vf_messages(completion_messages(completion))
    for position, message in enumerate(prompt + reply):
        trace.nodes.append(
            MessageNode(
                parent=position - 1 if position else None,
                message=message,
                sampled=position >= len(prompt) and message.role == "assistant",
            )
        )
    trace.is_completed = trace.ok = True
    return trace


class VerifiersScorer:
    """Scores completions with `Task.score`, once per (task, completion) for all the reward
    functions of a batch: the functions of one batch share the scores of the latest batch."""

    def __init__(self, tasks: list):
        self.tasks = tasks
        self._batch_key: Any = None
        self._scores: list[dict] = []

    def scores(self, completions, indices) -> list[dict]:
        key = (json.dumps(completions, sort_keys=True, default=str), tuple(indices))
        if key != self._batch_key:
            self._scores = [self._score(self.tasks[i], c) for c, i in zip(completions, indices)]
            self._batch_key = key
        return self._scores

    @staticmethod
    def _score(task, completion) -> dict:
        trace = trace_of(task, completion)
        run_sync(task.score(trace))
        return trace.rewards


def _reward_function(name: str, scorer: VerifiersScorer):
    def reward(completions, **kwargs) -> list[float]:
        indices = kwargs.get(INDEX_COLUMN)
        if indices is None:
            raise ValueError(
                f"The verifiers reward {name!r} needs the `{INDEX_COLUMN}` column of the rows "
                "that from_verifiers made; train on that dataset."
            )
        values = []
        for rewards in scorer.scores(list(completions), list(indices)):
            if name not in rewards:
                raise ValueError(
                    f"verifiers recorded no reward {name!r} (it recorded {sorted(rewards)}); a "
                    "reward method that returns keyed scores is not supported here."
                )
            values.append(None if rewards[name] is None else rewards[name].score)
        return values

    reward.__name__ = reward.__qualname__ = name
    return reward


# ------------------------------------------------------------------ tools


def _tool_spec(name: str, method) -> ToolSpec:
    signature = inspect.signature(method)
    try:
        hints = get_type_hints(method)
    except Exception:  # noqa: BLE001 - unresolvable hints: the raw annotations
        hints = {}
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(
                f"The verifiers tool {name!r} takes *args or **kwargs, which cannot be described "
                "to the model; give it named parameters."
            )
        annotation = hints.get(parameter.name, parameter.annotation)
        if annotation is inspect.Parameter.empty:
            annotation = str
        parameters.append(parameter.replace(kind=parameter.KEYWORD_ONLY, annotation=annotation))
    return ToolSpec(
        name=name,
        description=inspect.getdoc(method) or "",
        parameters=parameters,
        is_async=inspect.iscoroutinefunction(method),
        returns=hints.get("return", inspect.Signature.empty),
    )


def _tools(toolsets) -> dict[str, tuple[int, str]]:
    """`{advertised name: (toolset position, method name)}`, as verifiers names them."""
    from verifiers.v1.utils.decorators import discover_decorated

    names: dict[str, tuple[int, str]] = {}
    for position, toolset in enumerate(toolsets):
        prefix = toolset.server_name
        for method in discover_decorated(toolset, "tool"):
            tool = getattr(method, "tool_name", None) or method.__name__
            full = f"{prefix}_{tool}" if prefix else tool
            if full in names:
                raise ValueError(f"Two verifiers tools are named {full!r}; give one a TOOL_PREFIX.")
            names[full] = (position, method.__name__)
    return names


class VerifiersToolEnvironment:
    """The base of the environment class `from_verifiers` makes: one instance per rollout at a
    time; `reset(**row)` makes and sets up the task's toolsets for that row's task; the tool
    methods (made per tool) call the toolsets' `@vf.tool` methods."""

    tasks: list = []
    shared_toolsets: list = []
    tool_names: dict[str, tuple[int, str]] = {}

    def __init__(self):
        self.toolsets = list(self.shared_toolsets)
        self.task = None

    def reset(self, **row) -> None:
        if INDEX_COLUMN not in row:
            raise ValueError(
                f"The verifiers environment needs the `{INDEX_COLUMN}` column of the rows that "
                "from_verifiers made."
            )
        self.task = self.tasks[row[INDEX_COLUMN]]
        own = list(type(self.task).toolsets(self.task.config))

        async def set_up():
            for toolset in own:
                await toolset.setup()
                await toolset.setup_task(self.task)

        run_sync(set_up())
        self.toolsets = [*own, *self.shared_toolsets]
        return None

    def _method(self, name: str):
        position, method_name = self.tool_names[name]
        return getattr(self.toolsets[position], method_name)

    def _call_tool(self, name: str, arguments: dict) -> Any:
        result = self._method(name)(**arguments)
        if inspect.isawaitable(result):
            result = run_sync(_awaited(result))
        return result

    async def _acall_tool(self, name: str, arguments: dict) -> Any:
        result = self._method(name)(**arguments)
        if inspect.isawaitable(result):
            result = await result
        return result


async def _awaited(awaitable):
    return await awaitable


def _environment_factory(taskset, tasks: list):
    task_type = type(tasks[0])
    probe_own = list(task_type.toolsets(tasks[0].config))
    shared = list(type(taskset).toolsets(taskset.config))
    if not probe_own and not shared:
        return None
    if shared:

        async def set_up_shared():
            for toolset in shared:
                await toolset.setup()

        run_sync(set_up_shared())
    # Own toolsets come first in each rollout, as in the probe.
    tool_names = _tools([*probe_own, *shared])
    toolsets = [*probe_own, *shared]
    specs = [
        _tool_spec(name, getattr(toolsets[position], method))
        for name, (position, method) in tool_names.items()
    ]
    cls = environment_class(f"{task_type.__name__}Tools", VerifiersToolEnvironment, specs)
    cls.tasks, cls.shared_toolsets, cls.tool_names = tasks, shared, tool_names
    return cls


# ------------------------------------------------------------------ the adapter


def from_verifiers(env, args=None) -> TrainerArguments:
    """A verifiers environment or taskset as `GroupRelativeTrainer` keyword arguments.

    Args:
        env (`vf.Env` or `vf.Taskset`):
            What `vf.load_environment(...)` returns, or a taskset (or a bounded view of one,
            such as `taskset.take(1000)`).
        args ([`GroupRelativeConfig`], *optional*):
            The run's config: its `reward_weights` are set to the rewards' weights (an error
            when they are set to something else already).

    Returns:
        `TrainerArguments` (a dict): `train_dataset`, `reward_funcs` (one per reward, named after
        it) and, when the task or taskset has toolsets, `environment_factory`; its attribute
        `reward_weights` holds the rewards' weights.

    Example:
        >>> import verifiers.v1 as vf  # doctest: +SKIP
        >>> kwargs = from_verifiers(vf.load_environment(config), args=args)  # doctest: +SKIP
        >>> trainer = GroupRelativeTrainer(model, args=args, **kwargs)  # doctest: +SKIP
    """
    from datasets import Dataset

    taskset = _taskset_of(env)
    if not taskset.bounded:
        raise ValueError(
            f"from_verifiers: {type(taskset).__name__} is infinite; pass a bounded view of it, "
            "e.g. taskset.take(1000)."
        )
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"from_verifiers: {type(taskset).__name__} yields no task.")
    task_type = type(tasks[0])
    if any(type(task) is not task_type for task in tasks):
        raise ValueError("from_verifiers: the taskset yields tasks of several types.")
    columns = own_fields(tasks[0])
    reserved = sorted({"prompt", INDEX_COLUMN} & set(columns))
    if reserved:
        raise ValueError(f"from_verifiers: the task data's fields {reserved} are reserved here.")
    rows = [
        {
            "prompt": task_prompt(task),
            **{name: _column_value(getattr(task.data, name)) for name in columns},
            INDEX_COLUMN: position,
        }
        for position, task in enumerate(tasks)
    ]

    hooks = tasks[0].hooks("reward")
    offline = [fn for fn in hooks if not _needs_runtime(fn)]
    if len(offline) < len(hooks):
        logger.warning(
            "from_verifiers: the rewards %s need a verifiers runtime (a sandbox) and are left "
            "out, as Task.score leaves them out without one.",
            [fn.__name__ for fn in hooks if _needs_runtime(fn)],
        )
    if not offline:
        raise ValueError(
            f"from_verifiers: {task_type.__name__} has no reward that can be computed without a "
            "verifiers runtime; give it a @vf.reward method that reads the trace."
        )
    scorer = VerifiersScorer(tasks)
    reward_funcs = [_reward_function(fn.__name__, scorer) for fn in offline]
    weights = [float(getattr(fn, "_vf_weight", 1.0)) for fn in offline]
    judges = tasks[0].plugged_judges()
    if judges:
        reward_funcs += [_reward_function(judge.reward_name, scorer) for judge in judges]
        weights += [float(judge.config.weight) for judge in judges]

    arguments = TrainerArguments(train_dataset=Dataset.from_list(rows), reward_funcs=reward_funcs)
    arguments.reward_weights = weights
    factory = _environment_factory(taskset, tasks)
    if factory is not None:
        arguments["environment_factory"] = factory
    if args is not None:
        if args.reward_weights is not None and list(args.reward_weights) != weights:
            raise ValueError(
                f"from_verifiers: args.reward_weights is {args.reward_weights}, but the "
                f"verifiers rewards {[f.__name__ for f in reward_funcs]} weigh {weights}; unset "
                "it or set it to those."
            )
        args.reward_weights = weights
    elif any(weight != 1.0 for weight in weights):
        logger.warning(
            "from_verifiers: the rewards %s weigh %s in verifiers; pass args=args (or set "
            "args.reward_weights to the returned reward_weights) to train with those weights.",
            [f.__name__ for f in reward_funcs],
            weights,
        )
    return arguments
