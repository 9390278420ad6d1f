"""How each `loss_type` weighs the tokens of a short and a long completion.

On-policy (ratio 1) and without KL, the loss is -sum_t c_{i,t} A_i log pi_theta(o_{i,t}) up to a
constant, so the gradient with respect to each token's log-probability is -c_{i,t} A_i: the weight
c_{i,t} that the aggregation gives the token.
"""

import torch

from trl_grpo_ext.objective import LOSS_TYPES, LossSettings, policy_loss

# --8<-- [start:weights]
# Two completions in a batch padded to T = 8 tokens: one of 2 tokens, one of 6.
completion_mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
advantages = torch.tensor([1.0, 1.0])

weights = {}
for loss_type in LOSS_TYPES:
    logps = torch.zeros(2, 8, requires_grad=True)
    settings = LossSettings(loss_type=loss_type, max_completion_length=8)
    loss, _ = policy_loss(logps, None, advantages, completion_mask, settings)
    loss.backward()
    weights[loss_type] = (-logps.grad[:, 0]).tolist()  # weight of one token of each completion
    print(f"{loss_type:8s} short: {weights[loss_type][0]:.4f}  long: {weights[loss_type][1]:.4f}")

# grpo:    1 / (B |o_i|)           -> 1/4 for a token of the short one, 1/12 of the long one
# bnpo:    1 / (tokens in batch)   -> 1/8 for every token
# dr_grpo: 1 / (B * max length)    -> 1/16 for every token
# dapo:    1 / (tokens in the global batch; here the same batch) -> 1/8 for every token
expected = {"grpo": [1 / 4, 1 / 12], "bnpo": [1 / 8, 1 / 8], "dr_grpo": [1 / 16, 1 / 16]}
expected["dapo"] = [1 / 8, 1 / 8]
for loss_type, (short, long) in expected.items():
    assert torch.allclose(torch.tensor(weights[loss_type]), torch.tensor([short, long]))
# --8<-- [end:weights]
