"""The objective's functions on tensors small enough to check by hand."""

import math

import torch

from trl_grpo_ext.objective import LossSettings, group_advantages, kl_k3, policy_loss

# --8<-- [start:advantages]
# One prompt, G = 4 completions: two right (reward 1), two wrong (reward 0).
rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
advantages = group_advantages(rewards, group_size=4)
# mean 0.5, unbiased std sqrt(1/3) = 0.577, so A = +-0.5 / 0.577 = +-0.866
print(advantages)  # tensor([ 0.8659, -0.8659, -0.8659,  0.8659])
assert torch.allclose(advantages, torch.tensor([0.866, -0.866, -0.866, 0.866]), atol=1e-3)

# All four right: nothing to prefer, every advantage is 0 (and so is the gradient).
assert torch.equal(group_advantages(torch.ones(4), group_size=4), torch.zeros(4))
# --8<-- [end:advantages]

# --8<-- [start:clip]
# One token whose probability rose by a factor e^0.5 = 1.65 since sampling, advantage +1:
# the ratio is clipped at 1 + epsilon_high = 1.2, and the clipped branch carries no gradient.
logps = torch.tensor([[0.5]], requires_grad=True)  # log pi_theta, (B=1, T=1)
old_logps = torch.tensor([[0.0]])  # log pi_old
settings = LossSettings(epsilon_low=0.2)  # TRL's defaults: "dapo", epsilon_high = epsilon_low
loss, stats = policy_loss(logps, old_logps, torch.tensor([1.0]), torch.ones(1, 1), settings)
loss.backward()
print(loss.item(), logps.grad.item(), stats["clip_ratio/high_mean"].item())  # -1.2 0.0 1.0
assert math.isclose(loss.item(), -1.2, rel_tol=1e-6) and logps.grad.item() == 0.0

# The same token with advantage -1 is not clipped: the loss is rho * 1 = 1.65, gradient 1.65.
logps.grad = None
loss, _ = policy_loss(logps, old_logps, torch.tensor([-1.0]), torch.ones(1, 1), settings)
loss.backward()
assert math.isclose(loss.item(), math.exp(0.5), rel_tol=1e-6)
assert math.isclose(logps.grad.item(), math.exp(0.5), rel_tol=1e-6)
# --8<-- [end:clip]

# --8<-- [start:kl]
# k3 = pi_ref/pi - log(pi_ref/pi) - 1: zero when the policies agree, positive otherwise.
logps = torch.log(torch.tensor([0.5, 0.5, 0.1]))
ref_logps = torch.log(torch.tensor([0.5, 0.25, 0.2]))
print(kl_k3(logps, ref_logps))  # tensor([0.0000, 0.1931, 0.3069])
assert torch.allclose(kl_k3(logps, ref_logps), torch.tensor([0.0, 0.1931, 0.3069]), atol=1e-4)
# --8<-- [end:kl]
