"""Shared fixtures: the offline environment and the tiny model built in code."""

import os
import tempfile

# Without these, any hub lookup hangs for about 50 s before failing on a machine without network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# trackio (the tests that report to it) writes to a folder of this run, not the user's.
os.environ.setdefault(
    "TRACKIO_DIR", os.path.join(tempfile.gettempdir(), f"trl_grpo_ext-trackio-{os.getpid()}")
)

import pytest  # noqa: E402

from trl_grpo_ext.tiny import build_tiny_tokenizer, save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Folder holding the tiny model and tokenizer, loadable with any `from_pretrained`."""
    return save_tiny(tmp_path_factory.mktemp("tiny-model"), seed=0)
