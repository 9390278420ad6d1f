"""The fast paths on libraries' private internals (`trl_grpo_ext.internals`): each runs where its
library's installed release is in the range it is tested on, and elsewhere falls back to the
public way, records why and logs it once. Run in `.venv` (the newest releases: every path on)
and `.venv-lowest` (constraints/lowest.txt: transformers 5.19, the sampling loop off);
tests/vllm_engines/test_fast_paths.py runs the same checks in `.venv-vllm`."""

import logging

import pytest
from fast_path_checks import (  # noqa: F401 - fresh_internals is a fixture
    CHECKS,
    assert_runs_as_its_range_says,
    fresh_internals,
    installed,
)

from trl_grpo_ext import internals


def test_every_path_has_a_check():
    assert CHECKS.keys() == internals.FAST_PATHS.keys()


@pytest.mark.usefixtures("fresh_internals")
@pytest.mark.parametrize("name", list(internals.FAST_PATHS))
def test_each_path_runs_where_its_tested_range_says(name, monkeypatch, caplog):
    assert_runs_as_its_range_says(name, monkeypatch, caplog)


@pytest.mark.usefixtures("fresh_internals")
@pytest.mark.parametrize("name", list(internals.FAST_PATHS))
@pytest.mark.parametrize("why", ["untested release", "missing internal"])
def test_a_path_falls_back_and_says_why_once(name, why, monkeypatch, caplog):
    """A release outside the tested range, or one inside it without an internal the path uses:
    the public way runs (with the same results, each check compares them), and the reason is
    recorded and logged once."""
    path = internals.FAST_PATHS[name]
    if why == "untested release":
        replaced = internals.FastPath(path.library, "<0.1", path.internals, path.fallback)
    else:
        replaced = internals.FastPath(
            path.library, ">=0", path.internals, path.fallback, probe=lambda: "no `_gone`"
        )
    monkeypatch.setitem(internals.FAST_PATHS, name, replaced)
    with caplog.at_level(logging.WARNING, logger=internals.__name__):
        ran = [CHECKS[name](monkeypatch) for _ in range(2)]
    assert ran == [False, False]
    reason = internals.RAN[name]
    version = installed(path.library)
    if why == "untested release":
        tested = f"{path.library}<0.1"
        assert reason == f"{path.library} {version} is installed, and it is tested on {tested}"
    else:
        assert reason == f"no `_gone` ({path.library} {version})"
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1
    assert repr(name) in messages[0] and reason in messages[0] and path.fallback in messages[0]


def test_a_local_or_pre_release_build_counts_as_its_release():
    assert internals.in_tested_range("packed_weights", "2.13.0+cpu")
    assert internals.in_tested_range("packed_weights", "2.13.0a0+git1234")
    assert not internals.in_tested_range("packed_weights", "2.14.0")
    assert not internals.in_tested_range("sampling_loop", "5.23.0")
    assert internals.in_tested_range("sampling_loop", "5.24.0")
