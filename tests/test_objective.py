"""Tests of the group-relative objective (`trl_grpo_ext.objective`).

Three kinds of evidence: numbers worked out by hand on tiny tensors (the arithmetic is in the
comments), slow Python-loop reference implementations written straight from the equations that the
vectorised code must match in value and gradient, and statistical checks (the k3 estimator's
Monte-Carlo mean is the exact KL, with the arguments in the right order).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_grpo_ext.objective import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    SCALE_MODES,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
    weighted_rewards,
)

NAN = float("nan")


# ----------------------------------------------------------------------------------------------
# Slow, obviously-correct reference implementations: one Python loop iteration per element.
# ----------------------------------------------------------------------------------------------


def reference_group_advantages(rewards, group_size, weights, scale, eps=1e-4):
    num_rows, num_funcs = rewards.shape
    summed = []
    for i in range(num_rows):
        values = [weights[f] * rewards[i, f].item() for f in range(num_funcs)]
        values = [v for v in values if not math.isnan(v)]
        summed.append(sum(values) if values else None)  # None: every function said "n/a"

    def mean_std(values):
        mean = sum(values) / len(values)
        if len(values) < 2:
            return mean, 0.0
        return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))

    _, batch_std = mean_std([r for r in summed if r is not None])
    advantages = []
    for i, r in enumerate(summed):
        if r is None:
            advantages.append(0.0)
            continue
        start = (i // group_size) * group_size
        group = [g for g in summed[start : start + group_size] if g is not None]
        mean, group_std = mean_std(group)
        divisor = {"group": group_std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        advantages.append((r - mean) / divisor)
    return torch.tensor(advantages, dtype=rewards.dtype)


def reference_token_logprobs(logits, token_ids, temperature):
    batch_size, seq_len, _ = logits.shape
    logps = torch.zeros(batch_size, seq_len, dtype=logits.dtype)
    entropy = torch.zeros(batch_size, seq_len, dtype=logits.dtype)
    for b in range(batch_size):
        for t in range(seq_len):
            log_p = torch.log_softmax(logits[b, t] / temperature, dim=-1)
            logps[b, t] = log_p[token_ids[b, t]]
            entropy[b, t] = -(log_p.exp() * log_p).sum()
    return logps, entropy


def reference_policy_loss(
    logps,
    old_logps,
    advantages,
    completion_mask,
    loss_type,
    level,
    beta=0.0,
    ref_logps=None,
    epsilon_low=0.2,
    epsilon_high=0.2,
    delta=None,
    num_items_in_batch=None,
    max_completion_length=None,
    importance_weights=None,
):
    """GRPO / DAPO / Dr. GRPO / GSPO-token, one token at a time."""
    batch_size, seq_len = logps.shape
    token_losses = []  # per sequence: list of 0-d tensors, one per completion token
    low = high = ratio_sum = kl_sum = 0.0
    for b in range(batch_size):
        tokens = [t for t in range(seq_len) if completion_mask[b, t]]
        advantage = advantages[b].item()
        if level == "sequence":
            # s_i = exp(1/|o_i| sum_t log(pi / pi_old)), taken as a constant (stop-gradient)
            seq_log_ratio = sum((logps[b, t] - old_logps[b, t]).item() for t in tokens)
            seq_ratio = math.exp(seq_log_ratio / max(len(tokens), 1))
        losses = []
        for t in tokens:
            if level == "token":
                ratio = torch.exp(logps[b, t] - old_logps[b, t])
            else:  # GSPO-token: value s_i, gradient s_i * grad log pi(o_t)
                ratio = seq_ratio * torch.exp(logps[b, t] - logps[b, t].detach())
            clipped = min(max(ratio, 1 - epsilon_low), 1 + epsilon_high)
            unclipped = ratio if delta is None else min(ratio, delta)
            loss = -min(unclipped * advantage, clipped * advantage)
            if importance_weights is not None:
                loss = loss * importance_weights[b, t].item()
            if beta > 0:
                log_r = ref_logps[b, t] - logps[b, t]
                kl = torch.exp(log_r) - log_r - 1  # pi_ref/pi - log(pi_ref/pi) - 1
                loss = loss + beta * kl
                kl_sum += kl.item()
            losses.append(loss)
            low += float(ratio.item() < 1 - epsilon_low and advantage < 0)
            high += float(ratio.item() > 1 + epsilon_high and advantage > 0)
            ratio_sum += ratio.item()
        token_losses.append(losses)

    num_tokens = sum(len(losses) for losses in token_losses)
    total = sum((sum(losses, torch.zeros(())) for losses in token_losses), torch.zeros(()))
    if loss_type == "grpo":
        per_seq = [sum(losses, torch.zeros(())) / max(len(losses), 1) for losses in token_losses]
        loss = sum(per_seq, torch.zeros(())) / batch_size
    elif loss_type == "bnpo":
        loss = total / max(num_tokens, 1)
    elif loss_type == "dr_grpo":
        loss = total / (batch_size * (max_completion_length or seq_len))
    elif loss_type == "dapo":
        loss = total / max(num_items_in_batch or num_tokens, 1)
    stats = {
        "clip_ratio/low_mean": low / max(num_tokens, 1),
        "clip_ratio/high_mean": high / max(num_tokens, 1),
        "clip_ratio/region_mean": (low + high) / max(num_tokens, 1),
        "ratio_mean": ratio_sum / max(num_tokens, 1),
    }
    if beta > 0:
        stats["kl"] = kl_sum / max(num_tokens, 1)
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
# token_logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_log_softmax_gather(chunk_size, temperature):
    generator = torch.Generator().manual_seed(chunk_size)
    logits = 3 * torch.randn(3, 5, 11, generator=generator)
    token_ids = torch.randint(11, (3, 5), generator=generator)
    logps, entropy = token_logprobs(logits, token_ids, temperature, chunk_size, return_entropy=True)
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(logps, log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1))
    ref_logps, ref_entropy = reference_token_logprobs(logits, token_ids, temperature)
    torch.testing.assert_close(logps, ref_logps)
    torch.testing.assert_close(entropy, ref_entropy)
    torch.testing.assert_close(token_logprobs(logits, token_ids, temperature, chunk_size), logps)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs_gradient(return_entropy):
    # The backward pass is hand-written (chunked); check it against finite differences and
    # against autograd through the naive formula.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    token_ids = torch.randint(5, (3, 2), generator=generator)

    def fn(x):
        return token_logprobs(x, token_ids, 0.7, chunk_size=2, return_entropy=return_entropy)

    assert torch.autograd.gradcheck(fn, (logits,))

    weights = torch.randn(3, 2, generator=generator, dtype=torch.float64)
    out = fn(logits)
    outs = out if return_entropy else (out,)
    (grad,) = torch.autograd.grad(sum((o * weights).sum() for o in outs), logits)
    log_probs = torch.log_softmax(logits / 0.7, dim=-1)
    naive = [log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)]
    if return_entropy:
        naive.append(-(log_probs.exp() * log_probs).sum(-1))
    (naive_grad,) = torch.autograd.grad(sum((o * weights).sum() for o in naive), logits)
    torch.testing.assert_close(grad, naive_grad)


def test_token_logprobs_bf16_is_computed_in_float32():
    generator = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(2, 3, 50, generator=generator)).bfloat16().requires_grad_()
    token_ids = torch.randint(50, (2, 3), generator=generator)
    logps = token_logprobs(logits, token_ids, temperature=0.9, chunk_size=1)
    assert logps.dtype == torch.float32
    exact = torch.log_softmax(logits.detach().float() / 0.9, dim=-1)
    torch.testing.assert_close(logps, exact.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1))
    logps.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


def test_token_logprobs_validation():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


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
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_by_hand(loss_type):
    loss, stats = policy_loss(
        HAND_LOGPS, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK, loss_type=loss_type
    )
    assert loss.item() == pytest.approx(HAND_LOSSES[loss_type], abs=1e-6)
    # of the 5 tokens, only (seq 0, ratio 1.5, A > 0) is clipped; (seq 1, ratio 0.5) is padding
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert stats["clip_ratio/low_mean"].item() == 0.0
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(1 / 5)
    assert stats["ratio_mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 1 + 1.5) / 5)
    assert "kl" not in stats and all(not v.requires_grad for v in stats.values())


def test_policy_loss_normalisers_by_hand():
    args = (HAND_LOGPS, torch.zeros(2, 3), HAND_ADVANTAGES, HAND_MASK)
    dr_grpo, _ = policy_loss(*args, loss_type="dr_grpo", max_completion_length=4)
    assert dr_grpo.item() == pytest.approx(-0.2 / (2 * 4))
    dapo, _ = policy_loss(*args, loss_type="dapo", num_items_in_batch=torch.tensor(10))
    assert dapo.item() == pytest.approx(-0.2 / 10)


def test_ratio_of_e_is_clipped_to_one_plus_epsilon_high():
    # torchtune's check: log-ratio 1, A = 1 -> -min(e, 1.28) = -1.28 with DAPO's clip-higher
    loss, stats = policy_loss(
        torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), epsilon_high=0.28
    )
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_ratio/high_mean"].item() == 1.0


def _token_gradients(advantage, ratios, **kwargs):
    logps = torch.log(torch.tensor([ratios])).requires_grad_()
    loss, _ = policy_loss(
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
    loss, stats = policy_loss(logps, *args, loss_type="bnpo", importance_sampling_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert stats["ratio_mean"].item() == pytest.approx(2 ** (1 / 3))
    assert stats["clip_ratio/high_mean"].item() == 1.0
    assert torch.equal(logps.grad, torch.zeros(1, 3))
    # A < 0: max(1.26, 1.2) = 1.26 per token; GSPO-token gradient s / 3 on every token
    logps.grad = None
    loss, _ = policy_loss(
        logps, args[0], -args[1], args[2], loss_type="bnpo", importance_sampling_level="sequence"
    )
    loss.backward()
    assert loss.item() == pytest.approx(2 ** (1 / 3))
    torch.testing.assert_close(logps.grad, torch.full((1, 3), 2 ** (1 / 3) / 3))


def test_kl_term_by_hand():
    # On-policy (ratio 1), A = 0, pi_ref / pi = 2 on the one token: loss = beta * (2 - log 2 - 1)
    loss, stats = policy_loss(
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
    loss, stats = policy_loss(logps, None, advantages, torch.ones(2, 2), loss_type="bnpo")
    loss.backward()
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    assert stats["ratio_mean"].item() == 1.0
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))


# ----------------------------------------------------------------------------------------------
# policy_loss: against the loop reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "weights+delta"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_matches_loop_reference(loss_type, level, beta, extras):
    seed = LOSS_TYPES.index(loss_type) * 8 + IMPORTANCE_SAMPLING_LEVELS.index(level) * 2 + extras
    logps, old_logps, ref_logps, advantages, completion_mask, weights = random_batch(seed, 8)
    kwargs = dict(
        beta=beta,
        ref_logps=ref_logps,
        num_items_in_batch=int(completion_mask.sum()) + 7,  # more tokens on other micro-batches
        max_completion_length=9,
        epsilon_high=0.28,
    )
    if extras:
        kwargs.update(importance_weights=weights, delta=1.5)

    logps = logps.clone().requires_grad_()
    loss, stats = policy_loss(
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
        ref_input, old_logps, advantages, completion_mask, loss_type, level, **kwargs
    )
    (expected_grad,) = torch.autograd.grad(expected_loss, ref_input)

    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)
    assert set(stats) == set(expected_stats)
    for name, value in expected_stats.items():
        assert stats[name].item() == pytest.approx(value), name
    assert stats["clip_ratio/region_mean"] > 0  # the random ratios do exercise the clipping


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_token_equals_sequence_gspo(loss_type):
    # GSPO paper: with one advantage per sequence, GSPO-token has the same value and gradient as
    # GSPO proper, whose ratio s_i is differentiated as a whole and whose sequence loss is
    # broadcast to the tokens (TRL's form).
    logps, old_logps, _, advantages, completion_mask, _ = random_batch(40)
    mask = completion_mask.double()
    logps = logps.requires_grad_()
    seq_ratio = torch.exp(((logps - old_logps) * mask).sum(-1) / mask.sum(-1))  # (B,)
    seq_loss = -torch.min(seq_ratio * advantages, seq_ratio.clamp(0.8, 1.2) * advantages)  # (B,)
    per_token = seq_loss.unsqueeze(-1) * mask  # (B, T)
    num_tokens = mask.sum()
    expected = {
        "grpo": (per_token.sum(-1) / mask.sum(-1)).mean(),
        "bnpo": per_token.sum() / num_tokens,
        "dr_grpo": per_token.sum() / (mask.shape[0] * mask.shape[1]),
        "dapo": per_token.sum() / num_tokens,
    }[loss_type]
    (expected_grad,) = torch.autograd.grad(expected, logps)
    loss, _ = policy_loss(
        logps,
        old_logps,
        advantages,
        completion_mask,
        loss_type=loss_type,
        importance_sampling_level="sequence",
    )
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
def test_dapo_micro_batches_add_up_to_the_full_batch(level):
    logps, old_logps, ref_logps, advantages, completion_mask, _ = random_batch(50, batch_size=6)
    num_items = completion_mask.sum()
    kwargs = dict(loss_type="dapo", importance_sampling_level=level, beta=0.1)

    full_logps = logps.clone().requires_grad_()
    full_loss, _ = policy_loss(
        full_logps, old_logps, advantages, completion_mask, ref_logps=ref_logps, **kwargs
    )
    full_loss.backward()

    micro_logps = logps.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        loss, _ = policy_loss(
            micro_logps[rows],
            old_logps[rows],
            advantages[rows],
            completion_mask[rows],
            ref_logps=ref_logps[rows],
            num_items_in_batch=num_items,
            **kwargs,
        )
        loss.backward()  # gradient accumulation
        total = total + loss.item()

    assert total == pytest.approx(full_loss.item())
    torch.testing.assert_close(micro_logps.grad, full_logps.grad)


def test_padding_values_never_leak():
    # NaN / inf at padding positions (e.g. from -inf logits) must not reach the loss or gradient.
    logps, old_logps, ref_logps, advantages, completion_mask, weights = random_batch(60)
    padding = completion_mask == 0
    kwargs = dict(ref_logps=ref_logps, beta=0.1, importance_weights=weights)
    for level in IMPORTANCE_SAMPLING_LEVELS:
        clean_logps = logps.clone().requires_grad_()
        clean, _ = policy_loss(
            clean_logps,
            old_logps,
            advantages,
            completion_mask,
            importance_sampling_level=level,
            **kwargs,
        )
        clean.backward()
        dirty_logps = logps.masked_fill(padding, NAN).requires_grad_()
        dirty, _ = policy_loss(
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
        loss, _ = policy_loss(
            x,
            old_logps,
            advantages,
            completion_mask,
            importance_weights=weights.detach() if detach else weights,
        )
        grads.append(torch.autograd.grad(loss, x)[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_policy_loss_validation():
    args = (torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="'grpo', 'bnpo', 'dr_grpo', 'dapo'"):
        policy_loss(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="'token', 'sequence'"):
        policy_loss(*args, importance_sampling_level="group")
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(*args, beta=0.1)
    with pytest.raises(ValueError, match="completion_mask"):
        policy_loss(torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 3))
