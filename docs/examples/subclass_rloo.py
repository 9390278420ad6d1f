"""Override `compute_advantages`: RLOO's leave-one-out baseline instead of the group mean."""

import torch
from toy_task import closeness, digit_sum_dataset, lora_config, tiny_policy

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.objective import weighted_rewards


# --8<-- [start:subclass]
class RLOOTrainer(GroupRelativeTrainer):
    """A_i = r_i - mean of the other G - 1 rewards of the group (Ahmadian et al., 2024).

    The baseline of each completion does not depend on that completion, so the policy gradient
    estimate stays unbiased; there is no division by the std. Assumes every completion is scored
    (no reward function returned None).
    """

    def compute_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        total = weighted_rewards(rewards, self.reward_weights.to(rewards.device))  # (N,)
        grouped = total.view(-1, self.args.num_generations)  # (B, G)
        group_size = grouped.shape[1]
        others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # (B, G)
        return (grouped - others_mean).flatten()  # (N,)

    # --8<-- [end:subclass]


model, tokenizer = tiny_policy()
args = GroupRelativeConfig(
    output_dir="runs/rloo",
    num_generations=4,
    max_completion_length=2,
    per_device_train_batch_size=16,
    learning_rate=1e-2,
    max_steps=1,
    report_to="none",
)
trainer = RLOOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=closeness,
    args=args,
    train_dataset=digit_sum_dataset(),
    peft_config=lora_config(),
)
# G = 4 rewards [1, 0, 0, 1]: the others' means are [1/3, 2/3, 2/3, 1/3].
advantages = trainer.compute_advantages(torch.tensor([[1.0], [0.0], [0.0], [1.0]]))
assert torch.allclose(advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
trainer.train()
