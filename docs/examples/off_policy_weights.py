"""Truncated and masked importance weights, passed to `policy_loss` by hand.

`policy_loss` accepts `importance_weights` today; the trainer does not compute them yet (see the
page "Dynamic sampling and async rollouts"). This shows the arithmetic on made-up log-probs.
"""

import torch

from trl_grpo_ext.objective import policy_loss

# --8<-- [start:weights]
completion_mask = torch.ones(2, 3)
old_logps = torch.log(torch.tensor([[0.5, 0.4, 0.9], [0.3, 0.3, 0.3]]))  # trainer's pi_old
behaviour_logps = torch.log(torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.5, 0.3]]))  # sampler's mu
advantages = torch.tensor([1.0, -1.0])

token_weights = torch.exp(old_logps - behaviour_logps)  # (B, T): pi_old / mu per token
tis = token_weights.clamp(max=2.0)  # truncated: min(w, C) with C = 2
print(tis)  # tensor([[1.0, 2.0, 1.0], [1.0, 0.6, 1.0]]); the 4.0 was truncated to 2

sequence_weights = token_weights.prod(dim=1, keepdim=True)  # (B, 1): pi_old(o|q) / mu(o|q)
c_min, c_max = 0.5, 2.0
mis = ((sequence_weights >= c_min) & (sequence_weights <= c_max)).float()  # (B, 1)
print(mis.flatten())  # tensor([0., 1.]): the first sequence (weight 4) is left out

logps = old_logps.clone().requires_grad_(True)  # first step after sampling: pi_theta = pi_old
loss, _ = policy_loss(logps, old_logps, advantages, completion_mask, importance_weights=tis)
# --8<-- [end:weights]
assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 1.0], [1.0, 0.6, 1.0]]))
assert torch.equal(mis.flatten(), torch.tensor([0.0, 1.0]))
# on-policy ratio 1: loss = -(sum_t w_t A_i) / 6 tokens = -((1 + 2 + 1) - (1 + 0.6 + 1)) / 6
assert torch.isclose(loss, torch.tensor(-1.4 / 6))
