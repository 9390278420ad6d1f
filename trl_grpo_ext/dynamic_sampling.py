"""Dynamic sampling (DAPO): keep only groups whose rewards differ, resampling to fill the batch.

A group whose G completions all get the same reward has zero advantage everywhere and teaches
nothing. `sample_informative` samples a generation batch, keeps its informative groups and
samples more prompts, up to `max_rounds` more times, until every process has as many
informative groups as it has prompts. When the rounds run out, uninformative groups fill the
batch, marked as not trainable.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import datasets
import torch

from .generation.rollout import Rollout, concat_rollouts
from .objective import weighted_rewards
from .sampler import SHUFFLE_BUFFER_ROWS


def random_rows(
    dataset, count: int, seed: int, buffer_size: int = SHUFFLE_BUFFER_ROWS
) -> list[dict]:
    """`count` rows of `dataset`, reproducibly from `seed`: from a `Dataset`, drawn with
    replacement; from a stream (`datasets.IterableDataset`), which has no random access, the
    first `count` rows of a shuffle of it seeded with `seed` (its shards in a seeded order, its
    rows through a buffer of `buffer_size`), read again for each draw and repeated in turn when
    the stream has fewer. Nothing depends on what was drawn before, so a resumed run draws the
    same rows."""
    if isinstance(dataset, datasets.IterableDataset):
        shuffled = dataset.shuffle(seed=seed, buffer_size=buffer_size)
        rows = [dict(row) for row in itertools.islice(shuffled, count)]
        if not rows:
            raise ValueError("dynamic_sampling drew prompts from train_dataset, an empty stream.")
        return [rows[i % len(rows)] for i in range(count)]
    draw = torch.Generator().manual_seed(seed)
    return [dataset[i] for i in torch.randint(len(dataset), (count,), generator=draw).tolist()]


def sample_informative(
    rows: list[dict],
    *,
    sample: Callable[[list[dict], int], Rollout],
    score: Callable[[Rollout], torch.Tensor],
    draw_rows: Callable[[int, int], list[dict]],
    fewest_kept: Callable[[int], int],
    reward_weights: torch.Tensor,
    group_size: int,
    max_rounds: int,
    pad_token_id: int,
) -> tuple[Rollout, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Samples rounds of `len(rows)` prompts until that many groups are informative.

    Args:
        rows (`list[dict]`): the prompts of round 0.
        sample (`Callable[[rows, round], Rollout]`): samples one round.
        score (`Callable[[Rollout], Tensor]`): its rewards `(N, F)`.
        draw_rows (`Callable[[count, round], rows]`): the prompts of a later round.
        fewest_kept (`Callable[[int], int]`): the smallest count of informative groups over all
            processes (every process runs every round, so collective calls stay matched).
        reward_weights (`Tensor`): `(F,)`, for the weighted total reward.

    Returns:
        `(rollout, rewards (N, F), trainable (N,) bool, metrics)`; filler groups have
        `trainable` False.
    """
    wanted = len(rows)
    kept, kept_rewards, filler, filler_rewards = [], [], [], []
    generated = filtered = rounds = 0
    while True:
        rollout = sample(rows, rounds)
        rewards = score(rollout)  # (N, F)
        totals = weighted_rewards(rewards, reward_weights).view(-1, group_size)
        informative = (totals.nan_to_num().std(dim=1) > 1e-6).tolist()
        generated += len(informative)
        filtered += informative.count(False)
        for group, useful in enumerate(informative):
            (kept if useful else filler).append(rollout.select_groups([group]))
            (kept_rewards if useful else filler_rewards).append(
                rewards[group * group_size : (group + 1) * group_size]
            )
        if fewest_kept(len(kept)) >= wanted or rounds == max_rounds:
            break
        rounds += 1
        rows = draw_rows(wanted, rounds)
    chosen = (kept + filler)[:wanted]
    chosen_rewards = torch.cat((kept_rewards + filler_rewards)[:wanted])
    trainable = torch.tensor([i < len(kept) for i in range(len(chosen)) for _ in range(group_size)])
    metrics = {
        "dynamic_sampling/filtered_fraction": filtered / generated,
        "dynamic_sampling/rounds": float(rounds),
    }
    return concat_rollouts(chosen, pad_token_id), chosen_rewards, trainable, metrics
