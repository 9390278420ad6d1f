"""`trl_grpo_ext.environments` imports without verifiers, reasoning-gym and OpenEnv; an adapter
whose package is missing says how to install it."""

import importlib
import sys

import pytest

import trl_grpo_ext.environments as environments

SOURCES = ("verifiers", "verifiers.v1", "reasoning_gym", "openenv", "openenv.core")


@pytest.fixture
def without_sources(monkeypatch):
    """Every source package as if it were not installed (`import` raises ImportError)."""
    for module in SOURCES:
        monkeypatch.setitem(sys.modules, module, None)


def test_the_package_imports_without_any_source(without_sources):
    modules = [name for name in sys.modules if name.startswith("trl_grpo_ext.environments.")]
    for name in sorted(modules) + ["trl_grpo_ext.environments"]:
        importlib.reload(sys.modules[name])  # imports again, the sources unimportable


@pytest.mark.parametrize(
    ("adapter", "arguments"),
    [
        ("from_reasoning_gym", ("leg_counting",)),
        ("from_verifiers", (object(),)),
        ("from_openenv", ("http://127.0.0.1:1",)),
    ],
)
def test_a_missing_package_says_how_to_install_it(without_sources, adapter, arguments):
    with pytest.raises(ImportError, match=r"pip install 'trl_grpo_ext\[environments\]'"):
        getattr(environments, adapter)(*arguments)
