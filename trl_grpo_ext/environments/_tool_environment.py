"""Environment classes made at run time, whose methods are another framework's tools.

The trainer's `environment_factory` (tools/environments.py) lists an environment's tools from the
functions defined on its class, and describes each to the model with
`transformers.utils.get_json_schema` (type hints and a Google-style docstring). A tool of
verifiers or OpenEnv is known only at run time, by its name, its parameters and a description:
`environment_class` writes one method per tool on a new subclass of `base`, with that
signature, those annotations and a docstring built from them, which forwards the call to
`self._call_tool(name, arguments)` (or `await self._acall_tool(...)` for an async tool).
"""

from __future__ import annotations

import asyncio
import inspect
import keyword
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolSpec:
    """What the model sees of one tool: its name, description, parameters (an `inspect`
    signature without `self`, each annotated) and one line per parameter."""

    name: str
    description: str
    parameters: list[inspect.Parameter]
    parameter_docs: dict[str, str] = field(default_factory=dict)
    is_async: bool = False
    returns: Any = inspect.Signature.empty


def docstring(spec: ToolSpec) -> str:
    """A Google-style docstring: the description, then an `Args:` line per parameter."""
    description = " ".join((spec.description or f"The `{spec.name}` tool.").split())
    lines = [description]
    if spec.parameters:
        lines += ["", "Args:"]
        for parameter in spec.parameters:
            text = spec.parameter_docs.get(parameter.name) or f"The `{parameter.name}` argument."
            lines.append(f"    {parameter.name}: {' '.join(text.split())}")
    return "\n".join(lines)


def _method(spec: ToolSpec):
    if spec.is_async:

        async def tool(self, **arguments):
            return await self._acall_tool(spec.name, arguments)

    else:

        def tool(self, **arguments):
            return self._call_tool(spec.name, arguments)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    tool.__signature__ = inspect.Signature(
        [self_parameter, *spec.parameters], return_annotation=spec.returns
    )
    tool.__annotations__ = {p.name: p.annotation for p in spec.parameters}
    if spec.returns is not inspect.Signature.empty:
        tool.__annotations__["return"] = spec.returns
    tool.__name__ = tool.__qualname__ = spec.name
    tool.__doc__ = docstring(spec)
    return tool


def environment_class(class_name: str, base: type, specs: list[ToolSpec]) -> type:
    """A subclass of `base` with one method per tool of `specs`.

    Raises:
        `ValueError`: when a tool's name cannot be a method's name, or collides with `base`'s.
    """
    methods = {}
    for spec in specs:
        if not spec.name.isidentifier() or keyword.iskeyword(spec.name):
            raise ValueError(
                f"The tool {spec.name!r} cannot be called by that name from Python; tools here "
                "are named like functions (letters, digits and `_`)."
            )
        if spec.name in ("reset", "get_reward") or hasattr(base, spec.name):
            raise ValueError(f"The tool {spec.name!r} has the name of a method of {base.__name__}.")
        methods[spec.name] = _method(spec)
    return type(class_name, (base,), methods)


def run_sync(coroutine: Coroutine) -> Any:
    """Runs `coroutine` to its end from synchronous code: on a new event loop here, or in a
    thread of its own when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
