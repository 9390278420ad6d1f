"""Reward functions by name: the registry behind `reward_funcs` in configs.

A spec is a registered name (`"math_accuracy"`), a dotted import path (`"my_pkg.rewards:score"` or
`"my_pkg.rewards.score"`), a callable (returned unchanged), or a mapping
`{"name": <name or path>, **arguments}` as written in YAML. Registered factories and dotted paths
given arguments are called with them; the result's `__name__` is the metric name.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping

RewardFunc = Callable[..., list]

_REGISTRY: dict[str, tuple[Callable, bool]] = {}  # name -> (reward or factory, is_factory)


def register_reward(name: str, *, factory: bool = False, overwrite: bool = False):
    """Decorator that registers a reward function (or, with `factory=True`, a function that takes
    arguments and returns a reward function) under `name`, for `get_reward(name)` and configs.

    Args:
        name (`str`):
            The registry name; no dots or colons (those mark import paths).
        factory (`bool`, *optional*, defaults to `False`):
            Whether the decorated object builds the reward from keyword arguments.
        overwrite (`bool`, *optional*, defaults to `False`):
            Whether to replace an existing registration instead of raising.

    Example:
        >>> @register_reward("shout", overwrite=True)
        ... def shout(prompts=None, completions=None, **kwargs):
        ...     return [float(text.isupper()) for text in completions]
        >>> get_reward("shout")(completions=["HI", "hi"])
        [1.0, 0.0]
    """
    if not name or "." in name or ":" in name:
        raise ValueError(f"reward names may not be empty or contain '.' or ':', got {name!r}")

    def decorator(obj):
        if name in _REGISTRY and not overwrite:
            raise ValueError(f"a reward named {name!r} is already registered")
        _REGISTRY[name] = (obj, factory)
        return obj

    return decorator


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REGISTRY)


def get_reward(spec, **kwargs) -> RewardFunc:
    """Resolve `spec` to a reward function named by its metric (`__name__`).

    Args:
        spec (`str`, `Mapping` or `Callable`):
            A registered name, a dotted import path (`"pkg.module:function"`,
            `"pkg.module.function"`), a callable, or `{"name": ..., **arguments}`.
        **kwargs:
            Arguments for the factory (a registered factory, or an import path to one).

    Example:
        >>> get_reward("overlong_penalty", max_length=512, cache_length=128).__name__
        'overlong_penalty'
        >>> get_reward({"name": "math_accuracy", "answer_column": "solution"}).answer_column
        'solution'
    """
    if isinstance(spec, Mapping):
        arguments = dict(spec)
        if "name" not in arguments:
            raise ValueError(f"a reward given as a mapping needs a 'name' key, got {spec!r}")
        return get_reward(arguments.pop("name"), **arguments, **kwargs)
    if callable(spec) and not isinstance(spec, str):
        if kwargs:
            raise TypeError(f"arguments {sorted(kwargs)} given with the callable {spec!r}")
        return _named(spec, getattr(spec, "__name__", None))
    if not isinstance(spec, str):
        raise TypeError(f"a reward spec is a name, an import path or a callable, got {spec!r}")
    if "." in spec or ":" in spec:
        obj = _import_object(spec)
        if inspect.isclass(obj) or kwargs:
            obj = obj(**kwargs)
        if not callable(obj):
            raise TypeError(f"{spec!r} resolved to {obj!r}, which is not callable")
        return _named(obj, spec.replace(":", ".").rsplit(".", 1)[-1])
    if spec not in _REGISTRY:
        close = difflib.get_close_matches(spec, _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward {spec!r}.{hint} Registered rewards: {', '.join(list_rewards())}; "
            "or give an import path such as 'my_pkg.rewards:my_reward', or a reward model's "
            "local folder or Hub id ('org/name')."
        )
    obj, is_factory = _REGISTRY[spec]
    if is_factory:
        obj = obj(**kwargs)
    elif kwargs:
        raise TypeError(f"reward {spec!r} takes no arguments, got {sorted(kwargs)}")
    return _named(obj, spec)


def _named(reward, default_name: str | None) -> RewardFunc:
    if not getattr(reward, "__name__", None):
        try:
            reward.__name__ = default_name or type(reward).__name__
        except (AttributeError, TypeError):
            raise TypeError(
                f"reward {reward!r} has no __name__ to use as its metric name"
            ) from None
    return reward


def _import_object(path: str):
    """`pkg.module:attr` or `pkg.module.attr`: import the longest module prefix, then getattr.
    Modules of the working directory are found too, after every other place on `sys.path`:
    a console script's `sys.path` does not hold it (TRL issue 3448)."""
    if os.getcwd() not in (os.path.abspath(entry or os.curdir) for entry in sys.path):
        sys.path.append(os.getcwd())
    if ":" in path:
        module_name, _, attributes = path.partition(":")
        candidates = [(module_name, attributes.split("."))]
    else:
        parts = path.split(".")
        candidates = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    missing = path
    for module_name, attributes in candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # Missing module itself (or a parent package): try a shorter prefix. A module that
            # exists but fails on its own imports is reported as it is.
            if error.name and (
                module_name == error.name or module_name.startswith(error.name + ".")
            ):
                missing = error.name
                continue
            raise ImportError(
                f"reward {path!r}: importing {module_name!r} failed: {error}"
            ) from error
        except Exception as error:
            raise ImportError(
                f"reward {path!r}: importing {module_name!r} failed: {error!r}"
            ) from error
        obj = module
        for depth, attribute in enumerate(attributes):
            if not hasattr(obj, attribute):
                owner = ".".join([module_name, *attributes[:depth]])
                raise ImportError(f"reward {path!r}: {owner!r} has no attribute {attribute!r}")
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"reward {path!r}: no module named {missing!r}")
