"""TRL's four importance-sampling modes for behaviour log-probs, by hand and against a loop, and
the deprecated `off_policy_*` corrections mapped onto them."""

import math

import pytest
import torch

from trl_grpo_ext import GroupRelativeConfig
from trl_grpo_ext.off_policy import (
    IMPORTANCE_SAMPLING_MODES,
    behaviour_correction,
    importance_sampling_stats,
    importance_sampling_weights,
)

# Two completions of three tokens; the second has two tokens and padding.
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.1]]))
BEHAVIOUR = torch.log(torch.tensor([[0.25, 0.4, 0.9], [0.6, 0.1, 0.7]]))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# Token ratios: [[2.0, 0.5, 1.0], [0.5, 6.0, (padding)]]; sequence ratios: 1.0 and 3.0.


def test_token_truncate_clamps_each_token_ratio():
    weights, raw = importance_sampling_weights(
        OLD, BEHAVIOUR, MASK, mode="token_truncate", clip_min=0.8, clip_max=3.0
    )
    torch.testing.assert_close(raw * MASK, torch.tensor([[2.0, 0.5, 1.0], [0.5, 6.0, 0.0]]))
    torch.testing.assert_close(weights[:, :2], torch.tensor([[2.0, 0.8], [0.8, 3.0]]))


def test_token_mask_zeroes_tokens_outside_the_range():
    weights, _ = importance_sampling_weights(OLD, BEHAVIOUR, MASK, mode="token_mask", clip_max=3.0)
    torch.testing.assert_close(weights[:, :2], torch.tensor([[2.0, 0.5], [0.5, 0.0]]))


def test_sequence_modes_use_the_product_of_the_token_ratios():
    truncated, raw = importance_sampling_weights(
        OLD, BEHAVIOUR, MASK, mode="sequence_truncate", clip_max=2.0
    )
    torch.testing.assert_close(raw, torch.tensor([[1.0], [3.0]]))  # 2 x 0.5 x 1; 0.5 x 6
    torch.testing.assert_close(truncated, torch.tensor([[1.0], [2.0]]))
    masked, _ = importance_sampling_weights(
        OLD, BEHAVIOUR, MASK, mode="sequence_mask", clip_min=0.5, clip_max=2.0
    )
    torch.testing.assert_close(masked, torch.tensor([[1.0], [0.0]]))


@pytest.mark.parametrize("mode", sorted(IMPORTANCE_SAMPLING_MODES))
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_modes_match_a_loop_over_tokens(mode, clip_min, clip_max):
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(4, 5, generator=generator) - 1
    behaviour = old + 0.7 * torch.randn(4, 5, generator=generator)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 1 + [0] * 4, [1] * 4 + [0]])
    weights, _ = importance_sampling_weights(
        old, behaviour, mask, mode=mode, clip_min=clip_min, clip_max=clip_max
    )
    level, action = mode.split("_")
    low, high = clip_min or -math.inf, clip_max or math.inf
    for row in range(4):
        tokens = [t for t in range(5) if mask[row, t]]
        ratios = [math.exp(old[row, t] - behaviour[row, t]) for t in tokens]
        if level == "sequence":
            ratios = [math.prod(ratios)]
        expected = [
            min(max(r, low), high) if action == "truncate" else (r if low <= r <= high else 0.0)
            for r in ratios
        ]
        got = weights[row, : len(expected)] if level == "token" else weights[row]
        assert got.tolist() == pytest.approx(expected, rel=1e-5)


def test_unscored_tokens_are_not_corrected_and_left_out_of_the_difference():
    behaviour = BEHAVIOUR.clone()
    behaviour[0, 0] = float("nan")
    weights, _ = importance_sampling_weights(
        OLD, behaviour, MASK, mode="token_truncate", clip_max=10.0
    )
    assert weights[0, 0] == 1.0
    stats = importance_sampling_stats(OLD, behaviour, MASK, weights)
    # |log 0.5/0.25| is left out: the largest difference is |log 0.6/0.1| = log 6.
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(6))
    assert stats["sampling/importance_sampling_ratio/max"].item() == pytest.approx(6.0)
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(0.5)


# ------------------------------------- the deprecated off_policy_* corrections, through TRL's modes


def corrected(tmp_path, logps, behaviour, mask, **fields):
    """`behaviour_correction` as the trainer calls it, for a config with these fields."""
    config = GroupRelativeConfig(output_dir=str(tmp_path), report_to="none", **fields)
    return behaviour_correction(config, logps, behaviour, mask)


def test_tis_is_token_truncate_with_clip_max_c(tmp_path):
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.2], [0.4, 0.4, 0.9]]))
    current = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.8, 0.1]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # Ratios: 1, 5 (-> 2), padding, 0.5, 2, 1/9.
    expected = torch.tensor([[1.0, 2.0], [0.5, 2.0]])
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_mode='token_truncate'"):
        old, _ = corrected(tmp_path, current, behaviour, mask, off_policy_correction="tis")
    new, stats = corrected(
        tmp_path,
        current,
        behaviour,
        mask,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
    )
    for weights in (old, new):
        torch.testing.assert_close(weights[:, :2], expected)
        assert weights[1, 2].item() == pytest.approx(1 / 9)
    # TRL's statistics are of the weights used, over the completion tokens.
    assert stats["sampling/importance_sampling_ratio/max"].item() == pytest.approx(2.0)
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(1 / 9)
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(
        (1 + 2 + 0.5 + 2 + 1 / 9) / 5
    )
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(9))


def test_mis_is_sequence_mask_with_clip_min_and_clip_max(tmp_path):
    behaviour = torch.zeros(4, 2)
    # Sequence ratios: 1, 3, 0.25, 1.5 (the second token of row 3 is padding).
    current = torch.log(torch.tensor([[1.0, 1.0], [1.5, 2.0], [0.5, 0.5], [1.5, 7.0]]))
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    expected = torch.tensor([[1.0], [0.0], [0.0], [1.5]])
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_clip_min=0.5"):
        old, _ = corrected(
            tmp_path, current, behaviour, mask, off_policy_correction="mis", off_policy_clip=2.0
        )
    new, stats = corrected(
        tmp_path,
        current,
        behaviour,
        mask,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0,
    )  # sequence_mask is TRL's default mode
    torch.testing.assert_close(old, expected)
    torch.testing.assert_close(new, expected)
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(2.5 / 4)


def test_the_default_is_trls_sequence_mask_up_to_3(tmp_path):
    behaviour = torch.zeros(3, 2)
    current = torch.log(torch.tensor([[2.0, 1.4], [0.1, 0.2], [2.0, 2.0]]))  # 2.8, 0.02, 4
    weights, _ = corrected(tmp_path, current, behaviour, torch.ones(3, 2))
    torch.testing.assert_close(weights, torch.tensor([[2.8], [0.02], [0.0]]))


def test_none_gives_no_weights_but_the_statistics(tmp_path):
    current = torch.log(torch.tensor([[2.0, 1.0]]))
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_correction=False"):
        weights, stats = corrected(
            tmp_path, current, torch.zeros(1, 2), torch.ones(1, 2), off_policy_correction="none"
        )
    assert weights is None
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(2.0)
