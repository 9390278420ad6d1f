"""Tests of the group-relative objective (`trl_grpo_ext.objective`).

Three kinds of evidence: numbers worked out by hand on tiny tensors (the arithmetic is in the
comments), slow Python-loop reference implementations written straight from the equations that the
vectorised code must match in value and gradient, and statistical checks (the k3 estimator's
Monte-Carlo mean is the exact KL, with the arguments in the right order).
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl_reference import matches_trl

from trl_grpo_ext.objective import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPE_TABLE,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_MODES,
    LossSettings,
    entropy_bonus,
    group_advantages,
    high_entropy_mask,
    kl_k3,
    off_policy_mask,
    policy_loss,
    weighted_rewards,
)

NAN = float("nan")
SETTING_NAMES = {field.name for field in dataclasses.fields(LossSettings)}


def loss_with(logps, old_logps, advantages, completion_mask, **options):
    """`policy_loss` with `options` sorted into its `LossSettings` and its per-batch tensors, so
    that each test names only what it changes from the defaults."""
    loss_settings = LossSettings(**{k: v for k, v in options.items() if k in SETTING_NAMES})
    tensors = {k: v for k, v in options.items() if k not in SETTING_NAMES}
    return policy_loss(logps, old_logps, advantages, completion_mask, loss_settings, **tensors)


# ----------------------------------------------------------------------------------------------
# Slow, obviously-correct reference implementations: one Python loop iteration per element.
# ----------------------------------------------------------------------------------------------


def _mean_std(values):
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def reference_group_advantages(
    rewards, group_size, weights, scale, eps=1e-4, aggregation="sum_then_normalize"
):
    num_rows, num_funcs = rewards.shape
    if aggregation == "normalize_then_sum":
        # each function normalised within its group first (NaN stays NaN), then summed below
        normalised = torch.full_like(rewards, NAN)
        for i in range(num_rows):
            start = (i // group_size) * group_size
            for f in range(num_funcs):
                value = rewards[i, f].item()
                if math.isnan(value):
                    continue
                group = [rewards[j, f].item() for j in range(start, start + group_size)]
                mean, std = _mean_std([g for g in group if not math.isnan(g)])
                normalised[i, f] = (value - mean) / (std + eps)
        rewards = normalised
    summed = []
    for i in range(num_rows):
        values = [weights[f] * rewards[i, f].item() for f in range(num_funcs)]
        values = [v for v in values if not math.isnan(v)]
        summed.append(sum(values) if values else None)  # None: every function said "n/a"

    batch_mean, batch_std = _mean_std([r for r in summed if r is not None])
    advantages = []
    for i, r in enumerate(summed):
        if r is None:
            advantages.append(0.0)
            continue
        if aggregation == "normalize_then_sum":  # then normalised over the whole batch
            advantages.append((r - batch_mean) / (batch_std + eps))
            continue
        start = (i // group_size) * group_size
        group = [g for g in summed[start : start + group_size] if g is not None]
        mean, group_std = _mean_std(group)
        divisor = {"group": group_std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        advantages.append((r - mean) / divisor)
    return torch.tensor(advantages, dtype=rewards.dtype)


def reference_policy_loss(
    logps,
    old_logps,
    advantages,
    completion_mask,
    loss_type,
    level,
    beta=0.0,
    ref_logps=None,
    use_bias_correction_kl=True,
    epsilon_low=0.2,
    epsilon_high=0.2,
    delta=None,
    num_items_in_batch=None,
    max_completion_length=None,
    importance_weights=None,
    entropy_mask=None,
    off_policy_mask_threshold=None,
    sampling_logps=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
):
    """Every loss type and importance-sampling level, one token at a time."""
    batch_size, seq_len = logps.shape
    token_losses = []  # per sequence: list of 0-d tensors, one per completion token
    sums = dict(low=0.0, high=0.0, ratio=0.0, kl=0.0, cispo=0.0, phi=0.0)
    per_sequence = level == "sequence"  # TRL averages one-per-sequence statistics over sequences
    sequence_low, sequence_high = [], []  # per sequence: the fraction clipped low, high
    for b in range(batch_size):
        tokens = [t for t in range(seq_len) if completion_mask[b, t]]
        low = high = 0.0
        advantage = advantages[b].item()
        # s_i = exp(1/|o_i| sum_t log(pi / pi_old)), differentiable as a whole
        seq_log_ratio = sum((logps[b, t] - old_logps[b, t] for t in tokens), torch.zeros(()))
        seq_ratio = torch.exp(seq_log_ratio / max(len(tokens), 1))
        keep = 1.0  # off-policy sequence mask: drop A < 0 with mean KL(mu || pi) > threshold
        if off_policy_mask_threshold is not None:
            sampling = old_logps if sampling_logps is None else sampling_logps
            mean_kl = sum(sampling[b, t].item() - logps[b, t].item() for t in tokens) / len(tokens)
            keep = float(advantage >= 0 or mean_kl <= off_policy_mask_threshold)
        if loss_type == "vespo":
            # phi(w) = exp(lam + k log w - lam w), w = prod_t rho_t (times the IS weights)
            log_w = sum(min(max((logps[b, t] - old_logps[b, t]).item(), -20), 20) for t in tokens)
            if importance_weights is not None:  # per token, or one per sequence
                positions = tokens if importance_weights.shape[1] > 1 else [0]
                log_w += sum(
                    min(max(math.log(importance_weights[b, t].item()), math.log(1e-8)), 20)
                    for t in positions
                )
            log_w = min(max(log_w, math.log(1e-8)), 20)
            k, lam = (
                (vespo_k_pos, vespo_lambda_pos)
                if advantage >= 0
                else (vespo_k_neg, vespo_lambda_neg)
            )
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            sums["phi"] += phi
        losses = []
        for t in tokens:
            if level == "token":
                ratio = torch.exp(logps[b, t] - old_logps[b, t])
            elif level == "sequence":
                ratio = seq_ratio
            else:  # GSPO-token: value s_i, gradient s_i * grad log pi(o_t)
                ratio = seq_ratio.detach() * torch.exp(logps[b, t] - logps[b, t].detach())
            if loss_type == "cispo":
                loss = -min(ratio.item(), epsilon_high) * advantage * logps[b, t]
            elif loss_type == "sapo":
                tau = sapo_temperature_pos if advantage > 0 else sapo_temperature_neg
                loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage
            elif loss_type == "vespo":
                loss = -phi * advantage * logps[b, t]
            else:
                clipped = min(max(ratio, 1 - epsilon_low), 1 + epsilon_high)
                unclipped = ratio if delta is None else min(ratio, delta)
                loss = -min(unclipped * advantage, clipped * advantage)
            if importance_weights is not None and loss_type != "vespo":
                loss = loss * importance_weights[b, min(t, importance_weights.shape[1] - 1)].item()
            loss = loss * keep
            if entropy_mask is not None:
                loss = loss * float(entropy_mask[b, t])
            if beta > 0:
                log_r = ref_logps[b, t] - logps[b, t]
                kl = torch.exp(log_r) - log_r - 1  # pi_ref/pi - log(pi_ref/pi) - 1
                if use_bias_correction_kl:
                    kl = kl * ratio
                loss = loss + beta * kl
                sums["kl"] += kl.item()
            losses.append(loss)
            if not per_sequence or t == tokens[0]:  # once per sequence at the sequence level
                low += float(ratio.item() < 1 - epsilon_low and advantage < 0)
                high += float(ratio.item() > 1 + epsilon_high and advantage > 0)
                sums["cispo"] += float(ratio.item() > epsilon_high and advantage > 0)
                sums["ratio"] += ratio.item()
        token_losses.append(losses)
        sums["low"] += low
        sums["high"] += high
        if per_sequence:  # one value per sequence (not clipped without tokens: its ratio is 1)
            sequence_low.append(low)
            sequence_high.append(high)
        elif tokens:  # a sequence without tokens has no fraction, as TRL's nanmin leaves it out
            sequence_low.append(low / len(tokens))
            sequence_high.append(high / len(tokens))

    num_tokens = sum(len(losses) for losses in token_losses)
    total = sum((sum(losses, torch.zeros(())) for losses in token_losses), torch.zeros(()))
    per_seq_sums = [sum(losses, torch.zeros(())) for losses in token_losses]
    aggregation = LOSS_TYPE_TABLE[loss_type].aggregation
    if aggregation == "grpo":
        per_seq = [s / max(len(losses), 1) for s, losses in zip(per_seq_sums, token_losses)]
        loss = sum(per_seq, torch.zeros(())) / batch_size
    elif aggregation == "bnpo":
        loss = total / max(num_tokens, 1)
    elif aggregation == "dr_grpo":
        loss = total / (batch_size * (max_completion_length or seq_len))
    elif aggregation == "dapo":
        loss = total / max(num_items_in_batch or num_tokens, 1)
    elif aggregation == "luspo":
        loss = sum(per_seq_sums, torch.zeros(())) / batch_size
    count = batch_size if per_sequence else max(num_tokens, 1)
    stats = {"ratio_mean": sums["ratio"] / count}
    if LOSS_TYPE_TABLE[loss_type].surrogate == "clipped":
        stats["clip_ratio/low_mean"] = sums["low"] / count
        stats["clip_ratio/high_mean"] = sums["high"] / count
        stats["clip_ratio/region_mean"] = (sums["low"] + sums["high"]) / count
        stats["clip_ratio/low_min"] = min(sequence_low) if sequence_low else NAN
        stats["clip_ratio/high_max"] = max(sequence_high) if sequence_high else NAN
    elif loss_type == "cispo":
        stats["cispo_clip_ratio"] = sums["cispo"] / count
    elif loss_type == "vespo":
        stats["vespo/phi_seq_mean"] = sums["phi"] / batch_size
    if beta > 0:
        stats["kl"] = sums["kl"] / max(num_tokens, 1)
    return loss, stats


def random_batch(seed, batch_size=5, seq_len=6, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    old_logps = -3 * torch.rand(batch_size, seq_len, generator=generator, dtype=dtype)
    # a spread of ratios around 1, per token and per sequence, so that some tokens (and, at the
    # sequence level, some sequences) are clipped
    noise = 0.3 * torch.randn(batch_size, seq_len, generator=generator, dtype=dtype)
    shift = 0.3 * torch.randn(batch_size, 1, generator=generator, dtype=dtype)
    logps = old_logps + noise + shift
    ref_logps = old_logps + 0.5 * torch.randn(batch_size, seq_len, generator=generator, dtype=dtype)
    advantages = torch.randn(batch_size, generator=generator, dtype=dtype)
    lengths = torch.randint(1, seq_len + 1, (batch_size,), generator=generator)
    lengths[0] = 1  # a completion of a single token
    lengths[1] = seq_len  # and one with no padding
    completion_mask = (torch.arange(seq_len) < lengths.unsqueeze(-1)).long()  # (B, T)
    importance_weights = 0.5 + torch.rand(batch_size, seq_len, generator=generator, dtype=dtype)
    return logps, old_logps, ref_logps, advantages, completion_mask, importance_weights


def random_extras(seed, batch_size=5, seq_len=6, dtype=torch.float64):
    """Entropies and sampling-engine log-probabilities for the batch of `random_batch(seed)`."""
    logps, _, _, advantages, _, _ = random_batch(seed, batch_size, seq_len, dtype)
    generator = torch.Generator().manual_seed(seed + 1000)
    entropy = 3 * torch.rand(batch_size, seq_len, generator=generator, dtype=dtype)
    # the sampling engine is 0.6 nats per token off for alternate negative-advantage sequences
    # (the off-policy mask drops these at threshold 0.1) and closer for the others
    offset = 0.6 * torch.rand(batch_size, 1, generator=generator, dtype=dtype) - 0.3
    negative = (advantages < 0).nonzero().flatten()
    offset[negative[0::2]] = 0.6
    offset[negative[1::2]] = -0.6
    noise = 0.1 * torch.randn(batch_size, seq_len, generator=generator, dtype=dtype)
    return entropy, logps + offset + noise


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------

# Two groups of three, two reward functions with weights (1, 0.5):
#   row 0: 1 + 0.5*2 = 2     row 3: 3 + 0.5*0 = 3
#   row 1: 0 + (n/a) = 0     row 4: 1 + 0.5*0 = 1
#   row 2: all n/a -> absent row 5: 2 + 0.5*2 = 3
HAND_REWARDS = torch.tensor(
    [[1.0, 2.0], [0.0, NAN], [NAN, NAN], [3.0, 0.0], [1.0, 0.0], [2.0, 2.0]], dtype=torch.float64
)
HAND_WEIGHTS = [1.0, 0.5]
# group 0 = {2, 0}: mean 1, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
# group 1 = {3, 1, 3}: mean 7/3, deviations (2/3, -4/3, 2/3), var (4 + 16 + 4) / 9 / 2 = 4/3
HAND_CENTRED = [1.0, -1.0, 0.0, 2 / 3, -4 / 3, 2 / 3]
# batch = {2, 0, 3, 1, 3}: mean 1.8, squared deviations .04 + 3.24 + 1.44 + .64 + 1.44 = 6.8
BATCH_STD = math.sqrt(6.8 / 4)


def test_weighted_rewards_skips_nan_and_keeps_all_nan_rows_nan():
    summed = weighted_rewards(HAND_REWARDS, HAND_WEIGHTS)
    expected = torch.tensor([2.0, 0.0, NAN, 3.0, 1.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(summed, expected, equal_nan=True)
    # default weights are ones: row 0 is 1 + 2
    assert weighted_rewards(HAND_REWARDS)[0].item() == 3.0


def test_group_advantages_by_hand_for_each_scale():
    eps = 1e-4
    centred = torch.tensor(HAND_CENTRED, dtype=torch.float64)
    none = group_advantages(HAND_REWARDS, 3, HAND_WEIGHTS, scale="none")
    torch.testing.assert_close(none, centred)

    group_std = torch.tensor([math.sqrt(2)] * 3 + [math.sqrt(4 / 3)] * 3, dtype=torch.float64)
    expected_group = centred / (group_std + eps)
    expected_group[2] = 0.0  # the all-n/a completion
    torch.testing.assert_close(
        group_advantages(HAND_REWARDS, 3, HAND_WEIGHTS, scale="group"), expected_group
    )
    torch.testing.assert_close(
        group_advantages(HAND_REWARDS, 3, HAND_WEIGHTS, scale="batch"), centred / (BATCH_STD + eps)
    )


def test_all_nan_row_does_not_pollute_its_group():
    # The absent row must give the same advantages to the others as if the group had two rows.
    with_absent = group_advantages(HAND_REWARDS[:3], 3, HAND_WEIGHTS)
    without = group_advantages(HAND_REWARDS[:2], 2, HAND_WEIGHTS)
    torch.testing.assert_close(with_absent[:2], without)
    assert with_absent[2].item() == 0.0


def test_zero_variance_group_gives_zero_advantages():
    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.0], [1.0], [NAN]])
    for scale in SCALE_MODES:
        advantages = group_advantages(rewards, 3, scale=scale)
        assert torch.equal(advantages[:3], torch.zeros(3)), scale


def test_single_scored_completion_in_a_group_gets_zero():
    assert torch.equal(group_advantages(torch.tensor([[2.0], [NAN]]), 2), torch.zeros(2))


@pytest.mark.parametrize("scale", SCALE_MODES)
def test_group_advantages_match_loop_reference(scale):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 3, generator=generator, dtype=torch.float64)
    rewards[torch.rand(12, 3, generator=generator) < 0.3] = NAN
    rewards[5] = NAN  # one completion no reward function applies to
    weights = [1.0, 0.5, 2.0]
    torch.testing.assert_close(
        group_advantages(rewards, 4, weights, scale=scale),
        reference_group_advantages(rewards, 4, weights, scale),
    )


def test_leave_one_out_identity():
    # r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r)): the unscaled GRPO advantage is a
    # rescaled leave-one-out (RLOO) baseline.
    group_size = 4
    rewards = torch.randn(12, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    advantages = group_advantages(rewards, group_size, scale="none")
    for i in range(12):
        start = (i // group_size) * group_size
        others = [rewards[j, 0].item() for j in range(start, start + group_size) if j != i]
        leave_one_out = rewards[i, 0].item() - sum(others) / len(others)
        assert leave_one_out == pytest.approx(group_size / (group_size - 1) * advantages[i].item())


def test_group_advantages_validation():
    rewards = torch.ones(6, 2)
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(rewards, 4)
    with pytest.raises(ValueError, match="one entry per reward function"):
        group_advantages(rewards, 3, weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        group_advantages(rewards, 3, scale="std")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, 0)


# ----------------------------------------------------------------------------------------------
# kl_k3
# ----------------------------------------------------------------------------------------------


def test_kl_k3_by_hand():
    # pi_ref / pi = 2: 2 - log 2 - 1 = 0.30685...; equal log-probs: 0
    kl = kl_k3(torch.tensor([0.0, -1.0]), torch.tensor([math.log(2), -1.0]))
    torch.testing.assert_close(kl, torch.tensor([1 - math.log(2), 0.0]))


def test_kl_k3_non_negative_on_random_inputs():
    generator = torch.Generator().manual_seed(5)
    logps = -10 * torch.rand(10_000, generator=generator)
    ref_logps = -10 * torch.rand(10_000, generator=generator)
    assert (kl_k3(logps, ref_logps) >= 0).all()
    assert (kl_k3(logps, logps + 1e-7 * torch.randn(10_000, generator=generator)) >= 0).all()


@settings(deadline=None, max_examples=200)
@given(
    st.floats(min_value=-40, max_value=0, width=32),
    st.floats(min_value=-40, max_value=0, width=32),
)
def test_kl_k3_non_negative_property(logp, ref_logp):
    for dtype in (torch.float32, torch.float64):
        assert kl_k3(torch.tensor(logp, dtype=dtype), torch.tensor(ref_logp, dtype=dtype)) >= 0


def test_kl_k3_monte_carlo_mean_is_kl_of_policy_from_reference():
    # The published bug: passing (ref, logp) instead of (logp, ref). For x ~ pi, only
    # E[kl_k3(log pi(x), log ref(x))] equals KL(pi || ref) = sum_x pi(x) log(pi(x) / ref(x)).
    pi = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = (pi * (pi.log() - ref.log())).sum().item()  # 0.1783
    samples = torch.multinomial(
        pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(6)
    )
    estimate = kl_k3(pi.log()[samples], ref.log()[samples]).mean().item()
    assert estimate == pytest.approx(exact, abs=3e-3)  # standard error is about 4e-4
    swapped = kl_k3(ref.log()[samples], pi.log()[samples]).mean().item()  # about 0.2017
    assert abs(swapped - exact) > 0.015


# ----------------------------------------------------------------------------------------------
# policy_loss: by hand
# ----------------------------------------------------------------------------------------------

# Two sequences, ratios (1, 1.5, 0.5) against old log-probs 0, eps = 0.2 (clip range [0.8, 1.2]).
# Sequence 0 has A = +1 and three tokens: -min(r, clip(r)) = -1, -min(1.5, 1.2), -min(0.5, 0.8)
#   = -1, -1.2, -0.5, sum -2.7.
# Sequence 1 has A = -1 and two tokens (third is padding): -min(-r, -clip(r)) = max(r, clip(r))
#   = 1, max(1.5, 1.2) = 1.5, sum 2.5.
HAND_LOGPS = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))
HAND_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
HAND_ADVANTAGES = torch.tensor([1.0, -1.0])
HAND_LOSSES = {
    "grpo": (-2.7 / 3 + 2.5 / 2) / 2,  # = (-0.9 + 1.25) / 2 = 0.175
    "bnpo": (-2.7 + 2.5) / 5,  # = -0.04
    "dr_grpo": (-2.7 + 2.5) / (2 * 3),  # B * T, T standing in for max_completion_length
    "dapo": (-2.7 + 2.5) / 5,  # the local token count standing in for the global one
    "luspo": (-2.7 + 2.5) / 2,  # sum per sequence, mean over the 2 sequences = -0.1
}


@pytest.mark.parametrize(
    "loss_type", [n for n, t in LOSS_TYPE_TABLE.items() if t.surrogate == "clipped"]
)
def test_policy_loss_by_hand(loss_type):
    loss, stats = loss_with(
        HAND_LOGPS, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK, loss_type=loss_type
    )
    assert loss.item() == pytest.approx(HAND_LOSSES[loss_type], abs=1e-6)
    # of the 5 tokens, only (seq 0, ratio 1.5, A > 0) is clipped; (seq 1, ratio 0.5) is padding
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert stats["clip_ratio/low_mean"].item() == 0.0
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(1 / 5)
    assert stats["ratio_mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 1 + 1.5) / 5)
    assert "kl" not in stats and all(not v.requires_grad for v in stats.values())


def test_clip_ratio_extremes_are_over_sequences_by_hand():
    """TRL's `clip_ratio/low_min` and `/high_max`: the fraction of each sequence's tokens
    clipped, then the smallest and largest over sequences; a sequence without tokens is left
    out (TRL's nanmin of 0 / 0)."""
    logps = torch.log(torch.tensor([[0.5, 1.0], [0.5, 0.5], [1.0, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    advantages = torch.tensor([-1.0, -1.0, -1.0])
    _, stats = loss_with(logps, torch.zeros(3, 2), advantages, mask, loss_type="grpo")
    # ratio 0.5 < 0.8 with A < 0 is clipped low: 1 of 2 tokens, then 1 of 1
    assert stats["clip_ratio/low_min"].item() == 0.5
    assert stats["clip_ratio/high_max"].item() == 0.0
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(2 / 3)


def test_policy_loss_normalisers_by_hand():
    args = (HAND_LOGPS, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK)
    dr_grpo, _ = loss_with(*args, loss_type="dr_grpo", max_completion_length=4)
    assert dr_grpo.item() == pytest.approx(-0.2 / (2 * 4))
    dapo, _ = loss_with(*args, loss_type="dapo", num_items_in_batch=torch.tensor(10))
    assert dapo.item() == pytest.approx(-0.2 / 10)


def test_ratio_of_e_is_clipped_to_one_plus_epsilon_high():
    # torchtune's check: log-ratio 1, A = 1 -> -min(e, 1.28) = -1.28 with DAPO's clip-higher
    loss, stats = loss_with(
        torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), epsilon_high=0.28
    )
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_ratio/high_mean"].item() == 1.0


def _token_gradients(advantage, ratios, **kwargs):
    logps = torch.log(torch.tensor([ratios])).requires_grad_()
    loss, _ = loss_with(
        logps,
        torch.zeros(1, 3),
        torch.tensor([advantage]),
        torch.ones(1, 3),
        loss_type="bnpo",
        **kwargs,
    )
    loss.backward()
    return loss.item(), logps.grad[0]


def test_clip_boundaries_stop_the_gradient():
    # A > 0, ratios (1.5, 0.5, 1): the 1.5 token is above 1 + eps_high -> zero gradient; the others
    # follow d(-r A / 3)/d log r = -r / 3.
    _, grad = _token_gradients(1.0, [1.5, 0.5, 1.0])
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5 / 3, -1 / 3]))
    # A < 0: the 0.5 token is below 1 - eps_low -> zero gradient; d(r / 3)/d log r = r / 3.
    _, grad = _token_gradients(-1.0, [1.5, 0.5, 1.0])
    torch.testing.assert_close(grad, torch.tensor([1.5 / 3, 0.0, 1 / 3]))
    # Inside the clip range the gradient is never zero, whatever the sign of A.
    for advantage in (1.0, -1.0):
        _, grad = _token_gradients(advantage, [0.9, 1.0, 1.1])
        assert (grad != 0).all()


def test_delta_caps_the_ratio_for_negative_advantages():
    # A = -1, ratio 3: without delta the loss is max(3, 1.2) = 3 with gradient 3 / 3 per token;
    # with delta = 2 it is max(2, 1.2) = 2 and the token stops contributing gradient.
    loss, grad = _token_gradients(-1.0, [3.0, 1.0, 1.0])
    assert loss == pytest.approx((3 + 1 + 1) / 3) and grad[0].item() == pytest.approx(1.0)
    loss, grad = _token_gradients(-1.0, [3.0, 1.0, 1.0], delta=2.0)
    assert loss == pytest.approx((2 + 1 + 1) / 3) and grad[0].item() == 0.0


def test_sequence_level_ratio_by_hand():
    # log-ratios (log 2, 0, 0): token level clips only the first token; the sequence ratio
    # 2^(1/3) = 1.26 > 1.2 clips the whole sequence when A > 0.
    logps = torch.tensor([[math.log(2), 0.0, 0.0]], requires_grad=True)
    args = (torch.zeros(1, 3), torch.ones(1), torch.ones(1, 3))
    loss, stats = loss_with(logps, *args, loss_type="bnpo", importance_sampling_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert stats["ratio_mean"].item() == pytest.approx(2 ** (1 / 3))
    assert stats["clip_ratio/high_mean"].item() == 1.0
    assert torch.equal(logps.grad, torch.zeros(1, 3))
    # A < 0: max(1.26, 1.2) = 1.26 per token; GSPO-token gradient s / 3 on every token
    logps.grad = None
    loss, _ = loss_with(
        logps, args[0], -args[1], args[2], loss_type="bnpo", importance_sampling_level="sequence"
    )
    loss.backward()
    assert loss.item() == pytest.approx(2 ** (1 / 3))
    torch.testing.assert_close(logps.grad, torch.full((1, 3), 2 ** (1 / 3) / 3))


def test_kl_term_by_hand():
    # On-policy (ratio 1), A = 0, pi_ref / pi = 2 on the one token: loss = beta * (2 - log 2 - 1)
    loss, stats = loss_with(
        torch.zeros(1, 1),
        None,
        torch.zeros(1),
        torch.ones(1, 1),
        ref_logps=torch.full((1, 1), math.log(2)),
        beta=0.1,
    )
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert stats["kl"].item() == pytest.approx(1 - math.log(2))


def test_on_policy_old_logps_none_has_ratio_one_and_policy_gradient():
    # ratio exactly 1, loss -A per token, gradient -A / num_tokens per token (bnpo)
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    loss, stats = loss_with(logps, None, advantages, torch.ones(2, 2), loss_type="bnpo")
    loss.backward()
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    assert stats["ratio_mean"].item() == 1.0
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))


def test_cispo_by_hand():
    # CISPO with the cap eps_max = epsilon_high = 1.2: weights sg[min(r, 1.2)] = (1, 1.2, 0.5) and
    # (1, 1.2); loss per token -w A log pi, log pi = log r:
    #   seq 0 (A = +1): -(1 * 0) - 1.2 log 1.5 - 0.5 log 0.5
    #   seq 1 (A = -1): +(1 * 0) + 1.2 log 1.5
    #   sum = -0.5 log 0.5 = 0.5 log 2, "dapo" normaliser 5 tokens -> 0.1 log 2 = 0.0693
    logps = HAND_LOGPS.clone().requires_grad_()
    loss, stats = loss_with(
        logps, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK, loss_type="cispo", epsilon_high=1.2
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * math.log(2))
    # gradient -w A / 5 per token; it never vanishes, even for the capped 1.5 token
    expected = torch.tensor([[-1.0, -1.2, -0.5], [1.0, 1.2, 0.0]]) / 5
    torch.testing.assert_close(logps.grad, expected)
    # ratio above the cap with A > 0: only (seq 0, 1.5), 1 of 5 tokens
    assert stats["cispo_clip_ratio"].item() == pytest.approx(1 / 5)
    assert "clip_ratio/high_mean" not in stats


def test_sapo_by_hand():
    # SAPO, -sigmoid(tau (r - 1)) * 4 / tau * A, aggregated as "grpo":
    #   seq 0 (A = +1, tau_pos = 1): -4 (sigmoid(0) + sigmoid(0.5) + sigmoid(-0.5)) = -4 * 1.5
    #     (sigmoid(x) + sigmoid(-x) = 1), mean over 3 tokens -> -2
    #   seq 1 (A = -1, tau_neg = 1.05): (4 / 1.05) (sigmoid(0) + sigmoid(0.525))
    #     = 1.904762 + 2.393585, mean over 2 tokens -> 2.149174
    #   loss = (-2 + 2.149174) / 2 = 0.074587
    loss, stats = loss_with(
        HAND_LOGPS, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK, loss_type="sapo"
    )
    assert loss.item() == pytest.approx(0.0745868, abs=1e-6)
    assert set(stats) == {"ratio_mean"}
    # at ratio 1 the soft gate has the policy gradient of the clipped surrogate: d/dr = A
    logps = torch.zeros(1, 2, requires_grad=True)
    loss, _ = loss_with(logps, None, torch.tensor([3.0]), torch.ones(1, 2), loss_type="sapo")
    loss.backward()
    assert loss.item() == pytest.approx(-2 * 3.0)  # -sigmoid(0) * 4 * A
    torch.testing.assert_close(logps.grad, torch.full((1, 2), -3.0 / 2))


def test_vespo_by_hand():
    # VESPO: phi(w) = e^lam w^k e^(-lam w) of the *unnormalised* sequence ratio w = prod_t r_t:
    #   seq 0: w = 1 * 1.5 * 0.5 = 0.75, A >= 0 -> k = 2, lam = 3:
    #     phi = e^3 0.75^2 e^-2.25 = 0.5625 e^0.75 = 1.190813
    #   seq 1: w = 1 * 1.5 = 1.5, A < 0 -> k = 3, lam = 2: phi = e^2 3.375 e^-3 = 3.375 / e = 1.241593
    #   loss -phi A sum_t log pi: seq 0: -1.190813 log 0.75 = 0.342576,
    #   seq 1: +1.241593 log 1.5 = 0.503423; "dapo": (0.342576 + 0.503423) / 5 = 0.169200
    logps = HAND_LOGPS.clone().requires_grad_()
    loss, stats = loss_with(logps, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK, loss_type="vespo")
    loss.backward()
    phi = (0.5625 * math.exp(0.75), 3.375 / math.e)
    assert loss.item() == pytest.approx(0.1691996, abs=1e-6)
    # phi is a constant weight: gradient -phi A / 5 on every token of the sequence
    expected = torch.tensor([[-phi[0]] * 3, [phi[1], phi[1], 0.0]]) / 5
    torch.testing.assert_close(logps.grad, expected.float())
    assert stats["vespo/phi_seq_mean"].item() == pytest.approx(sum(phi) / 2)
    # phi(1) = 1: on-policy, VESPO is the plain policy gradient -A log pi / tokens
    loss, _ = loss_with(
        torch.full((1, 2), -1.0), None, torch.ones(1), torch.ones(1, 2), loss_type="vespo"
    )
    assert loss.item() == pytest.approx(1.0)
    # a per-sequence importance weight of 2 enters w, not the loss: seq 0 gets w = 1.5 and
    # phi = e^3 1.5^2 e^-4.5 = 2.25 e^-1.5
    loss, stats = loss_with(
        HAND_LOGPS,
        torch.zeros(2, 3),
        HAND_ADVANTAGES,
        HAND_MASK,
        loss_type="vespo",
        importance_weights=torch.tensor([[2.0], [1.0]]),
    )
    assert stats["vespo/phi_seq_mean"].item() == pytest.approx((2.25 * math.exp(-1.5) + phi[1]) / 2)


def test_sequence_and_sequence_token_differ_only_under_a_per_token_factor():
    # log-ratios (log 2, 0, 0), A = -1: s = 2^(1/3) = 1.26, unclipped (max(s, 1.2) = s).
    # With an entropy mask keeping token 0 only ("bnpo", 3 tokens): loss = s / 3 for both levels.
    # "sequence" (TRL): s is differentiated as a whole, d s / d log pi_t = s / 3 on every token,
    #   so the gradient is s / 9 everywhere. "sequence_token": s * grad log pi_0 / 3 on token 0 only.
    s = 2 ** (1 / 3)
    grads = {}
    for level in ("sequence", "sequence_token"):
        logps = torch.tensor([[math.log(2), 0.0, 0.0]], requires_grad=True)
        loss, _ = loss_with(
            logps,
            torch.zeros(1, 3),
            -torch.ones(1),
            torch.ones(1, 3),
            loss_type="bnpo",
            importance_sampling_level=level,
            entropy_mask=torch.tensor([[True, False, False]]),
        )
        loss.backward()
        assert loss.item() == pytest.approx(s / 3)
        grads[level] = logps.grad
    torch.testing.assert_close(grads["sequence"], torch.full((1, 3), s / 9))
    torch.testing.assert_close(grads["sequence_token"], torch.tensor([[s / 3, 0.0, 0.0]]))


def test_bias_corrected_kl_by_hand():
    # One token, log pi_old = 0, log pi = x = log 2 (ratio 2), log pi_ref = 0, A = 0:
    #   k3 = pi_ref / pi - log(pi_ref / pi) - 1 = 0.5 + log 2 - 1 = 0.193147
    #   corrected: r * k3 = 2 * 0.193147, and d/dx [e^x (e^-x + x - 1)] = x e^x = 2 log 2
    #   uncorrected: k3, d/dx [e^-x + x - 1] = 1 - e^-x = 0.5
    k3 = 0.5 + math.log(2) - 1
    for corrected, value, grad in ((True, 2 * k3, 2 * math.log(2)), (False, k3, 0.5)):
        logps = torch.full((1, 1), math.log(2), requires_grad=True)
        loss, stats = loss_with(
            logps,
            torch.zeros(1, 1),
            torch.zeros(1),
            torch.ones(1, 1),
            ref_logps=torch.zeros(1, 1),
            beta=0.1,
            use_bias_correction_kl=corrected,
        )
        loss.backward()
        assert loss.item() == pytest.approx(0.1 * value)
        assert stats["kl"].item() == pytest.approx(value)  # logged after the correction, as TRL
        assert logps.grad.item() == pytest.approx(0.1 * grad)
    # on-policy the ratio's value is 1 but its gradient is not: 0.5 + k3 instead of 0.5
    logps = torch.full((1, 1), math.log(2), requires_grad=True)
    loss, _ = loss_with(
        logps, None, torch.zeros(1), torch.ones(1, 1), ref_logps=torch.zeros(1, 1), beta=0.1
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * k3)
    assert logps.grad.item() == pytest.approx(0.1 * (0.5 + k3))


HAND_ENTROPY = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 5.0]])  # 5.0 sits on padding


def test_high_entropy_mask_by_hand():
    # completion-token entropies sorted: 0.1, 0.3, 0.5, 0.7, 0.9. rho = 0.4 keeps those at or
    # above the 0.6-quantile: position 0.6 * 4 = 2.4 -> 0.5 + 0.4 * (0.7 - 0.5) = 0.58 -> 0.9, 0.7
    mask = high_entropy_mask(HAND_ENTROPY, HAND_MASK, 0.4)
    assert mask.tolist() == [[False, True, False], [False, True, False]]
    # rho = 0: only the highest; rho = 1: every completion token; padding never, whatever entropy
    assert high_entropy_mask(HAND_ENTROPY, HAND_MASK, 0.0).tolist() == [
        [False, True, False],
        [False, False, False],
    ]
    assert torch.equal(high_entropy_mask(HAND_ENTROPY, HAND_MASK, 1.0), HAND_MASK.bool())
    # the quantile may come from a pool of other processes' tokens too: threshold of
    # (0.1, 0.3, 0.5, 0.7, 0.9, 10, 10, 10) at 0.6 -> position 4.2 -> 0.9 + 0.2 * 9.1 = 2.72
    pooled = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 10.0, 10.0, 10.0])
    assert not high_entropy_mask(HAND_ENTROPY, HAND_MASK, 0.4, pooled_entropy=pooled).any()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_mask(HAND_ENTROPY, HAND_MASK, 1.5)


def test_entropy_mask_in_policy_loss_by_hand():
    # keep (seq 0, token 1) and (seq 1, token 1): losses -1.2 and 1.5 (see HAND_LOSSES), the
    # "bnpo" normaliser still counts all 5 tokens: (-1.2 + 1.5) / 5 = 0.06
    entropy_mask = high_entropy_mask(HAND_ENTROPY, HAND_MASK, 0.4)
    loss, _ = loss_with(
        HAND_LOGPS,
        torch.zeros(2, 3),
        HAND_ADVANTAGES,
        HAND_MASK,
        loss_type="bnpo",
        entropy_mask=entropy_mask,
    )
    assert loss.item() == pytest.approx(0.06)
    # the KL term is not masked: with A = 0 the loss is beta * mean k3 over all 5 tokens
    ref_logps = torch.zeros(2, 3)
    kwargs = dict(loss_type="bnpo", ref_logps=ref_logps, beta=0.1, use_bias_correction_kl=False)
    masked, _ = loss_with(
        HAND_LOGPS, None, torch.zeros(2), HAND_MASK, entropy_mask=entropy_mask, **kwargs
    )
    unmasked, _ = loss_with(HAND_LOGPS, None, torch.zeros(2), HAND_MASK, **kwargs)
    assert masked.item() == pytest.approx(unmasked.item()) and masked.item() > 0


def test_entropy_bonus_by_hand():
    # mean over completion tokens: (0.1 + 0.9 + 0.5 + 0.3 + 0.7) / 5 = 0.5; over the kept high-
    # entropy tokens only: (0.9 + 0.7) / 2 = 0.8
    assert entropy_bonus(HAND_ENTROPY, HAND_MASK).item() == pytest.approx(0.5)
    entropy_mask = high_entropy_mask(HAND_ENTROPY, HAND_MASK, 0.4)
    assert entropy_bonus(HAND_ENTROPY, HAND_MASK, entropy_mask).item() == pytest.approx(0.8)


def test_off_policy_mask_by_hand():
    # sampling log-probs (0, 0, 0) and (1, 1, pad): mean KL(mu || pi) per sequence
    #   seq 0: (0 - 0) + (0 - log 1.5) + (0 - log 0.5) over 3 = log(1/0.75) / 3 = 0.0959
    #   seq 1: (1 - 0) + (1 - log 1.5) over 2 = (2 - 0.405) / 2 = 0.797
    # with threshold 0.5, seq 1 (A < 0, KL 0.797) is dropped; seq 0 would be kept anyway (A > 0)
    sampling = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, NAN]])
    keep = off_policy_mask(HAND_ADVANTAGES, HAND_LOGPS, sampling, HAND_MASK, 0.5)
    assert keep.tolist() == [[1.0], [0.0]]
    assert off_policy_mask(HAND_ADVANTAGES, HAND_LOGPS, sampling, HAND_MASK, 0.8).tolist() == [
        [1.0],
        [1.0],
    ]
    # a NaN the engine could not score counts as 0 KL, not as "drop": with A = (-1, +1) and
    # threshold 0.1, seq 0 (KL 0.0959) is kept, and so is seq 1 (KL (0 - log 1.5) / 2 = -0.2)
    nan_sampling = torch.tensor([[0.0, 0.0, 0.0], [NAN, 0.0, 0.0]])
    assert off_policy_mask(-HAND_ADVANTAGES, HAND_LOGPS, nan_sampling, HAND_MASK, 0.1).tolist() == [
        [1.0],
        [1.0],
    ]
    # in the loss: "bnpo" keeps only seq 0's -2.7, still over 5 tokens
    loss, _ = loss_with(
        HAND_LOGPS,
        torch.zeros(2, 3),
        HAND_ADVANTAGES,
        HAND_MASK,
        loss_type="bnpo",
        off_policy_mask_threshold=0.5,
        sampling_logps=sampling,
    )
    assert loss.item() == pytest.approx(-2.7 / 5)


def test_normalize_then_sum_by_hand():
    # HAND_REWARDS, groups of 3, weights (1, 0.5); every function normalised in its group first:
    #   f0, group 0: (1, 0, n/a): mean 0.5, std sqrt(0.5) -> +-0.5 / (sqrt(0.5) + eps)
    #   f0, group 1: (3, 1, 2):   mean 2, std 1 -> (1, -1, 0) / (1 + eps)
    #   f1, group 0: (2, n/a, n/a): a single value -> std 0 -> 0
    #   f1, group 1: (0, 0, 2): mean 2/3, std sqrt(4/3) -> (-2/3, -2/3, 4/3) / (sqrt(4/3) + eps)
    # summed r = z0 + 0.5 z1; row 2 has no reward at all and gets 0. Then the batch: the five
    # r have mean m and std s (computed below), A = (r - m) / (s + eps).
    eps = 1e-4
    z0 = [0.5 / (math.sqrt(0.5) + eps), -0.5 / (math.sqrt(0.5) + eps)]
    z0 += [v / (1 + eps) for v in (1.0, -1.0, 0.0)]
    z1 = [0.0, 0.0] + [v / (math.sqrt(4 / 3) + eps) for v in (-2 / 3, -2 / 3, 4 / 3)]
    summed = [a + 0.5 * b for a, b in zip(z0, z1)]  # rows 0, 1, 3, 4, 5
    mean = sum(summed) / 5
    std = math.sqrt(sum((r - mean) ** 2 for r in summed) / 4)
    expected = [(r - mean) / (std + eps) for r in summed]
    expected.insert(2, 0.0)
    for scale in SCALE_MODES:  # scale_rewards does not enter (as TRL)
        advantages = group_advantages(
            HAND_REWARDS,
            3,
            HAND_WEIGHTS,
            scale=scale,
            multi_objective_aggregation="normalize_then_sum",
        )
        torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    # one reward function: z has unit std per group, so only the batch step changes the scale
    single = torch.tensor([[1.0], [0.0], [3.0], [5.0]], dtype=torch.float64)
    by_group = group_advantages(single, 2)  # (0.707, -0.707, -0.707, 0.707)
    normalised = group_advantages(single, 2, multi_objective_aggregation="normalize_then_sum")
    torch.testing.assert_close(normalised, by_group / by_group.std(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("aggregation", MULTI_OBJECTIVE_AGGREGATIONS)
@pytest.mark.parametrize("scale", SCALE_MODES)
def test_multi_objective_aggregation_matches_loop_reference(aggregation, scale):
    generator = torch.Generator().manual_seed(11)
    rewards = torch.randn(12, 3, generator=generator, dtype=torch.float64)
    rewards[torch.rand(12, 3, generator=generator) < 0.3] = NAN
    rewards[5] = NAN  # one completion no reward function applies to
    rewards[8:12, 1] = NAN  # a function that applies to no completion of the last group
    weights = [1.0, 0.5, 2.0]
    torch.testing.assert_close(
        group_advantages(rewards, 4, weights, scale=scale, multi_objective_aggregation=aggregation),
        reference_group_advantages(rewards, 4, weights, scale, aggregation=aggregation),
    )


# ----------------------------------------------------------------------------------------------
# policy_loss: against the loop reference
# ----------------------------------------------------------------------------------------------


EXTRAS = ("plain", "weights+delta", "masks", "sequence-weights")


@pytest.mark.parametrize("extras", EXTRAS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_matches_loop_reference(loss_type, level, beta, extras):
    seed = (
        LOSS_TYPES.index(loss_type) * 100
        + IMPORTANCE_SAMPLING_LEVELS.index(level) * 10
        + EXTRAS.index(extras)
    )
    logps, old_logps, ref_logps, advantages, completion_mask, weights = random_batch(seed, 8)
    entropy, sampling_logps = random_extras(seed, 8)
    kwargs = dict(
        beta=beta,
        ref_logps=ref_logps,
        num_items_in_batch=int(completion_mask.sum()) + 7,  # more tokens on other micro-batches
        max_completion_length=9,
        epsilon_high=0.28 if loss_type != "cispo" else 1.1,  # CISPO's epsilon_high is the cap
    )
    if extras == "weights+delta":
        kwargs.update(importance_weights=weights, delta=1.5)
    elif extras == "masks":
        kwargs.update(
            entropy_mask=high_entropy_mask(entropy, completion_mask, 0.5),
            off_policy_mask_threshold=0.1,
            sampling_logps=sampling_logps,
            use_bias_correction_kl=False,
            sapo_temperature_pos=0.5,
            sapo_temperature_neg=2.0,
            vespo_k_pos=1.5,
            vespo_lambda_pos=2.5,
            vespo_k_neg=2.5,
            vespo_lambda_neg=1.5,
        )
    elif extras == "sequence-weights":  # one weight per sequence, (B, 1)
        kwargs.update(importance_weights=weights[:, :1])

    logps = logps.clone().requires_grad_()
    loss, stats = loss_with(
        logps,
        old_logps,
        advantages,
        completion_mask,
        loss_type=loss_type,
        importance_sampling_level=level,
        **kwargs,
    )
    (grad,) = torch.autograd.grad(loss, logps)

    ref_input = logps.detach().clone().requires_grad_()
    expected_loss, expected_stats = reference_policy_loss(
        ref_input,
        old_logps,
        advantages,
        completion_mask,
        loss_type,
        level,
        **kwargs,
    )
    (expected_grad,) = torch.autograd.grad(expected_loss, ref_input)

    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)
    assert set(stats) == set(expected_stats)
    for name, value in expected_stats.items():
        assert stats[name].item() == pytest.approx(value), name
    if "clip_ratio/region_mean" in stats and level == "token":
        assert stats["clip_ratio/region_mean"] > 0  # the random ratios do exercise the clipping
    if extras == "masks":  # the masks do drop something, and not everything
        keep = off_policy_mask(advantages, logps, sampling_logps, completion_mask, 0.1)
        assert 0 < keep.sum() < len(keep)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_token_equals_sequence_gspo(loss_type):
    # GSPO paper: with one advantage per sequence, GSPO-token ("sequence_token") has the same value
    # and gradient as GSPO proper ("sequence", TRL's form: s_i differentiated as a whole, the
    # sequence loss broadcast to the tokens), for every loss type, with per-sequence weights too.
    logps, old_logps, _, advantages, completion_mask, weights = random_batch(40)
    mask = completion_mask.double()
    results = []
    for level in ("sequence", "sequence_token"):
        x = logps.clone().requires_grad_()
        loss, stats = loss_with(
            x,
            old_logps,
            advantages,
            completion_mask,
            loss_type=loss_type,
            importance_sampling_level=level,
            importance_weights=weights[:, :1],
        )
        results.append((loss, torch.autograd.grad(loss, x)[0]))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    if loss_type == "grpo":  # and both are the GSPO objective written out
        x = logps.clone().requires_grad_()
        seq_ratio = torch.exp(((x - old_logps) * mask).sum(-1) / mask.sum(-1))  # (B,)
        clipped = seq_ratio.clamp(0.8, 1.2)
        seq_loss = -torch.min(seq_ratio * advantages, clipped * advantages) * weights[:, 0]  # (B,)
        expected = seq_loss.mean()
        torch.testing.assert_close(results[0][0], expected)
        torch.testing.assert_close(results[0][1], torch.autograd.grad(expected, x)[0])


GLOBAL_TOKEN_LOSS_TYPES = [n for n, t in LOSS_TYPE_TABLE.items() if t.aggregation == "dapo"]
PER_SEQUENCE_LOSS_TYPES = [
    n for n, t in LOSS_TYPE_TABLE.items() if t.aggregation in ("grpo", "dr_grpo", "luspo")
]


def _micro_batch_losses(loss_type, level, rows_list, **extra):
    logps, old_logps, ref_logps, advantages, completion_mask, weights = random_batch(50, 6)
    entropy, sampling_logps = random_extras(50, 6)
    kwargs = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, **extra)
    entropy_mask = high_entropy_mask(entropy, completion_mask, 0.6)  # one threshold for the step

    def run(rows):
        x = logps[rows].clone().requires_grad_()
        loss, _ = loss_with(
            x,
            old_logps[rows],
            advantages[rows],
            completion_mask[rows],
            ref_logps=ref_logps[rows],
            importance_weights=weights[rows],
            entropy_mask=entropy_mask[rows],
            off_policy_mask_threshold=0.2,
            sampling_logps=sampling_logps[rows],
            **kwargs,
        )
        return loss, torch.autograd.grad(loss, x)[0]

    full = run(slice(0, 6))
    micro = [run(rows) for rows in rows_list]
    return full, micro


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", GLOBAL_TOKEN_LOSS_TYPES)
def test_dapo_micro_batches_add_up_to_the_full_batch(loss_type, level):
    # "dapo", "cispo", "vespo": with the global token count, micro-batch losses of any sizes sum
    # to the loss of the whole batch, and their gradients (accumulated) to its gradient.
    rows_list = (slice(0, 1), slice(1, 4), slice(4, 6))
    num_items = random_batch(50, 6)[4].sum()
    (full_loss, full_grad), micro = _micro_batch_losses(
        loss_type, level, rows_list, num_items_in_batch=num_items
    )
    assert sum(loss.item() for loss, _ in micro) == pytest.approx(full_loss.item())
    torch.testing.assert_close(torch.cat([grad for _, grad in micro]), full_grad)


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", PER_SEQUENCE_LOSS_TYPES)
def test_per_sequence_loss_types_average_over_equal_micro_batches(loss_type, level):
    # "grpo", "sapo", "dr_grpo", "luspo" are means over sequences: for micro-batches of equal
    # size the mean of their losses (the trainer divides by the accumulation steps) is the loss of
    # the whole batch.
    rows_list = (slice(0, 2), slice(2, 4), slice(4, 6))
    (full_loss, full_grad), micro = _micro_batch_losses(
        loss_type, level, rows_list, max_completion_length=6
    )
    assert sum(loss.item() for loss, _ in micro) / 3 == pytest.approx(full_loss.item())
    torch.testing.assert_close(torch.cat([grad for _, grad in micro]) / 3, full_grad)


def test_padding_values_never_leak():
    # NaN / inf at padding positions (e.g. from -inf logits) must not reach the loss or gradient.
    logps, old_logps, ref_logps, advantages, completion_mask, weights = random_batch(60)
    padding = completion_mask == 0
    kwargs = dict(ref_logps=ref_logps, beta=0.1, importance_weights=weights)
    for level in IMPORTANCE_SAMPLING_LEVELS:
        clean_logps = logps.clone().requires_grad_()
        clean, _ = loss_with(
            clean_logps,
            old_logps,
            advantages,
            completion_mask,
            importance_sampling_level=level,
            **kwargs,
        )
        clean.backward()
        dirty_logps = logps.masked_fill(padding, NAN).requires_grad_()
        dirty, _ = loss_with(
            dirty_logps,
            old_logps.masked_fill(padding, -math.inf),
            advantages,
            completion_mask,
            importance_sampling_level=level,
            ref_logps=ref_logps.masked_fill(padding, math.inf),
            beta=0.1,
            importance_weights=weights.masked_fill(padding, NAN),
        )
        dirty.backward()
        torch.testing.assert_close(dirty, clean)
        torch.testing.assert_close(dirty_logps.grad, clean_logps.grad)


def test_importance_weights_are_a_constant_multiplier():
    # A weight computed from the policy itself (as an off-policy correction would be) must not
    # add a gradient path: same gradient as with the detached weight.
    logps, old_logps, _, advantages, completion_mask, _ = random_batch(70)
    grads = []
    for detach in (False, True):
        x = logps.clone().requires_grad_()
        weights = torch.exp(x - old_logps).clamp(max=2.0)  # (B, T), depends on x
        loss, _ = loss_with(
            x,
            old_logps,
            advantages,
            completion_mask,
            importance_weights=weights.detach() if detach else weights,
        )
        grads.append(torch.autograd.grad(loss, x)[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_policy_loss_validation():
    with pytest.raises(ValueError, match="'grpo', 'bnpo', 'dr_grpo', 'dapo'"):
        LossSettings(loss_type="ppo")
    with pytest.raises(ValueError, match="'token', 'sequence'"):
        LossSettings(importance_sampling_level="group")
    with pytest.raises(ValueError, match="beta must be >= 0"):
        LossSettings(beta=-0.1)
    args = (torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(*args, LossSettings(beta=0.1))
    with pytest.raises(ValueError, match="completion_mask"):
        policy_loss(torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 3), LossSettings())


def test_loss_settings_are_frozen_and_epsilon_high_defaults_to_epsilon_low():
    assert LossSettings(epsilon_low=0.1).epsilon_high == 0.1
    assert LossSettings(epsilon_low=0.1, epsilon_high=0.3).epsilon_high == 0.3
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossSettings().beta = 0.1


# ----------------------------------------------------------------------------------------------
# policy_loss: against TRL 1.16's own GRPOTrainer._compute_loss
# ----------------------------------------------------------------------------------------------
# TRL computes the loss inside a trainer method; it reads only attributes of `self` and the
# per-token log-probabilities, so it can run on a stand-in object whose forward pass returns
# given tensors. Gradient accumulation 1, one process, so TRL's normalisers are ours.


def trl_compute_loss(
    logps,
    old_logps,
    advantages,
    completion_mask,
    *,
    loss_type,
    level,
    beta=0.0,
    ref_logps=None,
    use_bias_correction_kl=True,
    epsilon_low=0.2,
    epsilon_high=0.2,
    delta=None,
    entropy=None,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    sampling_logps=None,
    importance_weights=None,
    num_items_in_batch=None,
    max_completion_length=None,
):
    import types
    from collections import defaultdict

    trl = pytest.importorskip("trl")
    if not trl.__version__.startswith("1.16."):
        pytest.skip(f"compares with TRL 1.16, found {trl.__version__}")
    from trl import GRPOTrainer

    batch_size, seq_len = logps.shape
    accelerator = types.SimpleNamespace(
        num_processes=1,
        pad_across_processes=lambda tensor, **_: tensor,
        gather=lambda tensor: tensor,
        gather_for_metrics=lambda tensor: tensor,
        reduce=lambda tensor, reduction: tensor,
    )
    args = types.SimpleNamespace(
        use_bias_correction_kl=use_bias_correction_kl,
        delta=delta,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=1,
    )
    trainer = types.SimpleNamespace(
        args=args,
        accelerator=accelerator,
        model=types.SimpleNamespace(training=True),
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold,
        use_vllm=importance_weights is not None,
        vllm_importance_sampling_correction=True,
        current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length or seq_len,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    entropy = torch.zeros_like(logps) if entropy is None else entropy
    trainer._get_per_token_logps_and_entropies = lambda *_, **__: (logps, entropy, None)
    inputs = {
        "prompt_ids": torch.zeros(batch_size, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch_size, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch_size, seq_len, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old_logps,
        "num_items_in_batch": torch.as_tensor(
            float(completion_mask.sum() if num_items_in_batch is None else num_items_in_batch)
        ),
    }
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if sampling_logps is not None:
        inputs["sampling_per_token_logps"] = sampling_logps
    if importance_weights is not None:
        inputs["importance_sampling_ratio"] = importance_weights
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


TRL_OPTIONS = ("plain", "kl", "kl-uncorrected", "entropy+off-policy", "token-is", "sequence-is")


@pytest.mark.parametrize("options", TRL_OPTIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])  # TRL 1.16 has no "sequence_token"
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_equals_trl(loss_type, level, options):
    seed = 7 + LOSS_TYPES.index(loss_type) * 20 + TRL_OPTIONS.index(options) * 2
    seed += level == "sequence"
    logps, old_logps, ref_logps, advantages, completion_mask, weights = random_batch(seed, 8)
    entropy, sampling_logps = random_extras(seed, 8)
    ours = dict(epsilon_high=0.28 if loss_type != "cispo" else 1.1, max_completion_length=9)
    ours["num_items_in_batch"] = int(completion_mask.sum()) + 5
    theirs = dict(ours)
    if options.startswith("kl"):
        corrected = options == "kl"
        ours.update(beta=0.1, ref_logps=ref_logps, use_bias_correction_kl=corrected)
        theirs.update(beta=0.1, ref_logps=ref_logps, use_bias_correction_kl=corrected)
    elif options == "entropy+off-policy":
        ours.update(
            entropy_mask=high_entropy_mask(entropy, completion_mask, 0.3),
            off_policy_mask_threshold=0.1,
            sampling_logps=sampling_logps,
        )
        theirs.update(
            entropy=entropy,
            top_entropy_quantile=0.3,
            off_policy_mask_threshold=0.1,
            sampling_logps=sampling_logps,
        )
    elif options.endswith("-is"):  # vLLM's importance-sampling ratio, per token or per sequence
        # TRL builds the per-token ratio as exp((old - sampling) * mask): 1 at padding
        is_ratio = torch.where(completion_mask.bool(), weights, 1.0)
        is_ratio = is_ratio if options == "token-is" else weights[:, :1]
        ours["importance_weights"] = is_ratio
        theirs["importance_weights"] = is_ratio

    x = logps.clone().requires_grad_()
    loss, stats = loss_with(
        x,
        old_logps,
        advantages,
        completion_mask,
        loss_type=loss_type,
        importance_sampling_level=level,
        **ours,
    )
    (grad,) = torch.autograd.grad(loss, x)
    y = logps.clone().requires_grad_()
    trl_loss, trl_metrics = trl_compute_loss(
        y, old_logps, advantages, completion_mask, loss_type=loss_type, level=level, **theirs
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, y)

    torch.testing.assert_close(loss, trl_loss)
    torch.testing.assert_close(grad, trl_grad)
    for name, value in stats.items():
        if name in trl_metrics:
            assert value.item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    expected_names = {
        "clipped": "clip_ratio/region_mean",
        "cispo": "cispo_clip_ratio",
        "vespo": "vespo/phi_seq_mean",
        "sapo": "ratio_mean",
    }
    assert expected_names[LOSS_TYPE_TABLE[loss_type].surrogate] in stats


@matches_trl
def test_masks_equal_trl_helpers():
    trl = pytest.importorskip("trl")
    from types import MethodType, SimpleNamespace

    GRPOTrainer = trl.GRPOTrainer
    logps, _, _, advantages, completion_mask, _ = random_batch(90, 8)
    entropy, sampling_logps = random_extras(90, 8)
    sampling_logps[2, 0] = NAN  # a token the engine could not score
    for threshold in (0.05, 0.1, 0.3):
        torch.testing.assert_close(
            off_policy_mask(advantages, logps, sampling_logps, completion_mask, threshold),
            GRPOTrainer.get_off_policy_mask(
                advantages.unsqueeze(1), logps, sampling_logps, completion_mask, threshold
            ),
            check_dtype=False,
        )
    accelerator = SimpleNamespace(pad_across_processes=lambda t, **_: t, gather=lambda t: t)
    stand_in = SimpleNamespace(accelerator=accelerator)
    for quantile in (0.0, 0.2, 0.5, 0.9):
        expected = MethodType(GRPOTrainer.get_high_entropy_mask, stand_in)(
            entropy, completion_mask, 1 - quantile
        )
        assert torch.equal(high_entropy_mask(entropy, completion_mask, quantile), expected)
