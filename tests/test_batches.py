"""From rollouts to what the Trainer's loop trains on: dynamic sampling's choice of groups, and
the micro-batches with the token count of their optimizer step. Checked against hand counts."""

import pytest
import torch
from datasets import Dataset

from trl_grpo_ext.batches import split_micro_batches, training_tensors
from trl_grpo_ext.dynamic_sampling import random_rows, sample_informative
from trl_grpo_ext.generation.rollout import Rollout


def rollout_of(prompts: list[str], group_size: int = 2, lengths=None) -> Rollout:
    """Completions of 3 tokens, `lengths[i]` of them real; each prompt's completions are
    named `"<prompt>/<member>"`, so a test can see which groups were kept."""
    n = len(prompts) * group_size
    lengths = lengths or [3] * n
    mask = torch.tensor([[1] * k + [0] * (3 - k) for k in lengths])
    return Rollout(
        prompts=[p for p in prompts for _ in range(group_size)],
        completions=[f"{p}/{m}" for p in prompts for m in range(group_size)],
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.arange(n * 3).view(n, 3),
        completion_mask=mask,
        is_truncated=torch.tensor([k == 3 for k in lengths]),
        group_size=group_size,
    )


# Rewards by prompt name: "a" and "c" always differ within the group, "b" and "d" never do.
REWARDS = {"a": [0.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 0.0], "d": [0.0, 0.0]}


def score(rollout):
    return torch.tensor([[REWARDS[p][m]] for p, m in zip(rollout.prompts, [0, 1] * 99)])


def test_dynamic_sampling_keeps_informative_groups_in_order_and_fills_with_the_rest():
    rounds = {0: ["b", "a"], 1: ["d", "c"]}
    sampled = []

    def sample(rows, round_index):
        sampled.append((round_index, [row["prompt"] for row in rows]))
        return rollout_of([row["prompt"] for row in rows])

    def draw(count, round_index):
        return [{"prompt": p} for p in rounds[round_index]][:count]

    rollout, rewards, trainable, metrics = sample_informative(
        [{"prompt": p} for p in rounds[0]],
        sample=sample,
        score=score,
        draw_rows=draw,
        fewest_kept=lambda kept: kept,
        reward_weights=torch.ones(1),
        group_size=2,
        max_rounds=1,
        pad_token_id=0,
    )
    assert sampled == [(0, ["b", "a"]), (1, ["d", "c"])]
    # Informative groups first (a, then c), nothing else needed: 2 prompts wanted.
    assert rollout.completions == ["a/0", "a/1", "c/0", "c/1"]
    assert rewards.view(-1).tolist() == [0.0, 1.0, 1.0, 0.0]
    assert trainable.tolist() == [True] * 4
    assert metrics == {"dynamic_sampling/filtered_fraction": 2 / 4, "dynamic_sampling/rounds": 1.0}


def test_dynamic_sampling_stops_after_max_rounds_with_untrainable_filler():
    rollout, rewards, trainable, metrics = sample_informative(
        [{"prompt": "b"}, {"prompt": "a"}],
        sample=lambda rows, _: rollout_of([row["prompt"] for row in rows]),
        score=score,
        draw_rows=lambda count, _: [{"prompt": "d"}] * count,
        fewest_kept=lambda kept: kept,
        reward_weights=torch.ones(1),
        group_size=2,
        max_rounds=2,
        pad_token_id=0,
    )
    assert rollout.completions == ["a/0", "a/1", "b/0", "b/1"]  # a kept, b the first filler
    assert trainable.tolist() == [True, True, False, False]
    assert metrics == {"dynamic_sampling/filtered_fraction": 5 / 6, "dynamic_sampling/rounds": 2.0}


def test_dynamic_sampling_goes_on_while_another_process_has_too_few():
    calls = []
    sample_informative(
        [{"prompt": "a"}],
        sample=lambda rows, _: rollout_of([row["prompt"] for row in rows]),
        score=score,
        draw_rows=lambda count, _: [{"prompt": "a"}] * count,
        fewest_kept=lambda kept: calls.append(kept) or (0 if len(calls) < 3 else kept),
        reward_weights=torch.ones(1),
        group_size=2,
        max_rounds=5,
        pad_token_id=0,
    )
    assert calls == [1, 2, 3]  # this process had enough at once, the slowest after 3 rounds


def test_random_rows_are_reproducible_per_seed():
    dataset = [{"i": i} for i in range(100)]
    assert random_rows(dataset, 5, seed=3) == random_rows(dataset, 5, seed=3)
    assert random_rows(dataset, 5, seed=3) != random_rows(dataset, 5, seed=4)


def test_random_rows_of_a_stream_are_a_seeded_shuffle_of_it():
    rows = [{"i": i} for i in range(100)]
    stream = Dataset.from_list(rows).to_iterable_dataset()
    drawn = random_rows(stream, 5, seed=3)
    assert drawn == random_rows(stream, 5, seed=3) != random_rows(stream, 5, seed=4)
    assert len({row["i"] for row in drawn}) == 5 and all(row in rows for row in drawn)
    assert drawn != rows[:5]  # shuffled, not the stream's first rows
    short = Dataset.from_list(rows[:2]).to_iterable_dataset()
    assert sorted(row["i"] for row in random_rows(short, 5, seed=0)) == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="empty stream"):
        random_rows(stream.filter(lambda row: False), 2, seed=0)


def test_micro_batches_carry_the_token_count_of_their_optimizer_step():
    lengths = [3, 1, 2, 0, 3, 3]  # completion tokens of the 6 rows
    rollout = rollout_of(["a", "b", "c"], lengths=lengths)
    tensors = training_tensors(rollout, torch.arange(6.0), torch.device("cpu"), mask_truncated=True)
    # Truncated completions (3 tokens, no eos) are masked out of the loss.
    assert tensors["completion_mask"].sum(1).tolist() == [0, 1, 2, 0, 0, 0]
    assert tensors["attention_mask"].shape == (6, 5)
    summed = []
    batches = split_micro_batches(
        tensors, 2, 2, lambda tokens: summed.append(tokens.item()) or tokens * 2
    )
    assert [len(b["input_ids"]) for b in batches] == [2, 2, 2]
    # Steps: micro-batches (0, 1) hold 1 + 2 tokens, micro-batch 2 alone holds 0 (clamped to 1
    # after summing over the 2 "processes" of the stand-in reduction).
    assert summed == [3.0, 0.0]
    assert [b["num_items_in_batch"].item() for b in batches] == [6.0, 6.0, 1.0]
    assert batches[1]["advantages"].tolist() == [2.0, 3.0]


def test_filler_rows_get_no_gradient():
    rollout = rollout_of(["a", "b"], lengths=[1, 2, 1, 2])
    trainable = torch.tensor([True, True, False, False])
    tensors = training_tensors(rollout, torch.zeros(4), torch.device("cpu"), trainable=trainable)
    assert tensors["completion_mask"].sum(1).tolist() == [1, 2, 0, 0]
    assert "behaviour_logps" not in tensors


def test_training_tensors_move_every_field_before_combining_them():
    """A rollout's tensors may sit on another device than the model's (an engine's prompt ids on
    the GPU, the completions on the CPU): each field moves to `device` before any concatenation.
    "meta" stands in for the GPU here; tests/test_cuda.py trains on a real one."""
    rollout = rollout_of(["a", "b"])
    rollout.prompt_ids = rollout.prompt_ids.to("meta")
    rollout.behaviour_logps = torch.zeros(4, 3)
    tensors = training_tensors(
        rollout, torch.zeros(4), torch.device("meta"), trainable=torch.ones(4, dtype=torch.bool)
    )
    assert {name: t.device.type for name, t in tensors.items()} == dict.fromkeys(tensors, "meta")
    assert tensors["input_ids"].shape == (4, 5)
