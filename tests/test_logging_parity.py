"""What the trainer logs, checked against trl.GRPOTrainer run side by side where it applies: the
metrics and table columns that reward functions log (`log_metric`, `log_extra`), the clip and
timing metrics, the metrics of steps without a learning signal, and the completions table sent
to the trackers in `report_to`."""

from __future__ import annotations

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


def trackio_table(project: str, run: str) -> list[dict]:
    """The rows of the last `completions` table logged to trackio (offline: its local store,
    `TRACKIO_DIR` of conftest.py)."""
    from trackio import SQLiteStorage

    tables = [
        log["completions"] for log in SQLiteStorage.get_logs(project, run) if "completions" in log
    ]
    assert tables, f"no completions table in trackio project {project!r}"
    return tables[-1]["_value"]


def test_completions_table_goes_to_trackio(tmp_path, capsys):
    pytest.importorskip("trackio")
    trainer = make_trainer(
        tmp_path,
        reward_funcs=[scored_with_logs],
        dataset=prompts(),
        log_completions=True,
        num_completions_to_print=2,
        report_to=["trackio"],
        project=f"ours-{tmp_path.name}",
        run_name="run",
        max_steps=1,
    )
    trainer.train()
    rows = trackio_table(f"ours-{tmp_path.name}", "run")
    assert len(rows) == 8  # the whole generation batch, not the printed rows
    table = trainer._last_rollout_table
    assert rows == [{"step": 1, **dict(zip(table, values))} for values in zip(*table.values())]
    assert "first_char" in capsys.readouterr().out  # printed too


def test_clip_and_time_metrics_of_every_step(tmp_path):
    """`clip_ratio/low_min`, `/high_max` and `step_time` are logged, and steps whose advantages
    are all zero log `entropy` and the clip ratios too (exactly 0: no token is clipped without an
    advantage)."""
    trainer = make_trainer(
        tmp_path, reward_funcs=lambda completions, **kwargs: [1.0] * len(completions)
    )
    trainer.train()
    for entry in trainer.state.log_history[:-1]:
        assert entry["frac_reward_zero_std"] == 1.0  # no step has a learning signal
        assert entry["entropy"] > 0 and entry["step_time"] > 0
        for key in ("low_mean", "high_mean", "region_mean", "low_min", "high_max"):
            assert entry[f"clip_ratio/{key}"] == 0.0


# Metrics of trl.GRPOTrainer that this trainer does not log on the same settings, with the reason.
NOT_LOGGED = {}


@matches_trl
def test_the_same_script_logs_trls_metrics_columns_and_table(tmp_path, tiny_model_dir):
    """trl.GRPOTrainer and ours on the same settings and reward functions: every metric TRL
    logs is logged, those of `log_metric` with the same values, and the completions table sent
    to trackio has TRL's columns."""
    import trl

    pytest.importorskip("trackio")
    common = dict(
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_strategy="no",
        log_completions=True,
        report_to=["trackio"],
        run_name="run",
        logging_steps=1,
        seed=0,
    )
    reward_funcs = [scored_with_logs, scored_with_kwargs]
    theirs = trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_funcs,
        args=trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), bf16=False, project=f"trl-{tmp_path.name}", **common
        ),
        train_dataset=prompts(),
    )
    theirs.train()
    ours = make_trainer(
        tmp_path / "ours",
        reward_funcs=reward_funcs,
        dataset=prompts(),
        peft=False,
        project=f"ours-{tmp_path.name}",
        **common,
    )
    ours.train()
    their_log, our_log = theirs.state.log_history[0], ours.state.log_history[0]
    missing = sorted(set(their_log) - set(our_log) - set(NOT_LOGGED))
    assert missing == []
    for name in ("batch/calls", "kwargs/completions"):
        assert our_log[name] == their_log[name], name
    assert their_log["batch/calls"] == 2.0 and their_log["kwargs/completions"] == 4.0
    their_rows = trackio_table(f"trl-{tmp_path.name}", "run")
    our_rows = trackio_table(f"ours-{tmp_path.name}", "run")
    assert len(our_rows) == len(their_rows) == 4
    assert list(our_rows[0]) == list(their_rows[0])  # step, prompt, completion, ..., advantage
    assert [row["prompt"] for row in our_rows] == [row["prompt"] for row in their_rows]


def test_log_unique_prompts_sends_each_prompt_once(tmp_path):
    trackio = pytest.importorskip("trackio")
    from types import SimpleNamespace

    from trl_grpo_ext.metrics import log_completions

    table = {"prompt": ["a", "a", "b", "b"], "completion": ["1", "2", "3", "4"], "r": [0.0] * 4}
    args = SimpleNamespace(
        report_to=["trackio"], log_unique_prompts=True, num_completions_to_print=0
    )
    trackio.init(project=f"unique-{tmp_path.name}", name="run")
    log_completions({**table, "advantage": [0.0] * 4}, 3, args)
    trackio.finish()
    rows = trackio_table(f"unique-{tmp_path.name}", "run")
    assert [(row["step"], row["prompt"], row["completion"]) for row in rows] == [
        (3, "a", "1"),
        (3, "b", "3"),
    ]
