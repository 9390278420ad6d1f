"""The public override points: a user replaces one step of the algorithm in a few lines."""

import torch
from trainer_helpers import logged, make_trainer, right_digit

from trl_grpo_ext import GroupRelativeTrainer


class LeaveOneOutTrainer(GroupRelativeTrainer):
    """RLOO: each completion's baseline is the mean reward of the other G - 1 in its group."""

    def compute_advantages(self, rewards):
        total = (rewards.nan_to_num() * self.reward_weights.to(rewards.device)).sum(dim=1)
        groups = total.view(-1, self.args.num_generations)  # (B, G)
        size = groups.shape[1]
        baseline = (groups.sum(dim=1, keepdim=True) - groups) / (size - 1)
        return (groups - baseline).flatten()


def test_leave_one_out_subclass_computes_rloo_and_learns(tmp_path):
    trainer = make_trainer(
        tmp_path,
        trainer_class=LeaveOneOutTrainer,
        reward_funcs=right_digit,
        num_generations=8,
        per_device_train_batch_size=32,
        max_completion_length=1,
        max_steps=100,
    )
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]] + [[0.0]] * 4)
    advantages = trainer.compute_advantages(rewards)
    # Hand computation: group sum 2; for a 1: 1 - 1/7; for a 0: 0 - 2/7.
    assert torch.allclose(advantages[:4], torch.tensor([1 - 1 / 7, -2 / 7, -2 / 7, 1 - 1 / 7]))
    trainer.train()
    curve = logged(trainer, "reward")
    assert sum(curve[-10:]) / 10 >= sum(curve[:10]) / 10 + 0.15


def test_score_rollouts_override_sees_the_rollout(tmp_path):
    class ShortIsGood(GroupRelativeTrainer):
        def score_rollouts(self, rollout):
            return (-rollout.completion_lengths.float()).unsqueeze(1)  # (N, 1)

    trainer = make_trainer(tmp_path, trainer_class=ShortIsGood, max_completion_length=4)
    trainer.train()
    assert logged(trainer, "reward")[0] <= -1
