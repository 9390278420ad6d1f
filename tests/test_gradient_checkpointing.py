"""Gradient checkpointing keeps the training arguments' setting through generation, and is
reentrant under DeepSpeed ZeRO-3, where LoRA needs it (transformers#47254)."""

import pytest
from trainer_helpers import make_trainer
from transformers import TrainerCallback

from trl_grpo_ext import GroupRelativeConfig


def use_reentrant(model) -> bool:
    """The `use_reentrant` that the model's checkpointed layers pass to torch's checkpoint."""
    functions = {
        module._gradient_checkpointing_func
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False)
    }
    assert len(functions) == 1, functions
    return functions.pop().keywords["use_reentrant"]


class RecordCheckpointing(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.seen.append(("begin", use_reentrant(model)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append((state.global_step, use_reentrant(model)))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_checkpointing_setting_survives_generation(tmp_path, reentrant):
    """Generation turns checkpointing off and on again; it must come back as the arguments
    set it, not as transformers' default."""
    record = RecordCheckpointing()
    trainer = make_trainer(
        tmp_path,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        max_steps=2,
    )
    trainer.add_callback(record)
    trainer.train()
    assert record.seen == [("begin", reentrant), (1, reentrant), (2, reentrant)]


@pytest.fixture
def zero3_launch(monkeypatch):
    """The environment `accelerate launch` gives a DeepSpeed ZeRO-3 config (DeepSpeed itself
    need not be installed to build the arguments)."""
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setattr(DeepSpeedPlugin, "set_deepspeed_weakref", lambda self: None)


def test_zero3_defaults_to_reentrant_checkpointing(tmp_path, zero3_launch):
    args = GroupRelativeConfig(output_dir=str(tmp_path), gradient_checkpointing=True)
    assert args.deepspeed_plugin.zero_stage == 3
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": True}
    if hasattr(args, "activation_checkpointing_kwargs"):  # transformers >= 5.23's name
        assert args.activation_checkpointing_kwargs == {"use_reentrant": True}
    given = GroupRelativeConfig(
        output_dir=str(tmp_path),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True, "preserve_rng_state": False},
    )
    assert given.gradient_checkpointing_kwargs == {
        "use_reentrant": True,
        "preserve_rng_state": False,
    }


def test_without_deepspeed_checkpointing_is_non_reentrant(tmp_path):
    args = GroupRelativeConfig(output_dir=str(tmp_path), gradient_checkpointing=True)
    assert args.deepspeed_plugin is None
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}


def test_lora_under_zero3_with_non_reentrant_checkpointing_is_a_clear_error(tmp_path, zero3_launch):
    from peft import LoraConfig

    from trl_grpo_ext.models import prepare_policy
    from trl_grpo_ext.tiny import tiny_model_and_tokenizer

    args = GroupRelativeConfig(
        output_dir=str(tmp_path),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    model, _ = tiny_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match="Remove use_reentrant from gradient_checkpointing_kwargs"):
        prepare_policy(model, args, LoraConfig(r=4, target_modules="all-linear"))
