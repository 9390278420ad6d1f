"""Tests that compare with TRL itself compare with the release this project matches, trl 1.16;
the lowest-versions environment (`make test-lowest`) has an older TRL and skips them."""

import pytest
import trl

matches_trl = pytest.mark.skipif(
    not trl.__version__.startswith("1.16."),
    reason=f"compares with trl 1.16, found {trl.__version__}",
)
