"""Truncated and masked importance weights, computed by `off_policy_weights`.

In asynchronous mode the trainer does exactly this in `compute_objective`: the log-probabilities
of the rollout worker (the behaviour policy mu) and of the trainer's policy give the weights,
which `policy_loss` multiplies into the clipped surrogate. Here on made-up log-probabilities.
"""

import torch

from trl_grpo_ext.objective import policy_loss
from trl_grpo_ext.off_policy import off_policy_weights

# --8<-- [start:weights]
completion_mask = torch.ones(2, 3)
old_logps = torch.log(torch.tensor([[0.5, 0.4, 0.9], [0.3, 0.3, 0.3]]))  # trainer: pi_old
behaviour_logps = torch.log(torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.5, 0.3]]))  # worker: mu
advantages = torch.tensor([1.0, -1.0])

# TIS: per-token w = pi_old / mu = [[1, 4, 1], [1, 0.6, 1]], truncated at C = 2.
tis, stats = off_policy_weights(old_logps, behaviour_logps, completion_mask, correction="tis")
print(tis)  # tensor([[1.0, 2.0, 1.0], [1.0, 0.6, 1.0]])
print(stats["off_policy/clipped_fraction"])  # 1 token of 6 was truncated: 0.1667

# MIS: per-sequence w = prod_t w_t = [4, 0.6]; kept inside [C_min, C_max] = [0.5, 2], else 0.
mis, _ = off_policy_weights(
    old_logps, behaviour_logps, completion_mask, correction="mis", clip=2.0, min_weight=0.5
)
print(mis.flatten())  # tensor([0.0, 0.6]): the first sequence is left out

logps = old_logps.clone().requires_grad_(True)  # first step after sampling: pi_theta = pi_old
loss, _ = policy_loss(logps, old_logps, advantages, completion_mask, importance_weights=tis)
# --8<-- [end:weights]
assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 1.0], [1.0, 0.6, 1.0]]))
assert torch.isclose(stats["off_policy/clipped_fraction"], torch.tensor(1 / 6))
assert torch.allclose(mis.flatten(), torch.tensor([0.0, 0.6]))
# ratio 1: loss = -(sum_t w_t A_i) / 6 tokens = -((1 + 2 + 1) - (1 + 0.6 + 1)) / 6
assert torch.isclose(loss, torch.tensor(-1.4 / 6))
