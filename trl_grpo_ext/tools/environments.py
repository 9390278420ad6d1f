"""Environments for multi-turn rollouts, with the contract of TRL's `environment_factory`.

An environment is an object made by a factory (a callable taking no argument). Before each
rollout, `reset(**row)` is called with the dataset row; it returns `None` or an observation that
is appended to the last message of the prompt. Its public methods (listed on the class, so
properties are never evaluated; `reset`, `get_reward` and names starting with `_` excepted) are
the rollout's tools, next to the standalone tools. An optional `get_reward()` (sync or async) makes
the environment its own reward source: one reward function per environment class.

`environment_factory` is one factory, shared by every row, or a dict `{name: factory}`: then each
row's `environment` field names its factory, and that field is not passed to `reset`.

Instances are pooled and reused across batches ("construct once, reset often"): a batch takes one
distinct instance per rollout, and the pool grows only when a batch needs more of an environment
at once than exist. The instance probed at construction seeds the pool, unless the pool's
instances are made elsewhere (`create`: with tool threads, each on the thread that will call it).
The pool has slots: a batch takes its instances from one slot, and the next batch of that slot
gets (and resets) the same instances. Synchronous training uses slot 0 alone; asynchronous
rollouts give the batches in flight together different slots, so that no batch resets the
environments of one not yet scored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from .functions import ToolSet, as_toolset

EnvironmentFactory = Callable[[], Any]
ENVIRONMENT_FIELD = (
    "environment"  # the row field that picks a factory of a dict `environment_factory`
)
_NOT_TOOLS = ("reset", "get_reward")


def tool_method_names(environment_type: type) -> list[str]:
    """The names of the methods of `environment_type` that are tools, sorted (as TRL lists them)."""
    return [
        name
        for name, _ in inspect.getmembers(environment_type, predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    ]


def environment_prompt(row: dict) -> list[dict]:
    """The prompt of `row`; with an environment a row may have none (then `reset` supplies it), and
    TRL starts from one empty user message."""
    return row.get("prompt", [{"role": "user", "content": ""}])


def append_observation(prompt: list[dict], observation: str | list | None) -> list[dict]:
    """A new prompt whose last message has `observation` (what `reset` returned) appended to its
    content, with no separator, as TRL does; the input prompt is left untouched. A string joins a
    list of content parts as one more `{"type": "text"}` part, and a list turns string content
    into a text part first."""
    if observation is None:
        return list(prompt)
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


def _call_here(instance: Any, function: Callable) -> Any:
    return function()


def _reward_function(environment_type: type, call_on: Callable = _call_here) -> Callable:
    """A reward function in TRL's convention (`f(environments, **kwargs)`) that scores a rollout
    with its environment's `get_reward()` when that environment is exactly `environment_type`
    (not a subclass, as TRL), and `None` (not applicable) otherwise. A sync `get_reward` runs
    through `call_on`, on the thread its instance is bound to."""
    if inspect.iscoroutinefunction(environment_type.get_reward):

        async def reward(environments, **kwargs):
            return [
                await e.get_reward() if type(e) is environment_type else None for e in environments
            ]

    else:

        def reward(environments, **kwargs):
            return [
                call_on(e, e.get_reward) if type(e) is environment_type else None
                for e in environments
            ]

    reward.__name__ = reward.__qualname__ = environment_type.__name__
    return reward


class Environments:
    """The environments of a run: their factories, a pool of instances, their tools and rewards.

    Args:
        environment_factory (`Callable[[], Any]` or `dict[str, Callable[[], Any]]`):
            One factory, or a dict from the names that rows put in their `environment` field to
            factories. One instance per factory is made now to check it and list its tools.
        create (`Callable[[factory], Any]`, *optional*):
            Makes the pool's instances (`factory()` by default). A runner with threads
            (`ToolRunner.create`) makes each on the thread that will run its calls; the instance
            made now to check the factory is then kept out of the pool.
        call_on (`Callable[[instance, function], Any]`, *optional*):
            Runs `reset` and a sync `get_reward` of an instance (`function()` by default; with
            threads, `ToolRunner.call_on`, on the thread the instance is bound to).

    Raises:
        `ValueError`: when an instance has no `reset` method, or one of its tool methods has no
            type hints or docstring to describe it to the model.
    """

    def __init__(
        self,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory],
        create: Callable[[EnvironmentFactory], Any] | None = None,
        call_on: Callable[[Any, Callable], Any] | None = None,
    ):
        self._create = create or (lambda factory: factory())
        self._call_on = call_on or _call_here
        self._probes: dict[str | None, Any] = {}  # the instance made to check each factory
        self.multi = isinstance(environment_factory, dict)
        factories = environment_factory if self.multi else {None: environment_factory}
        if not factories:
            raise ValueError("`environment_factory` is an empty dict; give at least one factory.")
        for name, factory in factories.items():
            if not callable(factory):
                raise TypeError(f"{_label(name)} is a {type(factory).__name__}, not a callable.")
        self.factories: dict[str | None, EnvironmentFactory] = dict(factories)
        self._pool: dict[tuple[str | None, Any], list[Any]] = {}  # (name, slot) -> instances
        self._rewards: dict[type, Callable] = {}  # one per class, however many names map to it
        for name, factory in self.factories.items():
            instance = factory()
            members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "reset" not in members:
                raise ValueError(
                    f"The {type(instance).__name__} made by {_label(name)} has no `reset` method. "
                    "Each environment must define `reset(self, **row) -> str | None`: it is called "
                    "with the dataset row before each rollout, and what it returns is appended to "
                    "the prompt."
                )
            self.toolset_for_instance(instance)  # a method the model cannot see fails now
            self._probes[name] = instance
            if create is None:  # made where the pool's instances are made: it seeds the pool
                self._pool[(name, 0)] = [instance]
            if "get_reward" in members and type(instance) not in self._rewards:
                self._rewards[type(instance)] = _reward_function(type(instance), self._call_on)

    @property
    def names(self) -> list[str | None]:
        """The environments' names (`[None]` for a single factory)."""
        return list(self.factories)

    def name_of_row(self, row: dict) -> str | None:
        """The name of the environment `row` uses: its `environment` field for a dict factory,
        `None` for a single one."""
        if not self.multi:
            return None
        name = row.get(ENVIRONMENT_FIELD)
        self._check_name(name)
        return name

    def acquire(self, names: Iterable[str | None], slot: Any = 0) -> list[Any]:
        """One distinct instance per rollout, for rollouts using the environments `names`; the
        same instances are handed out again by the next call with the same `slot` (reset them
        before use), never by a call with another slot.

        Args:
            names (`Iterable[str | None]`): the environment of each rollout (`name_of_row`).
            slot (`Hashable`, *optional*, defaults to `0`): which instances to take; batches
                alive at the same time (asynchronous rollouts) take different slots.
        """
        names = list(names)
        for name in set(names):
            self._check_name(name)
        instances, taken = [], {}
        for name in names:
            pool = self._pool.setdefault((name, slot), [])
            index = taken.get(name, 0)
            if index == len(pool):
                pool.append(self._create(self.factories[name]))
            taken[name] = index + 1
            instances.append(pool[index])
        return instances

    def reset(self, instance: Any, row: dict) -> str | list | None:
        """Call `instance.reset(**row)` (without the `environment` field of a dict factory) and
        return its observation: `None`, a string, or a list of content parts."""
        kwargs = {k: v for k, v in row.items() if k != ENVIRONMENT_FIELD} if self.multi else row
        observation = self._call_on(instance, lambda: instance.reset(**kwargs))
        if observation is None or isinstance(observation, (str, list)):
            return observation
        if inspect.iscoroutine(observation):
            observation.close()
            raise TypeError(
                f"{type(instance).__name__}.reset is async; define it with a plain `def`."
            )
        raise TypeError(
            f"{type(instance).__name__}.reset returned a {type(observation).__name__}; it must return "
            "None (the prompt is used as it is), a str (appended to the prompt's last message), "
            'or a list of content parts such as [{"type": "text", "text": ...}].'
        )

    def toolset_for_instance(self, instance: Any, standalone: ToolSet | Iterable = ()) -> ToolSet:
        """The tools of a rollout using `instance`: the standalone tools, then its methods bound
        to it (so each rollout's calls act on its own instance)."""
        methods = [getattr(instance, name) for name in tool_method_names(type(instance))]
        toolset = as_toolset(standalone) + methods
        toolset.environment = instance
        return toolset

    def tools_for(self, name: str | None, standalone: ToolSet | Iterable = ()) -> ToolSet:
        """The tools of the environment `name`, for rendering its schema in a prompt."""
        self._check_name(name)
        return self.toolset_for_instance(self._probes[name], standalone)

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """`(name, reward function)` for each environment class that defines `get_reward`, named
        after the class; the function returns `None` for rollouts of other environments."""
        return [(function.__name__, function) for function in self._rewards.values()]

    def _check_name(self, name: Any) -> None:
        if name not in self.factories:
            if not self.multi:
                raise ValueError(f"A single `environment_factory` has no environment {name!r}.")
            raise ValueError(
                f"The example has `{ENVIRONMENT_FIELD}={name!r}`, which is not among the environments "
                f"of `environment_factory`. Expected one of: {list(self.factories)}; set each row's "
                f"`{ENVIRONMENT_FIELD}` field to one of these names."
            )


def _label(name: str | None) -> str:
    return "`environment_factory`" if name is None else f"`environment_factory[{name!r}]`"
