"""The public override points: a user replaces one step of the algorithm in a few lines."""

import pytest
import torch
from trainer_helpers import digit_sums, logged, make_trainer, right_digit

from trl_grpo_ext import GroupRelativeTrainer


class LeaveOneOutTrainer(GroupRelativeTrainer):
    """RLOO: each completion's baseline is the mean reward of the other G - 1 in its group."""

    def compute_advantages(self, rewards):
        total = (rewards.nan_to_num() * self.reward_weights.to(rewards.device)).sum(dim=1)
        groups = total.view(-1, self.args.num_generations)  # (B, G)
        size = groups.shape[1]
        baseline = (groups.sum(dim=1, keepdim=True) - groups) / (size - 1)
        return (groups - baseline).flatten()


def test_leave_one_out_subclass_computes_rloo_and_learns(tmp_path):
    trainer = make_trainer(
        tmp_path,
        trainer_class=LeaveOneOutTrainer,
        reward_funcs=right_digit,
        num_generations=8,
        per_device_train_batch_size=32,
        max_completion_length=1,
        max_steps=100,
    )
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]] + [[0.0]] * 4)
    advantages = trainer.compute_advantages(rewards)
    # Hand computation: group sum 2; for a 1: 1 - 1/7; for a 0: 0 - 2/7.
    assert torch.allclose(advantages[:4], torch.tensor([1 - 1 / 7, -2 / 7, -2 / 7, 1 - 1 / 7]))
    trainer.train()
    curve = logged(trainer, "reward")
    assert sum(curve[-10:]) / 10 >= sum(curve[:10]) / 10 + 0.15


def test_score_rollouts_override_sees_the_rollout(tmp_path):
    class ShortIsGood(GroupRelativeTrainer):
        def score_rollouts(self, rollout):
            return (-rollout.completion_lengths.float()).unsqueeze(1)  # (N, 1)

    trainer = make_trainer(tmp_path, trainer_class=ShortIsGood, max_completion_length=4)
    trainer.train()
    assert logged(trainer, "reward")[0] <= -1


class Overridden(GroupRelativeTrainer):
    """Counts its calls and marks every rollout it returns with a column of its own."""

    calls = 0

    def generate_rollouts(self, rows):
        type(self).calls += 1
        rollout = super().generate_rollouts(rows)
        rollout.columns["mark"] = ["seen"] * len(rollout)
        return rollout


def marked(completions, mark, **kwargs):
    assert mark == ["seen"] * len(completions)
    return [1.0] * len(completions)


@pytest.mark.parametrize("max_staleness", [None, 0, 1])
def test_a_generate_rollouts_override_runs_in_every_mode(tmp_path, max_staleness):
    """Synchronous (the transformers engine in this process) and asynchronous (the process
    worker, sampling ahead with max_staleness 0 or 1): every generation batch goes through the
    override, and what it changed reaches the reward functions."""
    Overridden.calls = 0
    trainer = make_trainer(
        tmp_path,
        trainer_class=Overridden,
        reward_funcs=marked,
        max_steps=3,
        max_staleness=max_staleness,
    )
    trainer.train()
    assert Overridden.calls == 3
    if max_staleness is not None:
        assert len(logged(trainer, "async/staleness")) == 3


class Prefixed(GroupRelativeTrainer):
    """Changes the rows before the parent samples them."""

    def generate_rollouts(self, rows):
        return super().generate_rollouts([{**row, "prompt": "0" + row["prompt"]} for row in rows])


def prompt_starts_with_zero(prompts, completions, **kwargs):
    assert all(prompt.startswith("0") for prompt in prompts), prompts
    return [1.0] * len(completions)


def test_rows_changed_by_an_override_are_sampled_even_when_sent_ahead(tmp_path):
    """With max_staleness 1 the worker samples the next batch from the loader's rows; an override
    that changes them gets its own rows sampled (with a warning that the overlap is lost)."""
    trainer = make_trainer(
        tmp_path,
        trainer_class=Prefixed,
        reward_funcs=prompt_starts_with_zero,
        max_steps=3,
        max_staleness=1,
    )
    with pytest.warns(UserWarning, match="generate_rollouts received other rows"):
        trainer.train()
    assert logged(trainer, "async/staleness") == [0.0, 0.0, 0.0]


class Answering(GroupRelativeTrainer):
    """Replaces every completion by the boxed answer of its row: what an override changed is
    what every evaluation must see."""

    def generate_rollouts(self, rows):
        rollout = super().generate_rollouts(rows)
        rollout.completions = [rf"\boxed{{{answer}}}" for answer in rollout.columns["answer"]]
        return rollout


def boxed_answer(completions, answer, **kwargs):
    return [float(c == rf"\boxed{{{a}}}") for c, a in zip(completions, answer)]


@pytest.mark.parametrize("trainer_class, expected", [(Answering, 1.0), (GroupRelativeTrainer, 0.0)])
def test_every_evaluation_samples_through_generate_rollouts(tmp_path, trainer_class, expected):
    """`trainer.evaluate()`, the pass@k harness and the periodic evaluation callback all see
    the override's completions (the tiny model itself never writes a boxed answer)."""
    from trl_grpo_ext.evaluation import PeriodicEvalCallback, evaluate_on_processes

    dataset = digit_sums(2)
    trainer = make_trainer(
        tmp_path,
        trainer_class=trainer_class,
        reward_funcs=boxed_answer,
        max_steps=1,
        eval_dataset=dataset,
    )
    periodic = PeriodicEvalCallback(
        trainer.processing_class, dataset, eval_every=1, max_new_tokens=2, trainer=lambda: trainer
    )
    trainer.add_callback(periodic)
    trainer.train()
    assert [lenient for _, _, lenient in periodic.history] == [expected]
    assert trainer.evaluate()["eval_reward"] == expected
    report = evaluate_on_processes(trainer, dataset, max_new_tokens=2, num_examples=0)
    assert report.greedy_lenient == expected


@pytest.mark.parametrize("max_staleness", [None, 1])
def test_training_and_every_evaluation_build_one_request_per_batch(
    tmp_path, monkeypatch, max_staleness
):
    """Every batch, sampled in this process or by the rollout worker, in training or in an
    evaluation, is built by the one `RequestBuilder` (prompts encoded once, each batch once)."""
    from trl_grpo_ext.evaluation import evaluate_on_processes
    from trl_grpo_ext.generation import requests

    built = []
    build = requests.RequestBuilder.build

    def counting(self, rows, group, slot=0):
        built.append((len(rows), group))
        return build(self, rows, group, slot)

    monkeypatch.setattr(requests.RequestBuilder, "build", counting)
    dataset = digit_sums(2)  # 4 rows
    trainer = make_trainer(tmp_path, max_steps=1, max_staleness=max_staleness)
    trainer.train()
    # 8 completions of 2 prompts per step; the worker also requests the next step's batch
    assert built == [(2, 4)] * (1 if max_staleness is None else 2)
    built.clear()
    trainer.evaluate(dataset)
    assert built and all(group == 4 for _, group in built)
    assert sum(rows for rows, _ in built) == 4
    built.clear()
    evaluate_on_processes(trainer, dataset, max_new_tokens=2, num_examples=0)
    assert built == [(4, 1)]  # greedy: one completion per prompt, one batch
