"""Override `score_rollouts`: post-process the reward matrix with what the rollout knows."""

import torch
from toy_task import closeness, digit_sum_dataset, exact, lora_config, tiny_policy

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer, Rollout


# --8<-- [start:subclass]
class NoTruncationTrainer(GroupRelativeTrainer):
    """Gives every reward function's score 0 to a completion that hit max_completion_length
    without ending (an "overlong" completion): its answer was cut off."""

    def score_rollouts(self, rollout: Rollout) -> torch.Tensor:
        rewards = super().score_rollouts(rollout)  # (N, F), NaN = not applicable
        truncated = rollout.is_truncated.to(rewards.device).unsqueeze(1)  # (N, 1)
        return rewards.masked_fill(truncated & ~rewards.isnan(), 0.0)  # (N, F)

    # --8<-- [end:subclass]


model, tokenizer = tiny_policy()
args = GroupRelativeConfig(
    output_dir="runs/no-truncation",
    num_generations=4,
    max_completion_length=3,
    per_device_train_batch_size=16,
    max_steps=1,
    reward_weights=[1.0, 0.0],  # `exact` is logged but not trained on
    report_to="none",
)
trainer = NoTruncationTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[closeness, exact],
    args=args,
    train_dataset=digit_sum_dataset(),
    peft_config=lora_config(),
)
rollout = trainer.generate_rollouts([{"prompt": "2+3=", "answer": "5"}])
rewards = trainer.score_rollouts(rollout)  # (4, 2)
assert rewards.shape == (4, 2) and (rewards[rollout.is_truncated] == 0).all()
trainer.train()
