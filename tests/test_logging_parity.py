"""What the trainer logs, checked against trl.GRPOTrainer run side by side where it applies: the
metrics and table columns that reward functions log (`log_metric`, `log_extra`), the clip and
timing metrics, the metrics of steps without a learning signal, and the completions table sent
to the trackers in `report_to`."""

from __future__ import annotations

import glob
import os

import pandas
import pytest
import torch
from datasets import Dataset
from trainer_helpers import make_trainer
from trl_reference import matches_trl


def scored_with_logs(prompts, completions, log_metric, log_extra, **kwargs):
    """A reward in TRL 1.16's convention that takes `log_metric` and `log_extra` by name:
    two metric values per call (mean 2.0), and one table column."""
    log_metric("batch/calls", 1.0)
    log_metric("batch/calls", 3.0)
    log_extra("first_char", [completion[:1] for completion in completions])
    return [float(len(completion) % 2) for completion in completions]


def scored_with_kwargs(completions, **kwargs):
    """The same, reading the loggers from `kwargs` as some TRL scripts do."""
    kwargs["log_metric"]("kwargs/completions", float(len(completions)))
    return [0.0] * len(completions)


def prompts(count: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"What is {a}+{a}?"} for a in range(count)])


def test_reward_functions_log_metrics_and_table_columns(tmp_path):
    trainer = make_trainer(
        tmp_path,
        reward_funcs=[scored_with_logs, scored_with_kwargs],
        dataset=prompts(),
        log_completions=True,
        max_steps=2,
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["batch/calls"] == 2.0  # the mean of the values logged in the step
    assert logged["kwargs/completions"] == 8.0  # 2 prompts x 4 completions per step
    table = trainer._last_rollout_table
    assert list(table) == [
        "prompt", "completion", "scored_with_logs", "scored_with_kwargs", "first_char", "advantage"
    ]  # fmt: skip
    assert table["first_char"] == [completion[:1] for completion in table["completion"]]


def test_reward_logs_average_over_processes_as_trl():
    """TRL's flush: the names of all processes, then sum over count of all values."""
    from trl_grpo_ext.metrics import RewardLogs

    here, there = RewardLogs(), RewardLogs()
    here.log_metric("a", 1.0)
    here.log_metric("a", 2.0)
    there.log_metric("a", 6.0)
    there.log_metric("b", 4.0)
    names = lambda names: sorted(set(here.metrics) | set(there.metrics))  # noqa: E731
    rows = {}

    def gather(sums):  # what accelerator.gather returns on either process
        rows.setdefault("here", sums)
        other = torch.tensor([[6.0, 1.0], [4.0, 1.0]], dtype=sums.dtype)
        return torch.cat([sums, other])

    assert here.take_metrics(names, gather) == {"a": 3.0, "b": 4.0}  # (1 + 2 + 6) / 3
    assert rows["here"].tolist() == [[3.0, 2.0], [0.0, 0.0]]  # "b": nothing logged here
    assert here.metrics == {}


def test_a_log_extra_column_of_the_wrong_length_is_an_error():
    from trl_grpo_ext.metrics import RewardLogs

    logs = RewardLogs()
    logs.log_extra("c", [1, 2, 3])
    with pytest.raises(ValueError, match="log_extra\\('c', ...\\) was given 3 values .* 4"):
        logs.take_extra(4)


def test_evaluation_logs_the_reward_metrics_with_the_eval_prefix(tmp_path):
    trainer = make_trainer(tmp_path, reward_funcs=[scored_with_logs], dataset=prompts())
    metrics = trainer.evaluate(prompts(4))
    assert metrics["eval_batch/calls"] == 2.0
    assert trainer.reward_logs.metrics == {} and trainer.reward_logs.extra == {}


@matches_trl
def test_the_same_reward_logs_the_same_metrics_and_columns_in_trl(tmp_path, tiny_model_dir):
    import trl

    common = dict(
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        report_to="none",
        save_strategy="no",
        log_completions=True,
        seed=0,
    )
    reward_funcs = [scored_with_logs, scored_with_kwargs]
    theirs = trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_funcs,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, **common),
        train_dataset=prompts(),
    )
    theirs.train()
    ours = make_trainer(
        tmp_path / "ours",
        reward_funcs=reward_funcs,
        dataset=prompts(),
        peft=False,
        **{**common, "report_to": "none"},
    )
    ours.train()
    their_log, our_log = theirs.state.log_history[0], ours.state.log_history[0]
    for name in ("batch/calls", "kwargs/completions"):
        assert our_log[name] == their_log[name], name
    assert their_log["batch/calls"] == 2.0 and their_log["kwargs/completions"] == 4.0
    (parquet,) = glob.glob(os.path.join(tmp_path, "trl", "completions", "*.parquet"))
    their_columns = list(pandas.read_parquet(parquet).columns)
    our_columns = ["step", *ours._last_rollout_table]  # TRL's table starts with the step
    assert our_columns == their_columns
