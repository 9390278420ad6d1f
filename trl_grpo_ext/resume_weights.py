"""Full model weights back from a checkpoint, under the names the model uses.

`save_pretrained` writes a model's weights under its Hub checkpoint's names: a model whose
module layout changed since its first release (LLaVA and Qwen2-VL style vision-language models,
mixture-of-experts models whose experts are fused in memory) is saved with its names converted
back. `transformers.Trainer` reloads a checkpoint with `load_state_dict`, which does not convert
them: resuming a full fine-tune of such a model (or loading its best checkpoint at the end)
matches none of the saved weights, logs "There were missing keys in the checkpoint model
loaded" and goes on from the weights it had, the training so far lost (transformers issues
43701 and 48805). `load_full_weights` loads them as `from_pretrained` does, with the
conversion, and stops with an error if anything still does not match. LoRA adapters are saved
under PEFT's own names, and models whose names need no conversion load as before.
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME


def saved_weight_names(folder: str) -> set[str] | None:
    """The names of the weights a `save_pretrained` folder holds (safetensors, one file or
    sharded), or None where it holds none."""
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as handle:
            return set(json.load(handle)["weight_map"])
    single = os.path.join(folder, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as handle:
            return set(handle.keys())
    return None


def load_full_weights(model, folder: str) -> bool:
    """Loads the full weights saved in `folder` into `model` under its own names, where
    `load_state_dict` would miss some of them. Returns False, having loaded nothing, where it
    would not (a PEFT model, a folder without safetensors weights, or names that need no
    conversion): `Trainer` loads those itself.

    Raises:
        ValueError: the saved weights, converted, still leave some of the model's out or
            hold others; the model is left as it was.
    """
    if not isinstance(model, PreTrainedModel) or getattr(model, "_hf_peft_config_loaded", False):
        return False
    saved = saved_weight_names(folder)
    if saved is None or saved <= model.state_dict().keys():
        return False
    dtype = next(model.parameters()).dtype
    loaded, info = type(model).from_pretrained(
        folder, config=model.config, dtype=dtype, output_loading_info=True
    )
    problems = {
        kind: info.get(kind) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    problems = {kind: sorted(map(str, names))[:5] for kind, names in problems.items() if names}
    if problems:
        raise ValueError(
            f"The weights saved in {folder} do not fit {type(model).__name__}, even under the "
            f"names from_pretrained converts them to ({problems}). Resume with the model the "
            "checkpoint was trained from."
        )
    model.load_state_dict(loaded.state_dict())
    return True


class FullWeightsMixin:
    """`Trainer`'s checkpoint and best-model loading, with full weights saved under converted
    names loaded under the model's own (`load_full_weights`); DeepSpeed and FSDP load their own
    shards as before."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = model if model is not None else self.model
        if not self._loaded_full_weights(model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        if not self._loaded_full_weights(self.model, self.state.best_model_checkpoint):
            super()._load_best_model()

    def _loaded_full_weights(self, model, folder: str) -> bool:
        """Whether `load_full_weights` loaded `folder` into `model`; never under DeepSpeed or
        FSDP, whose own loading reads their shards."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        return load_full_weights(model, folder)
