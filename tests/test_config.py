"""GroupRelativeConfig: TRL's field names, CPU-friendly defaults, and clear errors."""

import dataclasses

import pytest
import trl
import yaml
from transformers import HfArgumentParser
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig
from trl_grpo_ext.config import NOT_IMPLEMENTED, TRL_DIFFERENCES
from trl_grpo_ext.generation import SamplingSettings
from trl_grpo_ext.objective import LossSettings

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


@matches_trl
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
        "max_prompt_length", "dynamic_sampling", "logprob_chunk_tokens",
        "max_resample_rounds", "max_staleness", "off_policy_correction", "off_policy_clip",
        "off_policy_min", "rollout_worker_threads", "tool_call_timeout", "tool_call_workers",
        "sample_with_merged_adapters",
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
        ({"steps_per_generation": 2, "generation_batch_size": 16}, "not both"),
        ({"generation_batch_size": 12, "per_device_train_batch_size": 8}, "divisible"),
        ({"temperature": 0.0}, "temperature"),
        ({"delta": 0.9}, "delta"),
        # zero divided the batch sizes; a negative count trained for no step without a word
        ({"steps_per_generation": 0}, r"steps_per_generation=0 must be >= 1"),
        ({"steps_per_generation": -2}, r"steps_per_generation=-2 must be >= 1"),
        ({"generation_batch_size": 0}, r"generation_batch_size=0 must be >= 1"),
        ({"per_device_train_batch_size": 0}, r"per_device_train_batch_size=0 must be >= 1"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0 must be >= 1"),
        ({"max_prompt_length": 0}, r"max_prompt_length=0 must be >= 1, or None"),
        ({"sample_with_merged_adapters": True}, r"'exact', 'always' or 'never'"),
    ],
)
def test_invalid_combinations_say_what_to_change(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


def test_generation_batch_size_sets_steps_per_generation(tmp_path):
    config = make(tmp_path, per_device_train_batch_size=8, generation_batch_size=32)
    assert config.steps_per_generation == 4
    assert config.prompts_per_generation == 4  # 32 completions / 8 per group


def _default(field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@matches_trl
def test_every_trl_field_exists_here_with_trls_default():
    """A TRL user's config means the same here: every field of trl.GRPOConfig exists with TRL's
    default, except the short table of documented differences."""
    ours = {field.name: field for field in dataclasses.fields(GroupRelativeConfig)}
    theirs = {field.name: field for field in dataclasses.fields(trl.GRPOConfig)}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, missing
    different = sorted(
        name
        for name, field in theirs.items()
        if _default(ours[name]) != _default(field) and name not in TRL_DIFFERENCES
    )
    assert not different, [(n, _default(ours[n]), _default(theirs[n])) for n in different]
    for name in TRL_DIFFERENCES:  # each documented difference is real
        assert name not in theirs or _default(ours[name]) != _default(theirs[name]), name
    assert set(TRL_DIFFERENCES) == {
        "max_prompt_length",
        "max_completion_length",
        "gradient_checkpointing",
    }


def test_the_coming_from_trl_page_shows_the_table_of_differences():
    import pathlib

    page = (pathlib.Path(__file__).parents[1] / "docs" / "coming-from-trl.md").read_text()
    for name, reason in TRL_DIFFERENCES.items():
        assert f"`{name}`" in page and reason in page, name
    for name, instead in NOT_IMPLEMENTED.items():
        assert f"`{name}`" in page and instead in page, name


OPEN_R1_YAML = """
model_name_or_path: OUTPUT/model
dataset_name: gsm8k
output_dir: OUTPUT/run
use_vllm: false
vllm_mode: colocate
vllm_gpu_memory_utilization: 0.7
scale_rewards: false
num_generations: 4
per_device_train_batch_size: 8
max_completion_length: 64
use_cpu: true
bf16: false
chat_template_kwargs: {enable_thinking: false}
log_completions: true
num_completions_to_print: 2
"""


@matches_trl
def test_an_open_r1_style_yaml_parses_as_in_trl(tmp_path):
    from trl import ModelConfig, TrlParser

    from trl_grpo_ext.script_args import MathScriptArguments

    path = tmp_path / "open_r1.yaml"
    path.write_text(OPEN_R1_YAML.replace("OUTPUT", str(tmp_path)))
    parser = TrlParser((MathScriptArguments, GroupRelativeConfig, ModelConfig))
    _, config, _ = parser.parse_args_and_config(
        ["--config", str(path), "--model_init_kwargs", '{"dtype": "float32"}']
    )
    assert config.use_vllm is False and config.vllm_gpu_memory_utilization == 0.7
    assert config.scale_rewards == "none"
    assert config.model_init_kwargs == {"dtype": "float32"}
    assert config.chat_template_kwargs == {"enable_thinking": False}
    (theirs,) = HfArgumentParser(trl.GRPOConfig).parse_dict(
        {
            k: v
            for k, v in yaml.safe_load(path.read_text()).items()
            if k not in ("model_name_or_path", "dataset_name")
        },
    )
    assert theirs.scale_rewards == config.scale_rewards


@pytest.mark.parametrize(
    ("value", "expected"), [(True, "group"), (False, "none"), ("true", "group"), ("false", "none")]
)
def test_scale_rewards_accepts_booleans_as_trl(tmp_path, value, expected):
    assert make(tmp_path, scale_rewards=value).scale_rewards == expected


def test_json_strings_of_dict_fields_are_parsed_or_refused_clearly(tmp_path):
    config = make(
        tmp_path, model_init_kwargs='{"dtype": "float32"}', generation_kwargs='{"top_k": 5}'
    )
    assert config.model_init_kwargs == {"dtype": "float32"}
    assert config.generation_kwargs == {"top_k": 5}
    with pytest.raises(ValueError, match="model_init_kwargs=.* not valid JSON"):
        make(tmp_path, model_init_kwargs="{dtype: float32}")
    with pytest.raises(ValueError, match="must be a mapping"):
        make(tmp_path, chat_template_kwargs="[1, 2]")


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED))
def test_unimplemented_trl_settings_are_errors_that_say_what_to_do(tmp_path, name):
    field = {f.name: f for f in dataclasses.fields(GroupRelativeConfig)}[name]
    value = {bool: True, type(None): 1}.get(type(_default(field)), 0.5)
    if name == "transformers_continuous_batching_config":
        value = {"max_batch_tokens": 8}
    with pytest.raises(
        ValueError, match=f"{name}=.*does not implement yet; {NOT_IMPLEMENTED[name][:20]}"
    ):
        make(tmp_path, **{name: value})


def test_pad_to_multiple_of_auto_pads_nowhere_but_neuron(tmp_path):
    assert make(tmp_path).pad_to_multiple_of is None
    assert make(tmp_path, pad_to_multiple_of="16").pad_to_multiple_of == 16
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        make(tmp_path, pad_to_multiple_of=0)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
@pytest.mark.parametrize("sampler", [{"use_vllm": True}, {"max_staleness": 1}])
def test_vespo_with_sequence_level_weights_is_refused_as_in_trl(tmp_path, mode, sampler):
    # TRL 1.16's GRPOTrainer raises for loss_type="vespo" with use_vllm, the correction on and a
    # mode other than token_truncate / token_mask (its default, sequence_mask, included); the
    # asynchronous worker's log-probs are corrected the same way.
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode to 'token_truncate' or"):
        make(tmp_path, loss_type="vespo", vllm_importance_sampling_mode=mode, **sampler)


def test_vespo_accepts_token_level_weights_or_no_correction(tmp_path):
    for mode in ("token_truncate", "token_mask"):
        make(tmp_path, loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode=mode)
    make(tmp_path, loss_type="vespo", use_vllm=True, vllm_importance_sampling_correction=False)
    make(tmp_path, loss_type="vespo")  # synchronous: no behaviour log-probs to correct for
    with pytest.warns(FutureWarning):
        make(tmp_path, loss_type="vespo", off_policy_correction="tis", max_staleness=1)


PREFIX = "vllm_importance_sampling_"


@pytest.mark.parametrize("sampler", [{}, {"max_staleness": 1}, {"use_vllm": True}])
@pytest.mark.parametrize(
    ("kwargs", "equivalent"),
    [
        (
            {"off_policy_correction": "mis", "off_policy_clip": 4.0},
            {"correction": True, "mode": "sequence_mask", "clip_min": 0.5, "clip_max": 4.0},
        ),
        (
            {"off_policy_clip": 5.0},  # the old default correction, "tis"
            {"correction": True, "mode": "token_truncate", "clip_min": None, "clip_max": 5.0},
        ),
        (
            {"off_policy_correction": "tis"},
            {"correction": True, "mode": "token_truncate", "clip_min": None, "clip_max": 2.0},
        ),
        ({"off_policy_correction": "none"}, {"correction": False}),
        (
            {"off_policy_min": 0.25, "off_policy_correction": "mis"},
            {"mode": "sequence_mask", "clip_min": 0.25, "clip_max": 2.0},
        ),
    ],
)
def test_deprecated_off_policy_fields_set_their_trl_equivalent_with_a_warning(
    tmp_path, sampler, kwargs, equivalent
):
    with pytest.warns(FutureWarning, match="deprecated") as warned:
        config = make(tmp_path, **kwargs, **sampler)
    (message,) = [str(w.message) for w in warned if issubclass(w.category, FutureWarning)]
    for name, value in equivalent.items():
        assert getattr(config, PREFIX + name) == value, name
        assert f"{PREFIX}{name}={value!r}" in message  # the warning says what to set instead


@pytest.mark.parametrize(
    ("kwargs", "contradicted"),
    [
        ({"off_policy_correction": "tis", PREFIX + "mode": "token_mask"}, PREFIX + "mode"),
        ({"off_policy_clip": 4.0, PREFIX + "clip_max": 2.0}, PREFIX + "clip_max"),
        ({"off_policy_correction": "tis", PREFIX + "clip_min": 0.1}, PREFIX + "clip_min"),
        ({"off_policy_correction": "mis", PREFIX + "correction": False}, PREFIX + "correction"),
        ({"off_policy_correction": "mis", PREFIX + "cap": 5.0}, PREFIX + "clip_max"),
    ],
)
def test_deprecated_off_policy_fields_that_contradict_trls_are_an_error(
    tmp_path, kwargs, contradicted
):
    with pytest.raises(ValueError, match=f"contradicts {contradicted}="):
        make(tmp_path, **kwargs)


def test_deprecated_off_policy_fields_agreeing_with_trls_are_accepted(tmp_path):
    with pytest.warns(FutureWarning):
        config = make(
            tmp_path,
            off_policy_correction="tis",
            off_policy_clip=2.5,
            **{PREFIX + "mode": "token_truncate", PREFIX + "clip_max": 2.5},
        )
    assert (config.vllm_importance_sampling_mode, config.vllm_importance_sampling_clip_max) == (
        "token_truncate",
        2.5,
    )
    with pytest.raises(ValueError, match="off_policy_clip=0.5 must be >= 1"):
        make(tmp_path, off_policy_clip=0.5)
    with pytest.raises(ValueError, match="off_policy_correction='ppo' is unknown"):
        make(tmp_path, off_policy_correction="ppo")


def test_loss_settings_come_from_the_config_whose_defaults_are_theirs(tmp_path):
    config_fields = {field.name: field for field in dataclasses.fields(GroupRelativeConfig)}
    for field in dataclasses.fields(LossSettings):
        if field.name == "max_completion_length":  # the config's is also the generation length
            continue
        name = "epsilon" if field.name == "epsilon_low" else field.name
        assert config_fields[name].default is field.default, name  # written once
    assert LossSettings.from_config(make(tmp_path)) == LossSettings(max_completion_length=256)
    config = make(
        tmp_path,
        epsilon=0.1,
        epsilon_high=0.3,
        loss_type="sapo",
        beta=0.04,
        sapo_temperature_neg=2.0,
        off_policy_mask_threshold=0.5,
        max_completion_length=16,
    )
    assert LossSettings.from_config(config) == LossSettings(
        loss_type="sapo",
        epsilon_low=0.1,
        epsilon_high=0.3,
        beta=0.04,
        sapo_temperature_neg=2.0,
        off_policy_mask_threshold=0.5,
        max_completion_length=16,
    )
    assert LossSettings.from_config(make(tmp_path, epsilon=0.1)).epsilon_high == 0.1


def test_sampling_settings_come_from_the_config_whose_defaults_are_theirs(tmp_path):
    config_fields = {field.name: field for field in dataclasses.fields(GroupRelativeConfig)}
    for field in dataclasses.fields(SamplingSettings):
        assert config_fields[field.name].default is field.default, field.name  # written once
    assert SamplingSettings.from_config(make(tmp_path)) == SamplingSettings()
    config = make(
        tmp_path,
        max_completion_length=16,
        temperature=0.7,
        top_k=20,
        min_p=0.05,
        generation_kwargs='{"stop": "</answer>"}',  # as a command line gives it
    )
    settings = SamplingSettings.from_config(config)
    assert settings == SamplingSettings(
        max_completion_length=16,
        temperature=0.7,
        top_k=20,
        min_p=0.05,
        generation_kwargs={"stop": "</answer>"},
    )
    generation = settings.generation_config(
        eos_token_id=[2], pad_token_id=0, num_return_sequences=4
    )
    assert (generation.max_new_tokens, generation.num_return_sequences) == (16, 4)
    assert (generation.temperature, generation.top_k, generation.min_p) == (0.7, 20, 0.05)
    assert generation.stop_strings == ["</answer>"] and generation.do_sample
    greedy = settings.generation_config(eos_token_id=[2], pad_token_id=0, greedy=True)
    assert not greedy.do_sample and (greedy.top_k, greedy.min_p) == (None, None)


def test_colocated_engine_settings_come_from_the_config_whose_defaults_are_theirs(tmp_path):
    from trl_grpo_ext.generation.vllm_colocate import ColocateSettings

    config_fields = {field.name: field for field in dataclasses.fields(GroupRelativeConfig)}
    for name, attribute in [
        ("vllm_gpu_memory_utilization", "gpu_memory_utilization"),
        ("vllm_max_model_length", "max_model_len"),
        ("vllm_tensor_parallel_size", "tensor_parallel_size"),
        ("vllm_enable_sleep_mode", "enable_sleep_mode"),
    ]:
        assert config_fields[name].default == getattr(ColocateSettings, attribute), name
    default = make(tmp_path)
    assert ColocateSettings.from_config(default, lora_rank=None) == ColocateSettings(
        seed=default.seed
    )
    config = make(
        tmp_path,
        seed=7,
        vllm_gpu_memory_utilization=0.5,
        vllm_max_model_length=1024,
        vllm_tensor_parallel_size=2,
    )
    assert ColocateSettings.from_config(config, lora_rank=16) == ColocateSettings(
        gpu_memory_utilization=0.5,
        max_model_len=1024,
        tensor_parallel_size=2,
        max_lora_rank=16,
        seed=7,
    )
