"""The group-relative policy objective, as pure tensor functions.

Everything here takes tensors and returns tensors: no Trainer, Accelerate or I/O, so each formula
can be checked by hand on three-element tensors. Notation: N = B*G completions (B prompts, G =
`group_size` completions each), F reward functions, T completion tokens, V vocabulary size.

Equations implemented (numbers refer to the steps in `DESIGN.md`):

* Step 2-3, GRPO advantage (Shao et al., 2024, "DeepSeekMath", outcome supervision):
  `A_i = (r_i - mean_group(r)) / (std_group(r) + eps)` with `r_i = sum_f w_f r_{i,f}`. Dr. GRPO
  (Liu et al., 2025, "Understanding R1-Zero-Like Training") drops the std: `scale="none"`.
  `scale="batch"` divides by the std of the whole batch instead (as TRL's `scale_rewards="batch"`).
* Step 4, per-token log-probabilities at the sampling temperature, `log softmax(z / tau)[o_t]`.
* Step 5-6, the clipped surrogate (the GRPO objective; PPO, Schulman et al., 2017):
  `-min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_k3`, with the decoupled
  clip range of DAPO (Yu et al., 2025) and the k3 KL estimator of the GRPO paper,
  `pi_ref/pi_theta - log(pi_ref/pi_theta) - 1`.
* Step 5, GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): the sequence ratio
  `s_i = exp(mean_t log(pi_theta / pi_old))`, in its GSPO-token form.
* Step 7, aggregation over tokens: "grpo" (GRPO, 1/|o_i| per sequence then mean), "bnpo"
  (mean over the tokens of the local batch), "dr_grpo" (Dr. GRPO, constant normaliser
  `B * max_completion_length`), "dapo" (DAPO, token-level mean over the global batch).

Where this differs from the papers:

* A completion for which every reward function returned "not applicable" (all NaN) is left out of
  its group's mean and std and gets advantage 0, so it neither moves the baseline nor is trained
  on. The std is the unbiased (Bessel-corrected) sample std, as `torch.std` and TRL; a group with
  fewer than two scored completions has std 0 (so all its advantages are 0; TRL returns NaN).
* The KL term is added per token *after* clipping, outside the `min`, as in GRPO (not
  folded into the reward as in PPO-RLHF). Optional `importance_weights` (e.g. a truncated
  importance-sampling correction for a generation engine that differs from the trained model)
  multiply the surrogate only, not the KL term, as TRL does.
* `delta` is TRL's two-sided clipping: for negative advantages the unclipped ratio is capped at
  `delta`, which bounds the loss of a token whose probability exploded.
* "dapo" divides by `num_items_in_batch`, the number of completion tokens in the *global* batch,
  so the sum of the losses of micro-batches equals the loss of the whole batch (exact under
  gradient accumulation). The caller supplies that count; this module never communicates.
* "Sequence" importance sampling uses the GSPO-token form
  `s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)]`: its value is `s_i` at every token and
  its gradient is `s_i * grad log pi_theta(o_t)`. Because the advantage is shared by all tokens
  of a sequence, every aggregation gives the same loss and gradient as broadcasting the sequence
  loss to its tokens (what TRL does); with per-token `importance_weights` the token form is the
  one that stays well defined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "SCALE_MODES",
    "group_advantages",
    "kl_k3",
    "policy_loss",
    "token_logprobs",
    "weighted_rewards",
]

SCALE_MODES = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


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
            (std of all N scored rewards) or `"none"` (no division, Dr. GRPO).
        eps (`float`, *optional*, defaults to `1e-4`):
            Added to the std before dividing, so a zero-variance group gives advantages 0.

    Returns:
        `torch.Tensor`:
            Advantages of shape `(N,)`.
    """
    if scale not in SCALE_MODES:
        raise ValueError(f"scale must be one of {SCALE_MODES}, got {scale!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    summed = weighted_rewards(rewards, weights)  # (N,)
    num_completions = summed.shape[0]
    if num_completions % group_size != 0:
        raise ValueError(
            f"the number of completions ({num_completions}) must be divisible by "
            f"group_size ({group_size})"
        )
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
# Log-probabilities (step 4)
# ----------------------------------------------------------------------------------------------


class _SelectiveLogSoftmax(torch.autograd.Function):
    """`log_softmax(logits / tau).gather(token_ids)` (and entropy), chunked over batch rows.

    Autograd on the plain formula would keep a full-size copy of `logits / tau` (and, for bf16,
    of its float32 upcast) alive until backward. Here forward and backward both recompute the
    softmax one chunk of rows at a time from the saved `logits`, so only one chunk-sized
    float32 buffer exists at a time; the only full-size allocation is the gradient itself.
    """

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, chunk_size, with_entropy):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        batch_size, seq_len, _ = logits.shape
        logps = logits.new_empty((batch_size, seq_len), dtype=compute_dtype)  # (B, T)
        logsumexp = torch.empty_like(logps)  # (B, T)
        entropy = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        for start in range(0, batch_size, chunk_size):
            rows = slice(start, start + chunk_size)
            scaled = logits[rows].to(compute_dtype) / temperature  # (b, T, V), chunk-sized
            chunk_lse = scaled.logsumexp(dim=-1)  # (b, T)
            chosen = scaled.gather(-1, token_ids[rows].unsqueeze(-1)).squeeze(-1)  # (b, T)
            logps[rows] = chosen - chunk_lse
            logsumexp[rows] = chunk_lse
            if with_entropy:
                # H = -sum_v p_v log p_v = logsumexp - sum_v p_v z_v
                probs = (scaled - chunk_lse.unsqueeze(-1)).exp_()  # (b, T, V)
                entropy[rows] = chunk_lse - (probs * scaled).sum(dim=-1)
        ctx.save_for_backward(logits, token_ids, logsumexp, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        logits, token_ids, logsumexp, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None
        compute_dtype = logsumexp.dtype
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logits = torch.empty_like(logits)  # (B, T, V)
        for start in range(0, logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            scaled = logits[rows].to(compute_dtype) / temperature  # (b, T, V)
            log_probs = scaled - logsumexp[rows].unsqueeze(-1)  # (b, T, V)
            probs = log_probs.exp()  # (b, T, V)
            grad = torch.zeros_like(scaled)  # (b, T, V), gradient wrt z / tau
            if grad_logps is not None:
                # d log p_k / d z_v = 1[v = k] - p_v
                chunk_grad = grad_logps[rows].unsqueeze(-1)  # (b, T, 1)
                grad -= probs * chunk_grad
                grad.scatter_add_(-1, token_ids[rows].unsqueeze(-1), chunk_grad)
            if grad_entropy is not None:
                # dH / d z_v = -p_v (log p_v + H)
                chunk_entropy = entropy[rows].unsqueeze(-1)  # (b, T, 1)
                grad -= probs * (log_probs + chunk_entropy) * grad_entropy[rows].unsqueeze(-1)
            grad_logits[rows] = grad / temperature
        return grad_logits, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 4,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each chosen token at the sampling temperature, `log softmax(z/tau)[o_t]`.

    A selective log-softmax: the log-normaliser is computed per chunk of `chunk_size` batch rows
    and the chosen logit is gathered, so no second vocabulary-sized tensor is built for the whole
    batch, in the forward or the backward pass (see `_SelectiveLogSoftmax`). bf16/fp16 logits are
    upcast to float32 one chunk at a time; the results are float32 (float64 for float64 logits).

    Args:
        logits (`torch.Tensor`):
            Logits of shape `(B, T, V)`, already aligned with `token_ids` (the logits at position
            t predict token t).
        token_ids (`torch.Tensor`):
            Chosen token ids of shape `(B, T)`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; the logits are divided by it, so that the log-probabilities are
            those of the distribution the completions were sampled from.
        chunk_size (`int`, *optional*, defaults to `4`):
            Number of batch rows processed at once. Peak extra memory is a few float32
            buffers of `chunk_size * T * V` values each.
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the entropy (in nats) of the tempered distribution at each position.

    Returns:
        `torch.Tensor` of shape `(B, T)`, or a tuple `(logps, entropy)` of two such tensors when
        `return_entropy=True`. Both are differentiable with respect to `logits`.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_ids must have shape {tuple(logits.shape[:2])} to match logits, "
            f"got {tuple(token_ids.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logps, entropy = _SelectiveLogSoftmax.apply(
        logits, token_ids.long(), float(temperature), int(chunk_size), return_entropy
    )
    return (logps, entropy) if return_entropy else logps


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


# Aggregation over tokens (step 7). Each takes the per-token loss, already zero at padding, the
# float completion mask, both (B, T), and the two normalising constants, and returns a scalar.
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


_AGGREGATIONS: dict[str, _Aggregation] = {
    "grpo": _aggregate_grpo,
    "bnpo": _aggregate_bnpo,
    "dr_grpo": _aggregate_dr_grpo,
    "dapo": _aggregate_dapo,
}
LOSS_TYPES = tuple(_AGGREGATIONS)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    max_completion_length: int | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped group-relative surrogate with an optional k3 KL penalty, aggregated by `loss_type`.

    Per token: `-min(rho_t A, clip(rho_t, 1 - epsilon_low, 1 + epsilon_high) A) * w_t
    + beta * kl_k3(logps, ref_logps)`, then aggregated over tokens as `loss_type` says. Values
    at padding positions (where `completion_mask` is 0) are ignored, even if NaN or infinite.

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
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Aggregation over tokens, one of `LOSS_TYPES`: `"grpo"` (mean per sequence, then over
            sequences), `"bnpo"` (sum / local token count), `"dr_grpo"`
            (sum / (B * max_completion_length)), `"dapo"` (sum / `num_items_in_batch`).
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clip range: the ratio is clipped below at `1 - epsilon_low`.
        epsilon_high (`float`, *optional*, defaults to `0.2`):
            Upper clip range: the ratio is clipped above at `1 + epsilon_high` (DAPO's
            clip-higher uses 0.28).
        importance_sampling_level (`str`, *optional*, defaults to `"token"`):
            `"token"`: `rho_t = pi_theta(o_t) / pi_old(o_t)`. `"sequence"` (GSPO): the
            length-normalised sequence ratio `exp(mean_t log rho_t)` at every token, with the
            GSPO-token gradient `rho_seq * grad log pi_theta(o_t)`.
        delta (`float`, *optional*):
            Two-sided clipping: if set, the unclipped ratio is capped at `delta` (so negative
            advantages cannot produce an unbounded loss). Should exceed `1 + epsilon_high`.
        ref_logps (`torch.Tensor`, *optional*):
            Log-probabilities under the reference policy, `(B, T)`; required when `beta > 0`.
        beta (`float`, *optional*, defaults to `0.0`):
            Weight of the k3 KL penalty to the reference policy.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            For `"dapo"`: the number of completion tokens in the global batch (all micro-batches
            of the optimizer step, all processes). Defaults to the local `completion_mask` sum.
            With it, the losses of the micro-batches add up to the loss of the global batch;
            under DDP, which averages gradients over processes, the caller multiplies the loss by
            the number of processes.
        max_completion_length (`int`, *optional*):
            For `"dr_grpo"`: the constant length normaliser. Defaults to `T`.
        importance_weights (`torch.Tensor`, *optional*):
            Per-token `(B, T)` or per-sequence `(B, 1)` multiplier of the surrogate, detached
            (e.g. an off-policy correction). Not applied to the KL term.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar loss, and detached scalar
        statistics averaged over the unmasked tokens of this batch: `"clip_ratio/low_mean"`
        (ratio below `1 - epsilon_low` with a negative advantage), `"clip_ratio/high_mean"` (ratio
        above `1 + epsilon_high` with a positive advantage), `"clip_ratio/region_mean"` (either),
        `"ratio_mean"`, and `"kl"` when `beta > 0`. At the sequence level every token carries its
        sequence's ratio, so these are token-weighted.
    """
    if loss_type not in _AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {importance_sampling_level!r}"
        )
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError("ref_logps is required when beta > 0 (the KL penalty needs it)")
    if logps.dim() != 2:
        raise ValueError(f"logps must have shape (B, T), got {tuple(logps.shape)}")
    for name, tensor in (
        ("old_logps", old_logps),
        ("completion_mask", completion_mask),
        ("ref_logps", ref_logps if beta > 0 else None),
    ):
        if tensor is not None and tensor.shape != logps.shape:
            raise ValueError(
                f"{name} must have the shape of logps {tuple(logps.shape)}, got {tuple(tensor.shape)}"
            )
    batch_size, seq_len = logps.shape
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    if advantages.shape[0] != batch_size:
        raise ValueError(
            f"advantages must have shape ({batch_size},), got {tuple(advantages.shape)}"
        )

    is_token = completion_mask.bool()  # (B, T)
    mask = is_token.to(logps.dtype)  # (B, T)
    advantages = advantages.to(logps.dtype)
    if old_logps is None:
        old_logps = logps.detach()

    # Mask *before* exp, so that garbage at padding cannot become inf * 0 = NaN in the gradient.
    log_ratio = torch.where(is_token, logps - old_logps, 0.0)  # (B, T)
    if importance_sampling_level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1.0
        )  # (B, 1)
        # GSPO-token: value s_i at every token, gradient s_i * grad log pi_theta(o_t)
        token_logps = torch.where(is_token, logps, 0.0)  # (B, T)
        log_ratio = token_logps - token_logps.detach() + seq_log_ratio.detach()  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)

    clipped_ratio = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped_ratio = ratio if delta is None else ratio.clamp(max=delta)
    per_token_loss = -torch.min(unclipped_ratio * advantages, clipped_ratio * advantages)  # (B, T)
    if importance_weights is not None:
        per_token_loss = per_token_loss * torch.where(is_token, importance_weights.detach(), 0.0)
    if beta > 0:
        per_token_kl = kl_k3(
            torch.where(is_token, logps, 0.0), torch.where(is_token, ref_logps, 0.0)
        )  # (B, T)
        per_token_loss = per_token_loss + beta * per_token_kl
    per_token_loss = torch.where(is_token, per_token_loss, 0.0)  # (B, T)

    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    num_items_in_batch = torch.as_tensor(num_items_in_batch, dtype=logps.dtype, device=logps.device)
    if max_completion_length is None:
        max_completion_length = seq_len
    max_completion_length = torch.as_tensor(
        max_completion_length, dtype=logps.dtype, device=logps.device
    )
    loss = _AGGREGATIONS[loss_type](per_token_loss, mask, num_items_in_batch, max_completion_length)

    with torch.no_grad():
        is_low_clipped = (ratio < 1.0 - epsilon_low) & (advantages < 0)  # (B, T)
        is_high_clipped = (ratio > 1.0 + epsilon_high) & (advantages > 0)  # (B, T)
        stats = {
            "clip_ratio/low_mean": _masked_mean(is_low_clipped.to(mask.dtype), mask),
            "clip_ratio/high_mean": _masked_mean(is_high_clipped.to(mask.dtype), mask),
            "clip_ratio/region_mean": _masked_mean(
                (is_low_clipped | is_high_clipped).to(mask.dtype), mask
            ),
            "ratio_mean": _masked_mean(ratio, mask),
        }
        if beta > 0:
            stats["kl"] = _masked_mean(per_token_kl, mask)
    return loss, stats
