"""`evaluate()` as trl.GRPOTrainer 1.16 (and transformers' Trainer) has it, run side by side on
the same tiny model: several evaluation sets, each evaluated under its own name, and the
evaluation loss that `metric_for_best_model="eval_loss"` and `load_best_model_at_end` read."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset, DatasetDict
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

PROMPTS, GROUP = 2, 4  # one evaluation batch: PROMPTS * GROUP completions


@pytest.fixture(scope="module")
def ending_model_dir(tmp_path_factory) -> str:
    """The tiny model with an output head that ends completions at varied lengths: only the eos
    row is non-zero, so eos is likely after some tokens and not others (every other token has
    the same logit)."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    with torch.no_grad():
        head = model.lm_head.weight
        row = head[tokenizer.eos_token_id].clone()
        head.zero_()
        head[tokenizer.eos_token_id] = row / row.norm() * 8
    folder = tmp_path_factory.mktemp("ending-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class LengthReward:
    """Rewards a completion with its token count; records each call's lengths by eval set."""

    __name__ = "length"

    def __init__(self):
        self.calls: list[tuple[list[str], list[int]]] = []

    def __call__(self, completions, completion_ids, name, **kwargs):
        lengths = [len(ids) for ids in completion_ids]
        self.calls.append((list(name), lengths))
        return [float(length) for length in lengths]

    def lengths_of(self, name: str) -> list[int]:
        return [n for names, lengths in self.calls for s, n in zip(names, lengths) if s == name]


def prompts(name: str, count: int = PROMPTS) -> Dataset:
    return Dataset.from_list([{"prompt": f"Count to {i}:", "name": name} for i in range(count)])


SETTINGS = dict(
    use_cpu=True,
    bf16=False,
    per_device_train_batch_size=PROMPTS * GROUP,  # prompts_per_generation: PROMPTS
    per_device_eval_batch_size=PROMPTS * GROUP,
    num_generations=GROUP,
    max_completion_length=8,
    max_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)


def both_trainers(tmp_path, model_dir, eval_dataset, **config):
    """`(theirs, ours)`: trl.GRPOTrainer and ours on the same model, data and settings, each
    with its own `LengthReward` (`trainer.length_reward`)."""
    import trl

    trainers = []
    for name, trainer_class, config_class in (
        ("trl", trl.GRPOTrainer, trl.GRPOConfig),
        ("ours", GroupRelativeTrainer, GroupRelativeConfig),
    ):
        reward = LengthReward()
        trainer = trainer_class(
            model=model_dir,
            reward_funcs=reward,
            args=config_class(output_dir=str(tmp_path / name), **{**SETTINGS, **config}),
            train_dataset=prompts("train", 4),
            eval_dataset=eval_dataset,
        )
        trainer.length_reward = reward
        trainers.append(trainer)
    return trainers


def dapo_loss(lengths: list[int]) -> float:
    """TRL's "dapo" loss of one batch at the sampling weights (ratio 1, beta 0) when each
    completion's reward is its length L_i: -sum_i A_i L_i / sum_i L_i, A_i = (L_i - mean of
    its group) / (unbiased std of its group + 1e-4)."""
    values = torch.tensor(lengths, dtype=torch.float64).view(-1, GROUP)
    advantages = (values - values.mean(1, keepdim=True)) / (values.std(1, keepdim=True) + 1e-4)
    return float(-(advantages * values).sum() / values.sum())


@matches_trl
@pytest.mark.parametrize("container", [DatasetDict, dict])
def test_several_eval_sets_are_each_evaluated_under_their_name(
    tmp_path, ending_model_dir, container
):
    """eval_dataset={"data1": ..., "data2": ...} (a DatasetDict or a dict): TRL evaluates each
    set and names its loss `eval_<name>_loss`; `evaluate(eval_dataset="data2")` evaluates one
    set by name, and a dict passed to evaluate() is evaluated set by set. Here every metric of a
    set carries its name (TRL's reward metrics keep the bare `eval_` prefix)."""
    sets = container({"data1": prompts("data1"), "data2": prompts("data2", 3)})
    theirs, ours = both_trainers(tmp_path, ending_model_dir, sets)
    for trainer in (theirs, ours):
        metrics = trainer.evaluate()
        assert {"eval_data1_loss", "eval_data2_loss"} <= set(metrics)
        assert "eval_data2_loss" in trainer.evaluate(eval_dataset={"data2": sets["data2"]})
        assert "eval_loss" in trainer.evaluate(eval_dataset="data2")
    reward = ours.length_reward
    data1, data2 = reward.lengths_of("data1"), reward.lengths_of("data2")
    assert len(data1) == PROMPTS * GROUP and len(data2) == 3 * 3 * GROUP  # 3 evaluations
    assert metrics["eval_data1_reward"] == pytest.approx(sum(data1) / len(data1))
    assert metrics["eval_data2_rewards/length/mean"] == pytest.approx(
        sum(data2[: 3 * GROUP]) / (3 * GROUP)
    )
    with pytest.raises(ValueError, match="the sets \\['data1', 'data2'\\]"):
        ours.evaluate(eval_dataset="data3")


def test_each_eval_set_is_checked_at_construction(tmp_path, ending_model_dir):
    """A set without a `prompt` column is named in the error, the other sets aside."""
    bad = Dataset.from_list([{"question": "Count to 3:"}])
    with pytest.raises(ValueError, match="eval_dataset\\['data2'\\] has no 'prompt' column"):
        GroupRelativeTrainer(
            model=ending_model_dir,
            reward_funcs=LengthReward(),
            args=GroupRelativeConfig(output_dir=str(tmp_path), **SETTINGS),
            train_dataset=prompts("train", 4),
            eval_dataset={"data1": prompts("data1"), "data2": bad},
        )


@matches_trl
def test_eval_loss_is_trls_objective_on_the_sampled_completions(tmp_path, ending_model_dir):
    """TRL's `eval_loss` is its loss on each evaluation batch at the weights that sampled it:
    with "dapo" and rewards equal to the lengths, `dapo_loss` of the lengths, for TRL and for
    us, each on its own samples."""
    theirs, ours = both_trainers(tmp_path, ending_model_dir, prompts("eval"), loss_type="dapo")
    for trainer in (theirs, ours):
        metrics = trainer.evaluate()
        lengths = trainer.length_reward.lengths_of("eval")
        assert len(lengths) == PROMPTS * GROUP  # one batch
        assert len(set(lengths)) > 1  # lengths vary, so the loss is not 0
        assert metrics["eval_loss"] == pytest.approx(dapo_loss(lengths), abs=1e-5)
        assert metrics["eval_loss"] != pytest.approx(0.0, abs=1e-3)


@matches_trl
def test_load_best_model_at_end_on_eval_loss_as_trl(tmp_path, ending_model_dir):
    """metric_for_best_model="eval_loss" with load_best_model_at_end: the best checkpoint is
    the one of the lowest logged eval_loss, for TRL and for us."""
    config = dict(
        max_steps=2,
        learning_rate=1e-2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        loss_type="dapo",
    )
    for trainer in both_trainers(tmp_path, ending_model_dir, prompts("eval"), **config):
        trainer.train()
        logged = [
            (e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e
        ]
        assert [step for step, _ in logged] == [1, 2]
        best_step, best = min(logged, key=lambda entry: entry[1])
        assert trainer.state.best_metric == pytest.approx(best)
        assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
