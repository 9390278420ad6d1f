"""Behaviour of trl.GRPOTrainer 1.16 that its own test file checks, run side by side with ours
on the same tiny stand-ins: batch layouts TRL accepts, its warnings and errors, the public
methods its users call in subclasses, entropy regularisation and the MoE router loss."""

from __future__ import annotations

from datasets import Dataset
from trainer_helpers import make_trainer
from trl_reference import matches_trl


def numbered_prompts(count: int) -> Dataset:
    return Dataset.from_list([{"prompt": f"Count to {i}:", "row": i} for i in range(count)])


class GenerationBatches:
    """A reward function that records the dataset rows of each generation batch it scores."""

    __name__ = "generation_batches"

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, completions, row, **kwargs):
        self.batches.append(list(row))
        return [float(len(completion) % 2) for completion in completions]


STRADDLING = dict(
    per_device_train_batch_size=2,
    num_generations=2,
    steps_per_generation=4,
    gradient_accumulation_steps=3,
    max_completion_length=2,
    max_steps=4,  # 8 micro-batches an epoch (3 steps: 3 + 3 + 2), then one step of epoch two
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)


@matches_trl
def test_steps_per_generation_not_a_multiple_of_accumulation_samples_as_trl(
    tmp_path, tiny_model_dir
):
    """TRL 1.16 accepts steps_per_generation=4 with gradient_accumulation_steps=3: a generation
    batch every 4 micro-batches, which optimizer steps straddle, and a new one at each epoch."""
    import trl

    theirs_reward, ours_reward = GenerationBatches(), GenerationBatches()
    trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=theirs_reward,
        args=trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **STRADDLING
        ),
        train_dataset=numbered_prompts(8),
    ).train()
    ours = make_trainer(
        tmp_path / "ours", reward_funcs=ours_reward, dataset=numbered_prompts(8), **STRADDLING
    )
    ours.train()
    # 12 micro-batches: generation batches at 0 and 4 of epoch one, then 0 of epoch two.
    assert (
        [len(rows) for rows in ours_reward.batches]
        == [len(rows) for rows in theirs_reward.batches]
        == [8, 8, 8]
    )
    for batches in (ours_reward.batches, theirs_reward.batches):
        assert sorted(set(batches[0] + batches[1])) == list(range(8))  # one epoch, each once
    losses = [entry["loss"] for entry in ours.state.log_history if "loss" in entry]
    assert len(losses) == 4


def test_a_step_across_two_generation_batches_divides_dapo_by_its_own_tokens(tmp_path):
    """With loss_type='dapo' the second step trains on the last micro-batch of one generation
    batch and the first two of the next: its denominator is the token count of those three."""
    seen = []
    ours = make_trainer(
        tmp_path, dataset=numbered_prompts(8), loss_type="dapo", **{**STRADDLING, "max_steps": 2}
    )
    original = ours.compute_objective

    def recording(model, batch):
        seen.append((int(batch["completion_mask"].sum()), float(batch["num_items_in_batch"])))
        return original(model, batch)

    ours.compute_objective = recording
    ours.train()
    assert len(seen) == 6
    for step in (seen[:3], seen[3:]):
        assert {items for _, items in step} == {float(sum(tokens for tokens, _ in step))}
