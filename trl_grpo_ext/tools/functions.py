"""A named set of tool functions, as TRL's `GRPOTrainer(tools=...)` takes them.

A tool is a plain function, an `async def` function or a bound method, with type hints and a
Google-style docstring: its JSON schema, made by `transformers.utils.get_json_schema`, is what the
chat template shows the model, and its `__name__` is the name the model calls it by. The schema is
computed when the set is built, so a tool the template could not render fails at construction,
not in the middle of a rollout.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator

from transformers.utils import get_json_schema

# Building a schema parses a docstring (milliseconds); a bound method's schema does not depend on
# its instance, so it is cached by the underlying function. Environments build a set per rollout.
_schema_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_async_callable(function: Callable) -> bool:
    """Whether calling `function` returns a coroutine: `async def` functions and methods, partials of
    them, and objects whose `__call__` is `async def`."""
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or (
        callable(function) and inspect.iscoroutinefunction(function.__call__)
    )


def async_function(function: Callable) -> Callable | None:
    """The coroutine function to await for the tool `function`: itself when it is async
    (`is_async_callable`), its `async_call` attribute when it has one (an `async def` taking the
    same arguments, for a tool that is also called synchronously, as `run_python` is), else
    None (a sync tool)."""
    if is_async_callable(function):
        return function
    variant = getattr(function, "async_call", None)
    return variant if variant is not None and is_async_callable(variant) else None


def _schema(tool: Callable, name: str) -> dict:
    key = getattr(tool, "__func__", tool)
    try:
        return _schema_cache[key]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable, so not cached
        pass
    try:
        schema = get_json_schema(tool)
    except Exception as error:
        raise ValueError(
            f"Cannot describe the tool `{name}` to the model: {error}. A tool needs a type hint on "
            "every argument and a Google-style docstring: a one-line description, then an `Args:` "
            "section with one `name: description` line per argument."
        ) from error
    try:
        _schema_cache[key] = schema
    except TypeError:
        pass
    return schema


class ToolSet:
    """The tools one rollout may call, by name.

    Args:
        tools (`Iterable[Callable]`, *optional*):
            Functions, `async def` functions or bound methods, each with type hints and a
            Google-style docstring. Their `__name__`s must be distinct.

    Attributes:
        environment (`Any`): the environment instance whose tool methods the set holds (set by
            `Environments.toolset_for_instance`), None otherwise; a runner with threads runs the
            set's calls on the thread that instance is bound to.

    Raises:
        `ValueError`: when a tool has no `__name__`, two tools share a name, or a tool's JSON
            schema cannot be built (the message names the tool and says what to add).
    """

    def __init__(self, tools: Iterable[Callable] = ()) -> None:
        self._tools: dict[str, Callable] = {}
        self._schemas: list[dict] = []
        # the environment instance whose methods these are (`Environments`), if any
        self.environment = None
        for tool in tools:
            name = getattr(tool, "__name__", None)
            if not isinstance(name, str):
                raise ValueError(
                    f"The tool {tool!r} has no `__name__`, the name the model calls it by; pass a "
                    "function or a method (wrap a partial or a callable object in a `def`)."
                )
            if name in self._tools:
                raise ValueError(
                    f"Two tools are named `{name}`: the model calls a tool by name, so the names "
                    "must be distinct. Rename one of them."
                )
            self._schemas.append(_schema(tool, name))
            self._tools[name] = tool

    @property
    def names(self) -> list[str]:
        """The tools' names, in order."""
        return list(self._tools)

    @property
    def functions(self) -> list[Callable]:
        """The tools, in order: what `tokenizer.apply_chat_template(tools=...)` takes."""
        return list(self._tools.values())

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas (`{"type": "function", "function": {...}}`), in order."""
        return list(self._schemas)

    def is_async(self, name: str) -> bool:
        """Whether the tool `name` is awaited when called (`async_function`)."""
        return async_function(self._tools[name]) is not None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Callable:
        return self._tools[name]

    def __iter__(self) -> Iterator[Callable]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __add__(self, other: ToolSet | Iterable[Callable]) -> ToolSet:
        return ToolSet([*self, *other])

    def __repr__(self) -> str:
        return f"ToolSet({self.names})"


def as_toolset(tools: ToolSet | Iterable[Callable] | None) -> ToolSet:
    """`tools` as a `ToolSet` (the same object when it is one already)."""
    if isinstance(tools, ToolSet):
        return tools
    return ToolSet(tools or ())
