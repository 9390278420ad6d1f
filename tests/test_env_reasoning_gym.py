"""`from_reasoning_gym`: reasoning-gym's tasks as the trainer's dataset, and its own scoring as
the reward, equal to `score_answer(extract_answer(completion), entry)` on the same completions."""

import pytest

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is not installed (pip install '.[environments]')"
)

from agent_helpers import ScriptedEngine, encode  # noqa: E402
from reasoning_gym.composite import DatasetSpec  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402
from trainer_helpers import make_trainer  # noqa: E402

from trl_grpo_ext.environments import from_reasoning_gym  # noqa: E402
from trl_grpo_ext.scoring import call_reward_funcs  # noqa: E402


def completions_for(entries):
    """For each entry: its answer in tags, a wrong one, no tags, extra text around the answer,
    and the answer twice in tags (the last counts)."""
    texts = []
    for entry in entries:
        answer = str(entry["answer"])
        texts += [
            f"Thinking... <answer>{answer}</answer>",
            "<answer>definitely not it</answer>",
            answer,
            f"<answer>The answer is {answer}</answer>",
            f"<answer>x</answer> then <answer>{answer}</answer>",
        ]
    return texts


def score(arguments, completions, indices):
    rows = arguments["train_dataset"]
    return call_reward_funcs(
        arguments["reward_funcs"],
        prompts=[rows[i]["prompt"] for i in indices],
        completions=completions,
        completion_ids=[[0]] * len(completions),
        **{name: [rows[i][name] for i in indices] for name in rows.column_names},
    )[:, 0].tolist()


@pytest.mark.parametrize("name", ["leg_counting", "basic_arithmetic", "word_sorting"])
def test_rows_and_rewards_equal_reasoning_gyms_own(name):
    arguments = from_reasoning_gym(name, size=4, seed=3)
    source = reasoning_gym.create_dataset(name, size=4, seed=3)
    entries = list(source)
    rows = arguments["train_dataset"]
    assert len(rows) == 4
    for row, entry in zip(rows, entries):
        assert row["prompt"] == [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": entry["question"]},
        ]
        assert row["answer"] == str(entry["answer"])
        assert row["task"] == name
    completions = completions_for(entries)
    indices = [i for i in range(4) for _ in range(5)]
    expected = [
        source.score_answer(extract_answer(text), entry=entries[i])
        for text, i in zip(completions, indices)
    ]
    assert score(arguments, completions, indices) == pytest.approx(expected)
    assert expected[0] == 1.0 and expected[1] < 1.0 and expected[2] == 0.0  # by hand
    assert arguments["reward_funcs"][0].__name__ == "reasoning_gym"


def test_config_passes_through_to_create_dataset():
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    rows = from_reasoning_gym("basic_arithmetic", size=3, seed=0, **config)["train_dataset"]
    source = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=0, **config)
    assert [r["prompt"][1]["content"] for r in rows] == [e["question"] for e in source]


def test_a_mix_is_reasoning_gyms_composite_and_each_row_scored_by_its_task():
    weights = {"leg_counting": 1.0, "basic_arithmetic": 3.0}
    arguments = from_reasoning_gym(weights, size=12, seed=5, basic_arithmetic={"max_terms": 2})
    source = reasoning_gym.create_dataset(
        "composite",
        size=12,
        seed=5,
        datasets=[
            DatasetSpec("leg_counting", 1.0, {}),
            DatasetSpec("basic_arithmetic", 3.0, {"max_terms": 2}),
        ],
    )
    entries = list(source)
    rows = arguments["train_dataset"]
    assert rows["task"] == [e["metadata"]["source_dataset"] for e in entries]
    assert set(rows["task"]) == set(weights)
    completions = completions_for(entries)
    indices = [i for i in range(12) for _ in range(5)]
    expected = [
        source.score_answer(extract_answer(text), entry=entries[i])
        for text, i in zip(completions, indices)
    ]
    assert score(arguments, completions, indices) == pytest.approx(expected)
    # a list is an equal-weight mix
    listed = from_reasoning_gym(["leg_counting", "basic_arithmetic"], size=6, seed=1)
    equal = reasoning_gym.create_dataset(
        "composite",
        size=6,
        seed=1,
        datasets=[DatasetSpec("leg_counting", 1.0, {}), DatasetSpec("basic_arithmetic", 1.0, {})],
    )
    assert listed["train_dataset"]["answer"] == [str(e["answer"]) for e in equal]


def test_system_prompt_by_name_or_text():
    direct = from_reasoning_gym("leg_counting", size=1, system_prompt="direct")["train_dataset"]
    assert direct[0]["prompt"][0]["content"] == SYSTEM_PROMPTS["direct"]
    own = from_reasoning_gym("leg_counting", size=1, system_prompt="Reply in <answer> tags.")
    assert own["train_dataset"][0]["prompt"][0]["content"] == "Reply in <answer> tags."


def test_eval_rows_follow_the_training_rows():
    arguments = from_reasoning_gym("leg_counting", size=3, seed=2, eval_size=2)
    source = reasoning_gym.create_dataset("leg_counting", size=5, seed=2)
    questions = [e["question"] for e in source]
    assert [r["prompt"][1]["content"] for r in arguments["train_dataset"]] == questions[:3]
    assert [r["prompt"][1]["content"] for r in arguments["eval_dataset"]] == questions[3:]
    assert arguments["eval_dataset"]["reasoning_gym_index"] == [3, 4]


@pytest.mark.parametrize(
    ("names", "config", "error", "message"),
    [
        ("no_such_task", {}, ValueError, "no reasoning-gym task named"),
        (42, {}, TypeError, "expected a task name"),
        ({"leg_counting": 0}, {}, ValueError, "expected > 0"),
        ([], {}, ValueError, "empty"),
        (["leg_counting", "chain_sum"], {"max_terms": 3}, ValueError, "names a task of the mix"),
    ],
)
def test_wrong_inputs_are_clear_errors(names, config, error, message):
    with pytest.raises(error, match=message):
        from_reasoning_gym(names, size=2, **config)


def test_the_trainer_scores_its_rollouts_with_the_adapters_reward(tmp_path):
    arguments = from_reasoning_gym("leg_counting", size=2, seed=0)
    rows = arguments["train_dataset"]
    first = rows[0]["answer"]
    trainer = make_trainer(
        tmp_path,
        dataset=rows,
        reward_funcs=arguments["reward_funcs"],
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=32,
        max_prompt_length=None,
        max_steps=1,
    )
    tokenizer = trainer.processing_class
    trainer.rollouts.engine = ScriptedEngine([encode(tokenizer, f"<answer>{first}</answer>")])
    rollout = trainer.generate_rollouts([rows[0], rows[1]])
    rewards = trainer.score_rollouts(rollout)[:, 0].tolist()
    source = reasoning_gym.create_dataset("leg_counting", size=2, seed=0)
    text = rollout.completions[0]
    text = text if isinstance(text, str) else text[-1]["content"]
    expected = [source.score_answer(extract_answer(text), entry=source[i]) for i in (0, 0, 1, 1)]
    assert rewards == pytest.approx(expected)
    assert rewards[:2] == [1.0, 1.0]
