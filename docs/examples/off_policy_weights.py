"""Truncated and masked importance weights, computed by `importance_sampling_weights`.

Whenever a rollout carries behaviour log-probs (the asynchronous worker, a vLLM engine, a
`rollout_func` that returns them), the trainer does exactly this in `compute_objective`: the
log-probabilities of the sampler (the behaviour policy mu) and of the trainer's policy give the
weights, which `policy_loss` multiplies into the clipped surrogate. Here on made-up
log-probabilities.
"""

import torch

from trl_grpo_ext.objective import LossSettings, policy_loss
from trl_grpo_ext.off_policy import importance_sampling_stats, importance_sampling_weights

# --8<-- [start:weights]
completion_mask = torch.ones(2, 3)
old_logps = torch.log(torch.tensor([[0.5, 0.4, 0.9], [0.3, 0.3, 0.3]]))  # trainer: pi_old
behaviour_logps = torch.log(torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.5, 0.3]]))  # sampler: mu
advantages = torch.tensor([1.0, -1.0])

# token_truncate: per-token w = pi_old / mu = [[1, 4, 1], [1, 0.6, 1]], clamped at clip_max = 2
# (the asynchronous worker's former "tis").
tis, _ = importance_sampling_weights(
    old_logps, behaviour_logps, completion_mask, mode="token_truncate", clip_max=2.0
)
print(tis)  # tensor([[1.0, 2.0, 1.0], [1.0, 0.6, 1.0]])

# sequence_mask (TRL's default mode): per-sequence w = prod_t w_t = [4, 0.6], kept inside
# [clip_min, clip_max], else 0 (the former "mis"). With TRL's defaults, [None, 3]:
mis, _ = importance_sampling_weights(
    old_logps, behaviour_logps, completion_mask, mode="sequence_mask", clip_max=3.0
)
print(mis.flatten())  # tensor([0.0, 0.6]): the first sequence is left out
stats = importance_sampling_stats(old_logps, behaviour_logps, completion_mask, mis)
print(stats["sampling/importance_sampling_ratio/mean"])  # of the weights used: 0.3

logps = old_logps.clone().requires_grad_(True)  # first step after sampling: pi_theta = pi_old
loss, _ = policy_loss(
    logps, old_logps, advantages, completion_mask, LossSettings(), importance_weights=tis
)
# --8<-- [end:weights]
assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 1.0], [1.0, 0.6, 1.0]]))
assert torch.allclose(mis.flatten(), torch.tensor([0.0, 0.6]))
assert torch.isclose(stats["sampling/importance_sampling_ratio/mean"], torch.tensor(0.3))
# ratio 1: loss = -(sum_t w_t A_i) / 6 tokens = -((1 + 2 + 1) - (1 + 0.6 + 1)) / 6
assert torch.isclose(loss, torch.tensor(-1.4 / 6))
