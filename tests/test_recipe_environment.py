"""`--environment` of the math recipe and `trl-grpo-ext grpo`: the flag parses (a reasoning-gym
task, a mix, weights, a dotted path), the held-out split never repeats a training question,
an unknown task is a clear error, the environment's reward scores the held-out evaluation, and
the tiny model trains on a reasoning-gym task end to end."""

import os

import pytest

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is not installed (pip install '.[environments]')"
)

from reasoning_gym.utils import extract_answer  # noqa: E402
from test_recipe import ROOT, TINY_OVERRIDES, parser, recipe  # noqa: E402

from trl_grpo_ext.cli import parse_run  # noqa: E402
from trl_grpo_ext.evaluation import read_jsonl, score_completions  # noqa: E402
from trl_grpo_ext.script_args import (  # noqa: E402
    environment_accuracy,
    load_environment,
    load_rewards,
    reasoning_gym_tasks,
)

SMALL_SUMS = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'


def arguments(*flags):
    script_args, training_args, *_ = parser().parse_args_and_config(
        ["--output_dir", "unused", *flags]
    )
    return script_args, training_args


def test_the_flag_names_a_task_a_mix_or_weights():
    assert reasoning_gym_tasks("reasoning_gym:chain_sum") == "chain_sum"
    assert reasoning_gym_tasks("reasoning_gym:chain_sum, leg_counting") == [
        "chain_sum",
        "leg_counting",
    ]
    assert reasoning_gym_tasks("reasoning_gym:chain_sum=3,leg_counting=1") == {
        "chain_sum": 3.0,
        "leg_counting": 1.0,
    }
    with pytest.raises(ValueError, match="names no task"):
        reasoning_gym_tasks("reasoning_gym:")
    with pytest.raises(ValueError, match="TASK=WEIGHT"):
        reasoning_gym_tasks("reasoning_gym:chain_sum=3,leg_counting=x")


def test_the_cli_and_the_yaml_pass_the_environment_and_its_settings(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "environment: reasoning_gym:chain_sum\n"
        "environment_config: {max_terms: 2, max_digits: 1}\n"
        "output_dir: runs/x\n"
    )
    (script_args, *_), launch, _ = parse_run(["--config", str(config)], "grpo")
    assert script_args.environment == "reasoning_gym:chain_sum" and not launch
    script_args.num_train_samples, script_args.num_eval_samples = 20, 10
    _, training_args = arguments()
    rows = load_environment(script_args, training_args)["train_dataset"]
    expected = reasoning_gym.create_dataset(
        "chain_sum", size=20, seed=training_args.seed, max_terms=2, max_digits=1
    )
    assert [row["prompt"][-1]["content"] for row in rows] == [e["question"] for e in expected]
    # A flag beats the YAML; JSON on the command line.
    (script_args, *_), _, _ = parse_run(
        ["--config", str(config), "--environment_config", '{"max_terms": 3}'], "grpo"
    )
    assert script_args.environment_config == '{"max_terms": 3}'


def test_the_held_out_split_never_repeats_a_training_question():
    # Two-digit sums of two terms: about 40,000 problems, some drawn twice among 600.
    script_args, training_args = arguments(
        "--environment", "reasoning_gym:chain_sum", "--environment_config", SMALL_SUMS,
        "--num_train_samples", "400", "--num_eval_samples", "200",
    )  # fmt: skip
    kwargs = load_environment(script_args, training_args)
    train = [p[-1]["content"] for p in kwargs["train_dataset"]["prompt"]]
    held_out = [p[-1]["content"] for p in kwargs["eval_dataset"]["prompt"]]
    assert len(train) == 400 and len(held_out) == 200
    assert not set(train) & set(held_out) and len(set(held_out)) == 200
    # One-digit sums: too few distinct problems for 200 unseen ones, refused with what to change.
    script_args.environment_config = '{"min_terms": 2, "max_terms": 2, "max_digits": 1}'
    with pytest.raises(ValueError, match="differ from the 400 training ones.*environment_config"):
        load_environment(script_args, training_args)


def test_an_unknown_task_or_spec_is_a_clear_error():
    script_args, training_args = arguments("--environment", "reasoning_gym:chain_summ")
    with pytest.raises(
        ValueError, match=r"no reasoning-gym task named \['chain_summ'\].*chain_sum"
    ):
        load_environment(script_args, training_args)
    script_args.environment = "chain_sum"
    with pytest.raises(ValueError, match="reasoning_gym:TASK"):
        load_environment(script_args, training_args)
    script_args.environment, script_args.environment_config = "reasoning_gym:chain_sum", "{max"
    with pytest.raises(ValueError, match="environment_config must be a JSON object"):
        load_environment(script_args, training_args)


def test_a_dotted_path_is_found_in_the_working_directory_and_gets_its_settings(
    tmp_path, monkeypatch
):
    (tmp_path / "my_gym_env.py").write_text(
        "from trl_grpo_ext.environments import from_reasoning_gym\n"
        "def make(args, size=4):\n"
        "    kwargs = from_reasoning_gym('leg_counting', size=size, seed=args.seed, eval_size=2)\n"
        "    kwargs['reward_weights'] = [0.5]\n"
        "    return kwargs\n"
        "NOT_A_DICT = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    script_args, training_args = arguments(
        "--environment", "my_gym_env.make", "--environment_config", '{"size": 6}'
    )
    kwargs = load_environment(script_args, training_args)
    assert len(kwargs["train_dataset"]) == 6 and len(kwargs["eval_dataset"]) == 2
    assert training_args.reward_weights == [0.5] and "reward_weights" not in kwargs
    script_args.environment, script_args.environment_config = "my_gym_env:NOT_A_DICT", None
    with pytest.raises(TypeError, match="expected a dict of the trainer's keyword arguments"):
        load_environment(script_args, training_args)


def test_the_environments_reward_scores_the_evaluation_and_replaces_the_math_default():
    script_args, training_args = arguments(
        "--environment", "reasoning_gym:chain_sum", "--environment_config", SMALL_SUMS,
        "--num_train_samples", "8", "--num_eval_samples", "4",
    )  # fmt: skip
    kwargs = load_environment(script_args, training_args)
    accuracy = environment_accuracy(kwargs)
    rewards = load_rewards(script_args, kwargs["reward_funcs"])
    assert [r.__name__ for r in rewards] == ["reasoning_gym"]  # the math default left out
    script_args.reward_funcs = ["answer_tags"]
    assert [r.__name__ for r in load_rewards(script_args, kwargs["reward_funcs"])] == [
        "reasoning_gym",
        "answer_tags",
    ]
    rows = kwargs["eval_dataset"]
    answers = list(rows["answer"])
    # Right in tags, right without tags (math_accuracy's 1, reasoning-gym's 0), wrong in tags.
    completions = [f"<answer>{answers[0]}</answer>", answers[1], "<answer>1000</answer>"]
    columns = {
        "prompts": rows["prompt"][:3],
        "reasoning_gym_index": rows[:3]["reasoning_gym_index"],
    }
    strict, lenient = score_completions(
        completions, answers[:3], truncated=[False, False, True], accuracy=accuracy, columns=columns
    )
    assert lenient == [1.0, 0.0, 0.0] and strict == [1.0, 0.0, 0.0]
    assert extract_answer(completions[1]) is None
    assert score_completions(completions, answers[:3])[1][1] == 1.0  # math_accuracy: right


def test_the_tiny_model_trains_on_a_reasoning_gym_task_end_to_end(tmp_path):
    argv = [
        "--config", os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml"),
        *TINY_OVERRIDES,
        "--environment", "reasoning_gym:chain_sum", "--environment_config", SMALL_SUMS,
        "--num_eval_samples", "8", "--max_steps", "2", "--eval_every_steps", "1",
        "--reward_funcs", "answer_tags", "--keep_best", "false",
        "--output_dir", str(tmp_path / "run"),
        "--tiny_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    trainer, before, after = recipe.main(*parser().parse_args_and_config(argv))
    assert "reasoning_gym_index" in trainer.train_dataset.column_names
    assert len(trainer.train_dataset) == 64 and before.num_problems == after.num_problems == 8
    records = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    rewards = {key for r in records for key in r if key.endswith("/mean")}
    assert {"rewards/reasoning_gym/mean", "rewards/answer_tags/mean"} <= rewards
    assert [r["heldout/label"] for r in records if "heldout/label" in r] == [
        "before",
        "periodic",
        "after",
    ]
    for sample in after.samples:  # scored by reasoning-gym: never right outside answer tags
        assert extract_answer(sample["completion"]) is not None or not sample["correct"]
