"""Finding the checkpoint to resume from, skipping those whose writing was interrupted."""

from __future__ import annotations

import json
import os
import warnings


def is_complete_checkpoint(path: str) -> bool:
    """A checkpoint is complete when its `trainer_state.json`, written last, parses."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as handle:
            json.load(handle)
        return True
    except (OSError, ValueError):
        return False


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` in `output_dir` whose writing finished, or None."""
    if not os.path.isdir(output_dir):
        return None
    candidates = []
    for name in os.listdir(output_dir):
        prefix, _, step = name.partition("-")
        if prefix == "checkpoint" and step.isdigit():
            candidates.append((int(step), os.path.join(output_dir, name)))
    for _, path in sorted(candidates, reverse=True):
        if is_complete_checkpoint(path):
            return path
        warnings.warn(
            f"Skipping {path}: its writing was interrupted (left in place).", stacklevel=3
        )
    return None
