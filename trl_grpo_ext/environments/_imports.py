"""Importing an adapter's source package, with the error that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "pip install 'trl_grpo_ext[environments]'"


def require(module: str, package: str) -> ModuleType:
    """`import module`, or an `ImportError` naming `package` and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"This adapter needs the `{package}` package, which is not installed ({error}). "
            f"Install it with `{INSTALL_HINT}`."
        ) from error
