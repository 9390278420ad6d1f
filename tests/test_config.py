"""GroupRelativeConfig: TRL's field names, CPU-friendly defaults, and clear errors."""

import dataclasses

import pytest
import trl
import yaml
from transformers import HfArgumentParser

from trl_grpo_ext import GroupRelativeConfig

SHARED_YAML = """
output_dir: OUTPUT
num_generations: 4
max_completion_length: 32
temperature: 0.7
top_p: 0.9
top_k: 20
beta: 0.04
epsilon: 0.25
epsilon_high: 0.28
delta: 1.5
loss_type: dr_grpo
importance_sampling_level: sequence
scale_rewards: batch
reward_weights: [1.0, 0.5]
num_iterations: 2
steps_per_generation: 2
mask_truncated_completions: true
log_completions: true
shuffle_dataset: false
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
learning_rate: 0.00002
max_steps: 7
seed: 11
use_cpu: true
bf16: false
generation_kwargs: {repetition_penalty: 1.1}
"""


def make(tmp_path, **kwargs):
    return GroupRelativeConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_same_yaml_gives_the_same_values_as_trl(tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text(SHARED_YAML.replace("OUTPUT", str(tmp_path / "out")))
    (theirs,) = HfArgumentParser(trl.GRPOConfig).parse_yaml_file(str(path))
    (ours,) = HfArgumentParser(GroupRelativeConfig).parse_yaml_file(str(path))
    keys = yaml.safe_load(path.read_text())
    for key in keys:
        assert getattr(ours, key) == getattr(theirs, key), key
    # Derived values agree too.
    assert ours.generation_batch_size == theirs.generation_batch_size
    assert ours.per_device_train_batch_size == theirs.per_device_train_batch_size


def test_shared_names_mean_the_same_defaults_as_trl(tmp_path):
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    ours = make(tmp_path)
    for name in (
        "num_generations",
        "beta",
        "epsilon",
        "loss_type",
        "scale_rewards",
        "num_iterations",
        "temperature",
        "top_p",
        "importance_sampling_level",
        "learning_rate",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.epsilon_high == ours.epsilon
    trl_fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    ours_only = {field.name for field in dataclasses.fields(GroupRelativeConfig)} - trl_fields
    ours_only_expected = {
        "num_completions_to_print", "max_prompt_length", "min_p", "dynamic_sampling",
        "max_resample_rounds", "max_staleness", "off_policy_correction", "off_policy_clip",
        "off_policy_min", "rollout_worker_threads",
    }  # fmt: skip
    assert ours_only <= ours_only_expected, ours_only - ours_only_expected


def test_defaults_run_on_cpu(tmp_path):
    config = make(tmp_path)
    assert config.bf16 is False  # this machine has no GPU; TRL's default would fail here
    assert config.remove_unused_columns is False
    assert config.steps_per_generation == config.gradient_accumulation_steps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_generations": 1}, "num_generations"),
        ({"num_generations": 3, "per_device_train_batch_size": 8}, "divisible by num_generations"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"scale_rewards": "max"}, "scale_rewards"),
        ({"importance_sampling_level": "word"}, "importance_sampling_level"),
        ({"epsilon": 0.0}, "positive"),
        ({"epsilon_high": -0.1}, "positive"),
        ({"beta": -0.01}, "beta"),
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "multiple of"),
        ({"steps_per_generation": 2, "generation_batch_size": 16}, "not both"),
        ({"generation_batch_size": 12, "per_device_train_batch_size": 8}, "divisible"),
        ({"temperature": 0.0}, "temperature"),
        ({"delta": 0.9}, "delta"),
    ],
)
def test_invalid_combinations_say_what_to_change(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


def test_generation_batch_size_sets_steps_per_generation(tmp_path):
    config = make(tmp_path, per_device_train_batch_size=8, generation_batch_size=32)
    assert config.steps_per_generation == 4
    assert config.prompts_per_generation == 4  # 32 completions / 8 per group
