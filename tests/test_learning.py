"""The test none of the reference trainers has: GRPO raises the reward on a task.

Task: answer `a+b=` with the right digit (a, b < 3), reward 1 for the right first character.
A random tiny model almost never starts with it; a fixed-seed run must raise the mean reward of
its last 10 steps clearly above that of its first 10, for each loss type, with LoRA and with full
fine-tuning. (The tiny model uses initializer_range=0.2: with 0.02 its logits are nearly uniform
and LoRA on the inner layers barely moves them.)
"""

import pytest
from trainer_helpers import logged, make_trainer, right_digit

MARGIN = 0.15  # absolute rise in mean reward; chance level is about 1/259


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_reward_rises(tmp_path, loss_type, peft):
    trainer = make_trainer(
        tmp_path,
        peft=peft,
        reward_funcs=right_digit,
        loss_type=loss_type,
        num_generations=8,
        per_device_train_batch_size=32,
        max_completion_length=1,
        max_steps=100,
        learning_rate=1e-2 if peft else 2e-3,
    )
    trainer.train()
    rewards = logged(trainer, "reward")
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + MARGIN, (first, last)
