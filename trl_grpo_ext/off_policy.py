r"""Importance weights for rollouts sampled by another policy than the one trained on.

A rollout sampled by a behaviour policy $\mu$ (a vLLM engine, the asynchronous rollout worker's
older weights, a `rollout_func` that returns log-probs) is trained on by the current policy
$\pi_\theta$. The clipped ratio of the objective is taken against the trainer's own policy at the
start of the step, $\pi_{old}$ (with one pass per batch, the current log-probs detached), and the
mismatch to $\mu$ is corrected by importance weights $w = \pi_{old} / \mu$ that multiply the
per-token loss. One correction, TRL's (`vllm_importance_sampling_*`), whatever sampled:

- "token_truncate": $w_t = \mathrm{clamp}(\pi_{old}(o_t) / \mu(o_t), C_{min}, C_{max})$ per token
  (truncated importance sampling);
- "token_mask": the token ratio, set to 0 outside $[C_{min}, C_{max}]$;
- "sequence_truncate": $w = \prod_t \pi_{old}(o_t) / \mu(o_t)$ per sequence, clamped;
- "sequence_mask" (TRL's default): the sequence ratio, set to 0 outside $[C_{min}, C_{max}]$
  (masked importance sampling), so a sequence the two policies disagree on is left out instead of
  dominating the batch.

Pure tensor code, like `objective.py`; the weights are detached.
"""

from __future__ import annotations

import math

import torch

# The corrections of the deprecated `off_policy_correction` field and their TRL equivalents.
DEPRECATED_CORRECTIONS = ("none", "tis", "mis")

# TRL's `vllm_importance_sampling_mode`s: (level, action). "token" weighs each token by its own
# ratio, "sequence" each completion by the product of its tokens' ratios; "truncate" clamps the
# weight into [C_min, C_max], "mask" sets it to 0 outside that range.
IMPORTANCE_SAMPLING_MODES = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


def importance_sampling_weights(
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights `pi_old / mu` in one of TRL's four modes, with the raw ratios.

    A token whose behaviour log-prob is NaN (an engine that could not score it) gets log-ratio 0,
    so it is not corrected, as in TRL.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): log-probs under the trainer's policy (detached).
        behaviour_logps (`torch.Tensor` of shape `(B, T)`): log-probs under the sampling policy.
        completion_mask (`torch.Tensor` of shape `(B, T)`): 1 on completion tokens.
        mode (`str`): one of `IMPORTANCE_SAMPLING_MODES`.
        clip_min, clip_max (`float`, *optional*): the range `[C_min, C_max]`; None is unbounded.

    Returns:
        `(weights, raw)`: both `(B, T)` for "token_*" modes and `(B, 1)` for "sequence_*" ones.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {list(IMPORTANCE_SAMPLING_MODES)}.")
    level, action = IMPORTANCE_SAMPLING_MODES[mode]
    mask = completion_mask.to(logps.dtype)
    log_ratio = ((logps.detach() - behaviour_logps) * mask).nan_to_num(0.0)  # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True)  # (B, 1)
    raw = torch.exp(log_ratio)
    if action == "truncate":
        return raw.clamp(min=clip_min, max=clip_max), raw
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return raw.masked_fill((raw < low) | (raw > high), 0.0), raw


def importance_sampling_stats(
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    weights: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """TRL's metrics of the mismatch between the engine's and the trainer's log-probs:
    `sampling/sampling_logp_difference/{mean,max}` over the completion tokens (NaN ones left
    out) and `sampling/importance_sampling_ratio/{min,mean,max}` of the weights used."""
    is_token = completion_mask.bool()
    difference = (logps.detach() - behaviour_logps).abs()[is_token]
    difference = difference[~difference.isnan()]
    if weights.shape[1] == 1:  # one weight per sequence
        used = weights.flatten()
    else:
        used = weights[is_token]
    zero = logps.new_zeros(())

    def reduce(values, function):
        return function(values) if values.numel() else zero

    return {
        "sampling/sampling_logp_difference/mean": reduce(difference, torch.mean),
        "sampling/sampling_logp_difference/max": reduce(difference, torch.max),
        "sampling/importance_sampling_ratio/min": reduce(used, torch.min),
        "sampling/importance_sampling_ratio/mean": reduce(used, torch.mean),
        "sampling/importance_sampling_ratio/max": reduce(used, torch.max),
    }


def equivalent_settings(
    correction: str, clip: float | None = None, min_weight: float | None = None
) -> dict[str, object]:
    """The `vllm_importance_sampling_*` settings that do what the deprecated
    `off_policy_correction`, `off_policy_clip` and `off_policy_min` did.

    Args:
        correction (`str`): `"tis"` (token weights `min(w, C)`), `"mis"` (sequence weights, 0
            outside `[C_min, C_max]`) or `"none"`.
        clip (`float`, *optional*, defaults to 2.0): C of "tis", C_max of "mis" (their old
            default).
        min_weight (`float`, *optional*, defaults to 0.5): C_min of "mis" (its old default).

    Returns:
        `dict` from `vllm_importance_sampling_*` field name to value: `correction` False for
        "none"; `mode` "token_truncate" with `clip_min` None and `clip_max` C for "tis";
        `mode` "sequence_mask" with `clip_min` C_min and `clip_max` C_max for "mis".
    """
    if correction not in DEPRECATED_CORRECTIONS:
        raise ValueError(
            f"off_policy_correction={correction!r} is unknown; use one of "
            f"{list(DEPRECATED_CORRECTIONS)}."
        )
    clip = 2.0 if clip is None else clip
    min_weight = 0.5 if min_weight is None else min_weight
    prefix = "vllm_importance_sampling_"
    if correction == "none":
        return {f"{prefix}correction": False}
    if correction == "tis":
        low, mode = None, "token_truncate"
    else:
        low, mode = min_weight, "sequence_mask"
    return {
        f"{prefix}correction": True,
        f"{prefix}mode": mode,
        f"{prefix}clip_min": low,
        f"{prefix}clip_max": clip,
    }


def behaviour_correction(args, logps, behaviour_logps, completion_mask):
    """The correction a `GroupRelativeConfig` asks for, applied to any rollout that carries
    behaviour log-probs (a vLLM engine, the asynchronous worker, a `rollout_func`): TRL's
    `vllm_importance_sampling_mode` in `[vllm_importance_sampling_clip_min, _clip_max]`. The
    statistics (`importance_sampling_stats`, TRL's names) are returned even with
    `vllm_importance_sampling_correction` off, which only drops the weights.

    Returns:
        `(weights or None, stats)`: weights `(B, T)` for the token modes, `(B, 1)` for the
        sequence ones.
    """
    weights, _ = importance_sampling_weights(
        logps,
        behaviour_logps,
        completion_mask,
        mode=args.vllm_importance_sampling_mode,
        clip_min=args.vllm_importance_sampling_clip_min,
        clip_max=args.vllm_importance_sampling_clip_max,
    )
    stats = importance_sampling_stats(logps, behaviour_logps, completion_mask, weights)
    return (weights if args.vllm_importance_sampling_correction else None), stats
