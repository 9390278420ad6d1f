"""The group-relative policy objective, as pure tensor functions.

Everything here takes tensors and returns tensors: no Trainer, Accelerate or I/O, so each formula
can be checked by hand on three-element tensors. Notation: N = B*G completions (B prompts, G =
`group_size` completions each), F reward functions, T completion tokens, V vocabulary size.

Equations implemented (numbers refer to the steps in `DESIGN.md`):

* Step 2-3, GRPO advantage (Shao et al., 2024, "DeepSeekMath", outcome supervision):
  `A_i = (r_i - mean_group(r)) / (std_group(r) + eps)` with `r_i = sum_f w_f r_{i,f}`. Dr. GRPO
  (Liu et al., 2025, "Understanding R1-Zero-Like Training") drops the std: `scale="none"`.
  `scale="batch"` divides by the std of the whole batch instead (as TRL's `scale_rewards="batch"`).
* Step 4, the per-token log-probabilities `log softmax(z / tau)[o_t]` it takes as inputs, are
  computed in `logprobs.py`.
* Step 5-6, the clipped surrogate (the GRPO objective; PPO, Schulman et al., 2017):
  `-min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_k3`, with the decoupled
  clip range of DAPO (Yu et al., 2025) and the k3 KL estimator of the GRPO paper,
  `pi_ref/pi_theta - log(pi_ref/pi_theta) - 1`.
* Step 5, GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): the sequence ratio
  `s_i = exp(mean_t log(pi_theta / pi_old))` ("sequence", as TRL), or its GSPO-token form
  ("sequence_token").
* Step 6, other per-token surrogates (TRL 1.16's loss types): CISPO (MiniMax-M1,
  `-sg[min(rho, eps_max)] A log pi`), SAPO (Soft Adaptive Policy Optimization,
  `-sigmoid(tau (rho - 1)) 4 / tau A`), VESPO (`-sg[phi(w_i)] A log pi`, a Gamma weight of the
  sequence ratio), and LUSPO (the clipped surrogate summed, not averaged, per sequence).
* Step 6, the KL term with DeepSeek-V3.2's bias correction `rho_t * KL_k3`, its off-policy
  sequence mask, and the high-entropy token selection of "Beyond the 80/20 Rule".
* Step 3, GDPO's "normalize_then_sum": each reward function normalised within its group before
  the weighted sum, then the sum normalised over the batch.
* Step 7, aggregation over tokens: "grpo" (GRPO, 1/|o_i| per sequence then mean), "bnpo"
  (mean over the tokens of the local batch), "dr_grpo" (Dr. GRPO, constant normaliser
  `B * max_completion_length`), "dapo" (DAPO, token-level mean over the global batch), "luspo"
  (sum per sequence, mean over sequences). Each `loss_type` names a surrogate and an aggregation
  (`LOSS_TYPE_TABLE`).

Where this differs from the papers:

* A completion for which every reward function returned "not applicable" (all NaN) is left out of
  its group's mean and std and gets advantage 0, so it neither moves the baseline nor is trained
  on. The std is the unbiased (Bessel-corrected) sample std, as `torch.std` and TRL; a group with
  fewer than two scored completions has std 0 (so all its advantages are 0; TRL returns NaN).
* The KL term is added per token *after* clipping, outside the `min`, as in GRPO (not
  folded into the reward as in PPO-RLHF). Optional `importance_weights` (e.g. a truncated
  importance-sampling correction for a generation engine that differs from the trained model)
  multiply the surrogate only, not the KL term, as TRL does (for VESPO they enter its sequence
  weight instead, also as TRL).
* `delta` is TRL's two-sided clipping: for negative advantages the unclipped ratio is capped at
  `delta`, which bounds the loss of a token whose probability exploded.
* "dapo" divides by `num_items_in_batch`, the number of completion tokens in the *global* batch,
  so the sum of the losses of micro-batches equals the loss of the whole batch (exact under
  gradient accumulation). The caller supplies that count; this module never communicates.
* "sequence" importance sampling is TRL's: one ratio `s_i` per sequence, differentiated as a
  whole, so its gradient is `s_i * mean_t grad log pi_theta(o_t)`. "sequence_token" (not in
  TRL) is the GSPO-token form `s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)]`: value
  `s_i` at every token, gradient `s_i * grad log pi_theta(o_t)`. Because the advantage is shared
  by all tokens of a sequence, the two give the same loss and gradient unless a per-token
  factor (per-token importance weights, the entropy mask, the bias-corrected KL) multiplies
  the ratio.
* Per-token importance weights of a padding position are taken as 1 inside VESPO's sequence
  weight (TRL sums the log of whatever is there; its own weights are 1 at padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "LOSS_TYPE_TABLE",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_MODES",
    "LossSettings",
    "LossType",
    "SurrogateInputs",
    "entropy_bonus",
    "group_advantages",
    "high_entropy_mask",
    "kl_k3",
    "off_policy_mask",
    "policy_loss",
    "weighted_rewards",
]

SCALE_MODES = ("group", "batch", "none")


# ----------------------------------------------------------------------------------------------
# Rewards -> advantages (steps 2-3)
# ----------------------------------------------------------------------------------------------


def weighted_rewards(
    rewards: torch.Tensor, weights: torch.Tensor | Sequence[float] | None = None
) -> torch.Tensor:
    """Weighted sum of the reward functions per completion, `r_i = sum_f w_f r_{i,f}`.

    Args:
        rewards (`torch.Tensor`):
            Rewards of shape `(N, F)`, one column per reward function. NaN means the function
            does not apply to that completion (it returned `None`); it is left out of the sum.
        weights (`torch.Tensor` or `Sequence[float]`, *optional*, defaults to all ones):
            Weight of each reward function, shape `(F,)`.

    Returns:
        `torch.Tensor`:
            Summed rewards of shape `(N,)`, NaN for a completion where every function was NaN.
    """
    if rewards.dim() == 1:  # a single reward function
        rewards = rewards.unsqueeze(-1)  # (N, 1)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape (N, F), got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    num_funcs = rewards.shape[1]
    if weights is None:
        weights = torch.ones(num_funcs, dtype=rewards.dtype, device=rewards.device)
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (num_funcs,):
        raise ValueError(
            f"weights must have one entry per reward function (F={num_funcs}), "
            f"got shape {tuple(weights.shape)}"
        )
    summed = (rewards * weights).nansum(dim=1)  # (N,)
    unscored = rewards.isnan().all(dim=1)  # (N,)
    return summed.masked_fill(unscored, float("nan"))


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    weights: torch.Tensor | Sequence[float] | None = None,
    scale: str = "group",
    eps: float = 1e-4,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Group-relative advantages, `A_i = (r_i - mean_group(r)) / (std(r) + eps)`.

    Rows are grouped in consecutive blocks of `group_size` (the G completions of one prompt). A
    completion whose reward functions all returned NaN counts as absent: it is excluded from its
    group's mean and std (and from the batch std) and its advantage is 0. The std is the unbiased
    sample std (Bessel's correction, like `torch.std` and TRL); with fewer than two scored
    completions it is taken as 0, so that group's advantages are all 0.

    Args:
        rewards (`torch.Tensor`):
            Rewards of shape `(N, F)` (or `(N,)` for a single function), NaN meaning "not
            applicable". `N` must be a multiple of `group_size`.
        group_size (`int`):
            Number of completions per prompt, G.
        weights (`torch.Tensor` or `Sequence[float]`, *optional*, defaults to all ones):
            Weight of each reward function, shape `(F,)`.
        scale (`str`, *optional*, defaults to `"group"`):
            What to divide the centred reward by: `"group"` (std of the group, GRPO), `"batch"`
            (std of all N scored rewards) or `"none"` (no division, Dr. GRPO). Used by
            `"sum_then_normalize"` only.
        eps (`float`, *optional*, defaults to `1e-4`):
            Added to the std before dividing, so a zero-variance group gives advantages 0.
        multi_objective_aggregation (`str`, *optional*, defaults to `"sum_then_normalize"`):
            One of `MULTI_OBJECTIVE_AGGREGATIONS`. `"sum_then_normalize"`: weighted sum of the
            reward functions, then centred per group and scaled by `scale`. `"normalize_then_sum"`
            (GDPO, as TRL): each function's rewards are centred and divided by their std within
            the group, the weighted sum of these is then centred and divided by its std over
            the whole batch; `scale` is not used.

    Returns:
        `torch.Tensor`:
            Advantages of shape `(N,)`.
    """
    if scale not in SCALE_MODES:
        raise ValueError(f"scale must be one of {SCALE_MODES}, got {scale!r}")
    if multi_objective_aggregation not in _MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, "
            f"got {multi_objective_aggregation!r}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() == 1:  # a single reward function
        rewards = rewards.unsqueeze(-1)  # (N, 1)
    num_completions = rewards.shape[0]
    if num_completions % group_size != 0:
        raise ValueError(
            f"the number of completions ({num_completions}) must be divisible by "
            f"group_size ({group_size})"
        )
    aggregate = _MULTI_OBJECTIVE_AGGREGATIONS[multi_objective_aggregation]
    return aggregate(rewards, group_size, weights, scale, eps)


def _sum_then_normalize(rewards, group_size, weights, scale, eps):
    # r_i = sum_f w_f r_{i,f}; A_i = (r_i - mean_group(r)) / (std_{group or batch}(r) + eps)
    summed = weighted_rewards(rewards, weights)  # (N,)
    grouped = summed.view(-1, group_size)  # (B, G)
    scored = ~grouped.isnan()  # (B, G)
    values = grouped.nan_to_num(0.0)  # (B, G); absent rows masked out below
    mean, std = _masked_mean_std(values, scored, dim=1)  # (B, 1) each
    centred = torch.where(scored, values - mean, 0.0)  # (B, G)
    if scale == "group":
        centred = centred / (std + eps)
    elif scale == "batch":
        _, batch_std = _masked_mean_std(values.flatten(), scored.flatten(), dim=0)  # (1,)
        centred = centred / (batch_std + eps)
    return centred.flatten()  # (N,)


def _normalize_then_sum(rewards, group_size, weights, scale, eps):
    # GDPO: z_{i,f} = (r_{i,f} - mean_group(r_f)) / (std_group(r_f) + eps), r_i = sum_f w_f z_{i,f},
    # A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps); `scale` does not enter
    if not rewards.is_floating_point():
        rewards = rewards.float()
    num_funcs = rewards.shape[1]
    grouped = rewards.view(-1, group_size, num_funcs)  # (B, G, F)
    scored = ~grouped.isnan()  # (B, G, F)
    values = grouped.nan_to_num(0.0)  # (B, G, F)
    mean, std = _masked_mean_std(values, scored, dim=1)  # (B, 1, F) each
    normalised = torch.where(scored, (values - mean) / (std + eps), float("nan"))  # (B, G, F)
    summed = weighted_rewards(normalised.view(-1, num_funcs), weights)  # (N,), NaN if unscored
    present = ~summed.isnan()  # (N,)
    values = summed.nan_to_num(0.0)  # (N,)
    batch_mean, batch_std = _masked_mean_std(values, present, dim=0)  # (1,) each
    return torch.where(present, (values - batch_mean) / (batch_std + eps), 0.0)  # (N,)


_MULTI_OBJECTIVE_AGGREGATIONS = {
    "sum_then_normalize": _sum_then_normalize,
    "normalize_then_sum": _normalize_then_sum,
}
MULTI_OBJECTIVE_AGGREGATIONS = tuple(_MULTI_OBJECTIVE_AGGREGATIONS)


def _masked_mean_std(
    values: torch.Tensor, present: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std over `dim` of the entries where `present` is True (keepdim)."""
    count = present.sum(dim=dim, keepdim=True)
    mean = torch.where(present, values, 0.0).sum(dim=dim, keepdim=True) / count.clamp(min=1)
    squares = torch.where(present, (values - mean) ** 2, 0.0).sum(dim=dim, keepdim=True)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return mean, torch.where(count > 1, std, 0.0)


# ----------------------------------------------------------------------------------------------
# KL estimator and the clipped surrogate (steps 5-7)
# ----------------------------------------------------------------------------------------------


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of `KL(pi_theta || pi_ref)` for tokens sampled from `pi_theta`.

    `k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 = expm1(d) - d` with `d = ref_logps - logps`
    (GRPO paper; Schulman, "Approximating KL divergence", 2020). It is non-negative and unbiased
    when the tokens are drawn from `pi_theta`. `expm1` keeps it accurate for small `d`, where the
    direct form subtracts two numbers close to 1.

    Args:
        logps (`torch.Tensor`):
            Log-probabilities of the sampled tokens under the current policy.
        ref_logps (`torch.Tensor`):
            Log-probabilities of the same tokens under the reference policy, same shape.

    Returns:
        `torch.Tensor`:
            Elementwise estimate, same shape as the inputs.
    """
    log_ratio = ref_logps - logps
    # clamp guards against a rounding error of expm1 giving -1e-12 instead of 0
    return (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _statistic_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of a statistic: over sequences when it has one value per sequence `(B, 1)` (TRL's
    convention at the sequence level), else over the unmasked tokens."""
    if values.shape[-1] == 1 and mask.shape[-1] > 1:
        return values.mean()
    return _masked_mean(values.expand_as(mask), mask)


def _statistic(name: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A statistic named `.../<x>_min` or `.../<x>_max` is the smallest or largest per-sequence
    mean (over its unmasked tokens; the value itself at the sequence level), sequences without
    tokens left out, NaN when none is left (TRL's `nanmin` / `nanmax`); any other, the mean of
    `_statistic_mean`."""
    extreme = {"_min": torch.min, "_max": torch.max}.get(name[-4:])
    if extreme is None:
        return _statistic_mean(values, mask)
    if values.shape[-1] == 1:  # (B, 1): one value per sequence
        per_sequence = values.squeeze(-1)  # (B,)
    else:
        per_sequence = (values * mask).sum(-1) / mask.sum(-1)  # (B,), NaN without tokens
    per_sequence = per_sequence[~per_sequence.isnan()]
    return extreme(per_sequence) if len(per_sequence) else values.new_tensor(float("nan"))


# ----------------------------------------------------------------------------------------------
# Masks of tokens and sequences (entropy selection, off-policy sequence masking)
# ----------------------------------------------------------------------------------------------


def high_entropy_mask(
    entropy: torch.Tensor,
    completion_mask: torch.Tensor,
    top_entropy_quantile: float = 1.0,
    pooled_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens whose entropy is in the top `top_entropy_quantile` ("Beyond the 80/20 Rule").

    With `rho = top_entropy_quantile`, a completion token is kept when its entropy is at least
    the `(1 - rho)`-quantile (linear interpolation, `torch.quantile`) of the entropies of all
    completion tokens of the micro-batch. `rho = 1` keeps every token; `rho = 0` keeps only the
    highest-entropy token(s). Padding is never kept. Same rule as TRL's `get_high_entropy_mask`.

    Args:
        entropy (`torch.Tensor`):
            Entropy of the policy at each completion position, `(B, T)`.
        completion_mask (`torch.Tensor`):
            1 (or True) for completion tokens, 0 for padding, `(B, T)`.
        top_entropy_quantile (`float`, *optional*, defaults to `1.0`):
            Fraction rho of the tokens to keep, in `[0, 1]`.
        pooled_entropy (`torch.Tensor`, *optional*):
            1-D entropies of the completion tokens that define the quantile. Defaults to those of
            this batch; the trainer passes those of the micro-batches of all processes, which
            TRL pools.

    Returns:
        `torch.Tensor`: boolean mask of shape `(B, T)`, True where the token is kept.
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    is_token = completion_mask.bool()  # (B, T)
    if top_entropy_quantile >= 1.0:
        return is_token
    return entropy_quantile_mask(
        entropy, completion_mask, 1.0 - top_entropy_quantile, pooled_entropy
    )


def entropy_quantile_mask(
    entropy: torch.Tensor,
    completion_mask: torch.Tensor,
    quantile: float,
    pooled_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """The completion tokens whose entropy is at least the `quantile`-quantile of
    `pooled_entropy` (by default, of this batch's completion tokens): TRL's
    `get_high_entropy_mask(entropies, mask, threshold=quantile)`; `(B, T)` bool."""
    is_token = completion_mask.bool()  # (B, T)
    if pooled_entropy is None:
        pooled_entropy = entropy[is_token]  # (number of completion tokens,)
    pooled_entropy = pooled_entropy.detach().float()
    if pooled_entropy.numel() == 0:
        return torch.zeros_like(is_token)
    threshold = torch.quantile(pooled_entropy, quantile)
    return (entropy.detach() >= threshold) & is_token  # (B, T)


def off_policy_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Off-policy sequence mask of DeepSeek-V3.2 (eq. 9): drop a sequence with a negative
    advantage whose mean per-token KL from the sampling policy exceeds `threshold`.

    `keep_i = [A_i >= 0] or [1/|o_i| sum_t (log mu(o_t) - log pi_theta(o_t)) <= threshold]`,
    with `mu` the policy that sampled the tokens. NaN sampling log-probabilities (tokens the
    engine could not score) count as a difference of 0. Same rule as TRL's `get_off_policy_mask`.

    Args:
        advantages (`torch.Tensor`):
            Advantages `(B, 1)` (or `(B,)`, or `(B, T)`).
        logps (`torch.Tensor`):
            Log-probabilities under the current policy, `(B, T)` (detached here).
        sampling_logps (`torch.Tensor`):
            Log-probabilities under the sampling policy, `(B, T)`.
        completion_mask (`torch.Tensor`):
            1 (or True) for completion tokens, 0 for padding, `(B, T)`.
        threshold (`float`):
            The largest mean KL for which a negative-advantage sequence is kept.

    Returns:
        `torch.Tensor`: `(B, 1)` (or `(B, T)` for per-token advantages) of 1.0 (keep) and 0.0
        (drop), in the dtype of `logps`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    is_token = completion_mask.bool()  # (B, T)
    kl = torch.where(is_token, sampling_logps - logps.detach(), 0.0).nan_to_num(nan=0.0)  # (B, T)
    lengths = is_token.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    mean_kl = kl.sum(-1, keepdim=True) / lengths  # (B, 1)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(logps.dtype)


def entropy_bonus(
    entropy: torch.Tensor,
    completion_mask: torch.Tensor,
    entropy_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean entropy over the tokens the policy loss acts on: the term that `entropy_coef`
    weighs, `L = L_policy - entropy_coef * H` (TRL's entropy bonus).

    `H = sum_t H_t m_t / sum_t m_t` over the micro-batch, with `m` the completion mask times the
    `entropy_mask` of `high_entropy_mask` when given. Whatever the `loss_type`, it is this plain
    mean (TRL scales it only for gradient accumulation, like the "grpo" loss).

    Args:
        entropy (`torch.Tensor`):
            Entropy at each completion position, `(B, T)`, differentiable.
        completion_mask (`torch.Tensor`):
            1 (or True) for completion tokens, 0 for padding, `(B, T)`.
        entropy_mask (`torch.Tensor`, *optional*):
            Boolean `(B, T)` of the tokens kept by `high_entropy_mask`.

    Returns:
        `torch.Tensor`: the scalar mean entropy.
    """
    is_token = completion_mask.bool()  # (B, T)
    if entropy_mask is not None:
        is_token = is_token & entropy_mask.bool()
    weights = is_token.to(entropy.dtype)  # (B, T)
    return torch.where(is_token, entropy, 0.0).sum() / weights.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------
# Importance-sampling levels (step 5): a table of log-ratio functions
# ----------------------------------------------------------------------------------------------

# Each takes the token log-ratios log(pi_theta / pi_old) and the log-probabilities, both already
# 0 at padding, and the float mask, all (B, T); it returns the log importance weight, (B, T) or
# (B, 1), differentiable with respect to `logps`.
_LogRatio = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _log_ratio_token(log_ratio, logps, mask):
    # rho_t = pi_theta(o_t) / pi_old(o_t)
    return log_ratio  # (B, T)


def _log_ratio_sequence(log_ratio, logps, mask):
    # GSPO: log s_i = 1/|o_i| sum_t log rho_t, one weight per sequence, differentiated as a whole
    return log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)


def _log_ratio_sequence_token(log_ratio, logps, mask):
    # GSPO-token: s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)]; value s_i at every token,
    # gradient s_i * grad log pi_theta(o_t)
    seq_log_ratio = _log_ratio_sequence(log_ratio, logps, mask)  # (B, 1)
    return logps - logps.detach() + seq_log_ratio.detach()  # (B, T)


_LOG_RATIOS: dict[str, _LogRatio] = {
    "token": _log_ratio_token,
    "sequence": _log_ratio_sequence,
    "sequence_token": _log_ratio_sequence_token,
}
IMPORTANCE_SAMPLING_LEVELS = tuple(_LOG_RATIOS)


# ----------------------------------------------------------------------------------------------
# Per-token surrogates (step 6): a table of functions
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SurrogateInputs:
    """What a per-token surrogate may read. Tensors are 0 at padding (the caller masks after).

    Attributes:
        ratio (`torch.Tensor`): importance ratio at the chosen level, `(B, T)` or `(B, 1)`,
            differentiable.
        logps (`torch.Tensor`): log pi_theta of the completion tokens, `(B, T)`, differentiable.
        log_ratio (`torch.Tensor`): token-level log(pi_theta / pi_old), `(B, T)`.
        advantages (`torch.Tensor`): `(B, 1)` or `(B, T)`.
        mask (`torch.Tensor`): float completion mask, `(B, T)`.
        importance_weights (`torch.Tensor` or `None`): detached `(B, T)` or `(B, 1)` multiplier
            (e.g. an off-policy correction), 0 at padding.

    The hyper-parameters come separately, as the [`LossSettings`] of `policy_loss`.
    """

    ratio: torch.Tensor
    logps: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    importance_weights: torch.Tensor | None


# A surrogate reads the tensors and the settings, and returns the per-token loss ((B, T) or
# (B, 1), importance weights applied) and its own detached statistics, each (B, T) or (B, 1), to
# be averaged by `_statistic_mean`.
_Surrogate = Callable[
    [SurrogateInputs, "LossSettings"], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


def _with_importance_weights(per_token_loss, inputs):
    if inputs.importance_weights is None:
        return per_token_loss
    return per_token_loss * inputs.importance_weights


def _surrogate_clipped(inputs, settings):
    # PPO / GRPO: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho capped at delta
    ratio, advantages = inputs.ratio, inputs.advantages
    low, high, delta = settings.epsilon_low, settings.epsilon_high, settings.delta
    clipped_ratio = ratio.clamp(1.0 - low, 1.0 + high)
    unclipped_ratio = ratio if delta is None else ratio.clamp(max=delta)
    per_token_loss = -torch.min(unclipped_ratio * advantages, clipped_ratio * advantages)
    with torch.no_grad():
        is_low = (ratio < 1.0 - low) & (advantages < 0)
        is_high = (ratio > 1.0 + high) & (advantages > 0)
        stats = {
            "clip_ratio/low_mean": is_low,
            "clip_ratio/high_mean": is_high,
            "clip_ratio/region_mean": is_low | is_high,
            "clip_ratio/low_min": is_low,  # `_statistic` reduces these by the name's suffix
            "clip_ratio/high_max": is_high,
        }
    return _with_importance_weights(per_token_loss, inputs), stats


def _surrogate_cispo(inputs, settings):
    # CISPO (MiniMax-M1): -sg[min(rho, eps_high)] A log pi_theta; the weight is clipped, never
    # the gradient, so every token keeps contributing. epsilon_high is the cap itself (eps_max).
    cap = settings.epsilon_high
    weight = inputs.ratio.clamp(max=cap).detach()
    per_token_loss = -weight * inputs.advantages * inputs.logps
    with torch.no_grad():
        stats = {"cispo_clip_ratio": (inputs.ratio > cap) & (inputs.advantages > 0)}
    return _with_importance_weights(per_token_loss, inputs), stats


def _surrogate_sapo(inputs, settings):
    # SAPO: a soft gate instead of the clip, -sigmoid(tau (rho - 1)) * 4 / tau * A, with
    # tau = tau_pos for A > 0 and tau_neg otherwise; value 2A/tau and gradient A at rho = 1.
    temperature = torch.where(
        inputs.advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg
    ).to(inputs.ratio.dtype)
    gate = torch.sigmoid(temperature * (inputs.ratio - 1.0)) * 4.0 / temperature
    return _with_importance_weights(-gate * inputs.advantages, inputs), {}


def _surrogate_vespo(inputs, settings):
    # VESPO: -sg[phi(w_i)] A log pi_theta with the Gamma weight phi(w) = e^lam w^k e^(-lam w)
    # (phi(1) = 1) of the unnormalised sequence ratio w_i = prod_t rho_t * importance weights;
    # (k, lam) depend on the sign of A. Importance weights enter w_i, not the loss.
    log_floor = math.log(1e-8)
    seq_log_ratio = (
        inputs.log_ratio.detach().clamp(-20.0, 20.0).sum(-1, keepdim=True)  # (B, 1)
    )
    weights = inputs.importance_weights
    if weights is not None:
        log_weights = torch.log(weights).clamp(log_floor, 20.0)  # (B, T) or (B, 1)
        if weights.shape[-1] > 1:
            log_weights = torch.where(inputs.mask.bool(), log_weights, 0.0)
        seq_log_ratio = seq_log_ratio + log_weights.sum(-1, keepdim=True)
    log_w = seq_log_ratio.clamp(log_floor, 20.0)  # (B, 1)
    non_negative = inputs.advantages >= 0
    k = torch.where(non_negative, settings.vespo_k_pos, settings.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(non_negative, settings.vespo_lambda_pos, settings.vespo_lambda_neg).to(
        log_w.dtype
    )
    lam = lam.clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    per_token_loss = -phi * inputs.advantages * inputs.logps  # (B, T)
    return per_token_loss, {"vespo/phi_seq_mean": phi}


_SURROGATES: dict[str, _Surrogate] = {
    "clipped": _surrogate_clipped,
    "cispo": _surrogate_cispo,
    "sapo": _surrogate_sapo,
    "vespo": _surrogate_vespo,
}


# ----------------------------------------------------------------------------------------------
# Aggregation over tokens (step 7): a table of functions
# ----------------------------------------------------------------------------------------------

# Each takes the per-token loss, already zero at padding, the float completion mask, both (B, T),
# and the two normalising constants, and returns a scalar.
_Aggregation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _aggregate_grpo(per_token_loss, mask, num_items_in_batch, max_completion_length):
    # GRPO: 1/|o_i| sum_t within a sequence, then the mean over sequences
    per_sequence = per_token_loss.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)  # (B,)
    return per_sequence.mean()


def _aggregate_bnpo(per_token_loss, mask, num_items_in_batch, max_completion_length):
    # mean over the tokens of this (micro-)batch
    return per_token_loss.sum() / mask.sum().clamp(min=1.0)


def _aggregate_dr_grpo(per_token_loss, mask, num_items_in_batch, max_completion_length):
    # Dr. GRPO: a constant normaliser, so long and short completions weigh the same per token
    return per_token_loss.sum() / (per_token_loss.shape[0] * max_completion_length).clamp(min=1.0)


def _aggregate_dapo(per_token_loss, mask, num_items_in_batch, max_completion_length):
    # DAPO: token-level mean over the whole global batch
    return per_token_loss.sum() / num_items_in_batch.clamp(min=1.0)


def _aggregate_luspo(per_token_loss, mask, num_items_in_batch, max_completion_length):
    # LUSPO: sum_t within a sequence (a sequence loss scaled by its length), mean over sequences
    return per_token_loss.sum(dim=-1).mean()


_AGGREGATIONS: dict[str, _Aggregation] = {
    "grpo": _aggregate_grpo,
    "bnpo": _aggregate_bnpo,
    "dr_grpo": _aggregate_dr_grpo,
    "dapo": _aggregate_dapo,
    "luspo": _aggregate_luspo,
}


class LossType(NamedTuple):
    """A `loss_type`: the name of its per-token surrogate and of its aggregation."""

    surrogate: str
    aggregation: str


# As in TRL 1.16: "cispo" and "vespo" use DAPO's global token normaliser, "sapo" GRPO's.
LOSS_TYPE_TABLE: dict[str, LossType] = {
    "grpo": LossType("clipped", "grpo"),
    "bnpo": LossType("clipped", "bnpo"),
    "dr_grpo": LossType("clipped", "dr_grpo"),
    "dapo": LossType("clipped", "dapo"),
    "cispo": LossType("cispo", "dapo"),
    "sapo": LossType("sapo", "grpo"),
    "luspo": LossType("clipped", "luspo"),
    "vespo": LossType("vespo", "dapo"),
}
LOSS_TYPES = tuple(LOSS_TYPE_TABLE)


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The hyper-parameters of `policy_loss`, fixed for a run: the trainer builds them once from
    its config (`LossSettings.from_config`). These defaults are the defaults of the matching
    `GroupRelativeConfig` fields, which read them from here (TRL's defaults).

    Args:
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            One of `LOSS_TYPES`; each names a surrogate and an aggregation (`LOSS_TYPE_TABLE`).
            Clipped surrogate with the aggregations `"grpo"` (mean per sequence, then over
            sequences), `"bnpo"` (sum / local token count), `"dr_grpo"`
            (sum / (B * max_completion_length)), `"dapo"` (sum / `num_items_in_batch`) and
            `"luspo"` (sum per sequence, then mean over sequences). `"cispo"`: clipped
            importance weight times `A log pi`, aggregated as "dapo". `"sapo"`: soft sigmoid
            gate, aggregated as "grpo". `"vespo"`: Gamma weight of the sequence ratio times
            `A log pi`, aggregated as "dapo".
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clip range: the ratio is clipped below at `1 - epsilon_low` (the config's
            `epsilon`).
        epsilon_high (`float`, *optional*):
            Upper clip range: the ratio is clipped above at `1 + epsilon_high` (DAPO's
            clip-higher uses 0.28). For `"cispo"` it is the cap of the weight itself (eps_max;
            ScaleRL recommends 5.0). None (the default) means `epsilon_low`.
        importance_sampling_level (`str`, *optional*, defaults to `"token"`):
            One of `IMPORTANCE_SAMPLING_LEVELS`. `"token"`: `rho_t = pi_theta(o_t) / pi_old(o_t)`.
            `"sequence"` (GSPO, as TRL): one ratio per sequence, `s_i = exp(mean_t log rho_t)`,
            differentiated as a whole (gradient `s_i * mean_t grad log pi_theta(o_t)`).
            `"sequence_token"` (GSPO-token; not in TRL): value `s_i` at every token, gradient
            `s_i * grad log pi_theta(o_t)`. The two sequence levels agree unless a per-token
            factor (importance weights, entropy mask, bias-corrected KL) multiplies the ratio.
        delta (`float`, *optional*):
            Two-sided clipping (clipped surrogate only): if set, the unclipped ratio is capped at
            `delta`. Should exceed `1 + epsilon_high`.
        beta (`float`, *optional*, defaults to `0.0`):
            Weight of the k3 KL penalty to the reference policy; `policy_loss` then needs
            `ref_logps`.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Multiply the per-token KL by the (differentiable) importance ratio of
            `importance_sampling_level` (DeepSeek-V3.2), so that its gradient is the unbiased
            reverse-KL gradient for tokens sampled from `pi_old`. Changes the gradient even
            on-policy, where the ratio's value is 1.
        max_completion_length (`int`, *optional*):
            For `"dr_grpo"`: the constant length normaliser. None: the padded length `T` of each
            batch (the trainer sets the config's `max_completion_length`).
        off_policy_mask_threshold (`float`, *optional*):
            If set, sequences with a negative advantage whose mean KL from the sampling policy
            exceeds it are dropped from the surrogate (`off_policy_mask`). The KL term stays.
        sapo_temperature_pos (`float`, *optional*, defaults to `1.0`):
            `"sapo"`: gate temperature for positive advantages.
        sapo_temperature_neg (`float`, *optional*, defaults to `1.05`):
            `"sapo"`: gate temperature for non-positive advantages.
        vespo_k_pos (`float`, *optional*, defaults to `2.0`):
            `"vespo"`: power k of the Gamma weight for non-negative advantages.
        vespo_lambda_pos (`float`, *optional*, defaults to `3.0`):
            `"vespo"`: decay lambda of the Gamma weight for non-negative advantages.
        vespo_k_neg (`float`, *optional*, defaults to `3.0`):
            `"vespo"`: power k for negative advantages.
        vespo_lambda_neg (`float`, *optional*, defaults to `2.0`):
            `"vespo"`: decay lambda for negative advantages.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    max_completion_length: int | None = None
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPE_TABLE:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in _LOG_RATIOS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {self.importance_sampling_level!r}"
            )
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.epsilon_high is None:  # frozen: set once, here
            object.__setattr__(self, "epsilon_high", self.epsilon_low)

    @classmethod
    def from_config(cls, args) -> LossSettings:
        """The settings of a `GroupRelativeConfig` (or any object with its field names): its
        `epsilon` is `epsilon_low`, every other field has the name it has here."""
        names = [field.name for field in fields(cls) if field.name != "epsilon_low"]
        return cls(epsilon_low=args.epsilon, **{name: getattr(args, name) for name in names})


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: LossSettings,
    *,
    ref_logps: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    sequence_mask_fn: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative policy loss: a per-token surrogate and an optional k3 KL penalty,
    aggregated over tokens, both chosen by `settings.loss_type` (TRL 1.16's `loss_type`s).

    Per token: `surrogate_t * w_t * e_t * k_i + beta * kl_k3(logps, ref_logps) * rho_t`, where
    the surrogate is `-min(rho_t A, clip(rho_t, 1 - epsilon_low, 1 + epsilon_high) A)` for the
    clipped loss types (see `LOSS_TYPE_TABLE` for the others), `w` the importance weights, `e` the
    entropy mask, `k` the off-policy sequence mask, and the factor `rho_t` on the KL only with
    `use_bias_correction_kl`. Then aggregated over tokens as `loss_type` says. Values at padding
    positions (where `completion_mask` is 0) are ignored, even if NaN or infinite.

    Args:
        logps (`torch.Tensor`):
            Log-probabilities of the completion tokens under the policy being trained, `(B, T)`.
            The loss is differentiated with respect to these.
        old_logps (`torch.Tensor` or `None`):
            Log-probabilities under the policy that generated the completions, `(B, T)`. `None`
            means on-policy: `logps.detach()` is used, so the ratio is exactly 1 but the gradient
            `A * grad log pi` still flows.
        advantages (`torch.Tensor`):
            One advantage per completion, `(B,)` (shape `(B, 1)` or `(B, T)` is also accepted).
        completion_mask (`torch.Tensor`):
            1 (or True) for completion tokens and 0 for padding, `(B, T)`.
        settings ([`LossSettings`]):
            The hyper-parameters: loss type, clip range, importance-sampling level, KL weight,
            and those of the other surrogates.
        ref_logps (`torch.Tensor`, *optional*):
            Log-probabilities under the reference policy, `(B, T)`; required when `beta > 0`.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            For the "dapo" aggregation ("dapo", "cispo", "vespo"): the number of completion tokens
            in the global batch (all micro-batches of the optimizer step, all processes).
            Defaults to the local `completion_mask` sum. With it, the losses of the micro-batches
            add up to the loss of the global batch; under DDP, which averages gradients over
            processes, the caller multiplies the loss by the number of processes.
        importance_weights (`torch.Tensor`, *optional*):
            Per-token `(B, T)` or per-sequence `(B, 1)` multiplier of the surrogate, detached
            (e.g. an off-policy correction). Not applied to the KL term. For `"vespo"` it
            multiplies the sequence ratio inside the Gamma weight instead (as TRL).
        entropy_mask (`torch.Tensor`, *optional*):
            Boolean `(B, T)` from `high_entropy_mask`: only these tokens carry the surrogate.
            The KL term and the normalisers still count every completion token (as TRL).
        sampling_logps (`torch.Tensor`, *optional*):
            Log-probabilities under the policy that sampled the tokens (e.g. the generation
            engine's), `(B, T)`, for the off-policy mask. Defaults to `old_logps`.
        sequence_mask_fn (`Callable`, *optional*, defaults to `off_policy_mask`):
            Computes the off-policy sequence mask (the trainer's `get_off_policy_mask`).

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar loss, and detached scalar
        statistics of this batch, averaged over its unmasked tokens, or over its sequences for
        values that are one per sequence (the ratio at the `"sequence"` level, the VESPO
        weight), as TRL logs them: `"ratio_mean"`; for the clipped loss types
        `"clip_ratio/low_mean"` (ratio below `1 - epsilon_low` with a negative advantage),
        `"clip_ratio/high_mean"` (ratio above `1 + epsilon_high` with a positive advantage) and
        `"clip_ratio/region_mean"` (either), `"clip_ratio/low_min"` and `"clip_ratio/high_max"`
        (the smallest and largest fraction of one sequence's tokens clipped low or high: one
        value per sequence at the `"sequence"` level); `"cispo_clip_ratio"` (ratio above `epsilon_high`
        with a positive advantage) for "cispo"; `"vespo/phi_seq_mean"` for "vespo"; and `"kl"`
        (after the bias correction) when `beta > 0`.
    """
    advantages = _checked_advantages(
        logps,
        old_logps,
        advantages,
        completion_mask,
        ref_logps=ref_logps if settings.beta > 0 else None,
        entropy_mask=entropy_mask,
        sampling_logps=sampling_logps,
        needs_ref_logps=settings.beta > 0,
    )  # (B, 1) or (B, T)
    if old_logps is None:
        old_logps = logps.detach()
    inputs = _surrogate_inputs(
        logps, old_logps, advantages, completion_mask, importance_weights, settings
    )
    per_token_loss, surrogate_stats, per_token_kl = _per_token_loss(
        inputs,
        settings,
        logps=logps,
        sampling_logps=old_logps if sampling_logps is None else sampling_logps,
        completion_mask=completion_mask,
        entropy_mask=entropy_mask,
        ref_logps=ref_logps,
        sequence_mask_fn=sequence_mask_fn or off_policy_mask,
    )
    loss = _aggregate(settings, per_token_loss, inputs.mask, num_items_in_batch)
    return loss, _statistics(surrogate_stats, inputs.ratio, per_token_kl, inputs.mask)


# The steps of `policy_loss`, in order.


def _checked_advantages(
    logps,
    old_logps,
    advantages,
    completion_mask,
    *,
    ref_logps,
    entropy_mask,
    sampling_logps,
    needs_ref_logps,
):
    """The advantages as `(B, 1)` (or `(B, T)`), after checking every input's shape against
    that of `logps`, `(B, T)`."""
    if needs_ref_logps and ref_logps is None:
        raise ValueError("ref_logps is required when beta > 0 (the KL penalty needs it)")
    if logps.dim() != 2:
        raise ValueError(f"logps must have shape (B, T), got {tuple(logps.shape)}")
    for name, tensor in (
        ("old_logps", old_logps),
        ("completion_mask", completion_mask),
        ("ref_logps", ref_logps),
        ("entropy_mask", entropy_mask),
        ("sampling_logps", sampling_logps),
    ):
        if tensor is not None and tensor.shape != logps.shape:
            raise ValueError(
                f"{name} must have the shape of logps {tuple(logps.shape)}, got {tuple(tensor.shape)}"
            )
    batch_size = logps.shape[0]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    if advantages.shape[0] != batch_size:
        raise ValueError(
            f"advantages must have shape ({batch_size},), got {tuple(advantages.shape)}"
        )
    return advantages


def _surrogate_inputs(logps, old_logps, advantages, completion_mask, importance_weights, settings):
    """Step 5: the log-probs and token log-ratios, 0 at padding, `(B, T)`, and the importance
    ratio at `settings.importance_sampling_level`, `(B, T)` or `(B, 1)`, with the other inputs
    of a surrogate in the dtype of `logps`."""
    is_token = completion_mask.bool()  # (B, T)
    mask = is_token.to(logps.dtype)  # (B, T)
    # Mask *before* exp, so that garbage at padding cannot become inf * 0 = NaN in the gradient.
    token_logps = torch.where(is_token, logps, 0.0)  # (B, T)
    log_ratio = torch.where(is_token, logps - old_logps, 0.0)  # (B, T)
    log_weight = _LOG_RATIOS[settings.importance_sampling_level](log_ratio, token_logps, mask)
    if importance_weights is not None:
        importance_weights = importance_weights.detach().to(logps.dtype)
        if importance_weights.shape[-1] > 1:  # per token: 0 at padding, whatever was there
            importance_weights = torch.where(is_token, importance_weights, 0.0)
    return SurrogateInputs(
        ratio=torch.exp(log_weight),  # (B, T) or (B, 1)
        logps=token_logps,
        log_ratio=log_ratio,
        advantages=advantages.to(logps.dtype),
        mask=mask,
        importance_weights=importance_weights,
    )


def _per_token_loss(
    inputs,
    settings,
    *,
    logps,
    sampling_logps,
    completion_mask,
    entropy_mask,
    ref_logps,
    sequence_mask_fn,
):
    """Step 6: the surrogate of `settings.loss_type` times the off-policy and entropy masks,
    plus the KL term; `(B, T)`, 0 at padding. Also returns the surrogate's statistics and the
    per-token KL (None when `beta` is 0)."""
    surrogate_name = LOSS_TYPE_TABLE[settings.loss_type].surrogate
    per_token_loss, surrogate_stats = _SURROGATES[surrogate_name](inputs, settings)
    if settings.off_policy_mask_threshold is not None:
        keep = sequence_mask_fn(
            inputs.advantages,
            logps,
            sampling_logps,
            completion_mask,
            settings.off_policy_mask_threshold,
        )
        per_token_loss = per_token_loss * keep  # (B, T) or (B, 1)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.to(logps.dtype)  # (B, T)
    is_token = completion_mask.bool()  # (B, T)
    per_token_kl = None
    if settings.beta > 0:
        per_token_kl = kl_k3(inputs.logps, torch.where(is_token, ref_logps, 0.0))  # (B, T)
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * inputs.ratio  # (B, T)
        per_token_loss = per_token_loss + settings.beta * per_token_kl
    per_token_loss = torch.where(is_token, per_token_loss, 0.0)  # (B, T)
    return per_token_loss, surrogate_stats, per_token_kl


def _aggregate(settings, per_token_loss, mask, num_items_in_batch):
    """Step 7: the scalar loss, aggregated over tokens as `settings.loss_type` says."""
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    dtype, device = mask.dtype, mask.device  # those of logps
    num_items_in_batch = torch.as_tensor(num_items_in_batch, dtype=dtype, device=device)
    max_completion_length = settings.max_completion_length
    if max_completion_length is None:
        max_completion_length = mask.shape[1]
    max_completion_length = torch.as_tensor(max_completion_length, dtype=dtype, device=device)
    aggregation_name = LOSS_TYPE_TABLE[settings.loss_type].aggregation
    return _AGGREGATIONS[aggregation_name](
        per_token_loss, mask, num_items_in_batch, max_completion_length
    )


def _statistics(surrogate_stats, ratio, per_token_kl, mask):
    """The detached scalar statistics of `policy_loss` (see its Returns)."""
    with torch.no_grad():
        stats = {
            name: _statistic(name, value.to(mask.dtype), mask)
            for name, value in surrogate_stats.items()
        }
        stats["ratio_mean"] = _statistic_mean(ratio.detach(), mask)
        if per_token_kl is not None:
            stats["kl"] = _masked_mean(per_token_kl.detach(), mask)
    return stats
