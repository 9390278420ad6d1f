"""The memory plan: phases against hand computation on the tiny model's config, the directions
a user expects (more rows or tokens never need less, checkpointing lowers the backward pass),
and the recipe's `--plan`, its refusal of a run that will not fit, and the override. The plan
against measured peaks is `benchmarks/memory_plan.py` (docs/benchmarks.md)."""

import dataclasses
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_recipe import ROOT, parser, recipe

from trl_grpo_ext import GroupRelativeConfig, MemoryPlan, plan_memory
from trl_grpo_ext import memory_plan as memory_plan_module
from trl_grpo_ext.memory_plan import adapter_parameters, check_fits, kv_cache_bytes
from trl_grpo_ext.tiny import build_tiny_model

TINY_CPU = os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def tiny_config():
    return build_tiny_model().config


def config(tmp_path, **fields):
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_prompt_length=32,
        max_completion_length=16,
        report_to="none",
    )
    return GroupRelativeConfig(**{**values, **fields})


def lora(**fields):
    return LoraConfig(
        **{"r": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **fields}
    )


def test_kv_cache_bytes_are_layers_x_2_x_kv_heads_x_head_dim_x_rows_x_tokens_x_bytes(tiny_config):
    # the tiny model: 2 layers, 2 key-value heads of 16
    assert kv_cache_bytes(tiny_config, rows=8, tokens=48) == 2 * 2 * 2 * 16 * 8 * 48 * 4
    assert kv_cache_bytes(tiny_config, 8, 48, torch.bfloat16) == 2 * 2 * 2 * 16 * 8 * 48 * 2


def test_the_sampling_phase_holds_the_generation_batchs_kv_cache(tmp_path, tiny_config):
    short = plan_memory(config(tmp_path), tiny_config, lora(), device="cpu")
    longer = plan_memory(
        config(tmp_path, max_completion_length=48), tiny_config, lora(), device="cpu"
    )
    # 32 more tokens in each of 8 rows; the prompts' pass and the step's logits stay as they are
    grown = kv_cache_bytes(tiny_config, 8, 80) - kv_cache_bytes(tiny_config, 8, 48)
    assert longer.phases["sampling"] - short.phases["sampling"] == grown
    assert longer.phases["weights"] == short.phases["weights"]


@pytest.mark.parametrize(
    "targets", ["all-linear", ["q_proj", "v_proj"], r".*\.mlp\.(up|down)_proj"], ids=str
)
def test_the_adapter_is_counted_as_peft_counts_it(targets):
    model = build_tiny_model()
    expected, _ = get_peft_model(model, lora(target_modules=targets)).get_nb_trainable_parameters()
    assert adapter_parameters(model.config, lora(target_modules=targets)) == expected


def test_a_vision_language_model_counts_its_vision_tower_and_adapts_its_language_model(tmp_path):
    from trl_grpo_ext.models import language_model_lora
    from trl_grpo_ext.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm()
    peft_model = get_peft_model(model, language_model_lora(model, lora()))
    expected, total = peft_model.get_nb_trainable_parameters()
    assert adapter_parameters(model.config, lora()) == expected
    plan = plan_memory(config(tmp_path), model.config, lora(), device="cpu")
    assert plan.phases["weights"] == 4 * total  # the vision tower's weights included


def test_weights_and_optimizer_against_hand_computation(tmp_path, tiny_config):
    parameters = sum(p.numel() for p in build_tiny_model().parameters())
    adapter = adapter_parameters(tiny_config, lora())
    plan = plan_memory(config(tmp_path), tiny_config, lora(), device="cpu")
    assert plan.phases["weights"] == 4 * parameters + 4 * adapter
    # + AdamW's two float32 states and a float32 gradient per adapter parameter
    assert plan.phases["optimizer"] == plan.phases["weights"] + 12 * adapter
    full = plan_memory(config(tmp_path, beta=0.04), tiny_config, device="cpu")
    # full fine-tuning with beta > 0: a reference copy, and every parameter trained
    assert full.phases["weights"] == 2 * 4 * parameters
    assert full.phases["optimizer"] == full.phases["weights"] + 12 * parameters
    assert plan_memory(config(tmp_path, bf16=True), tiny_config, lora()).phases["weights"] == (
        2 * parameters + 4 * adapter  # PEFT keeps the adapter in float32
    )


@pytest.mark.parametrize(
    "field, small, large",
    [
        ("per_device_train_batch_size", 4, 16),
        ("max_completion_length", 16, 256),
        ("max_prompt_length", 16, 512),
        ("num_generations", 8, 4),  # the same rows in fewer, larger prompt passes
    ],
)
def test_more_rows_or_tokens_never_need_less(tmp_path, tiny_config, field, small, large):
    plans = [
        plan_memory(config(tmp_path, **{field: value}), tiny_config, lora(), device="cpu")
        for value in (small, large)
    ]
    assert all(plans[1].phases[name] >= plans[0].phases[name] for name in plans[0].phases)
    assert plans[1].peak_bytes >= plans[0].peak_bytes


def test_gradient_checkpointing_lowers_the_backward_phase(tmp_path, tiny_config):
    fields = dict(max_completion_length=256)
    kept = plan_memory(config(tmp_path, **fields), tiny_config, lora(), device="cpu")
    checkpointed = plan_memory(
        config(tmp_path, gradient_checkpointing=True, **fields), tiny_config, lora(), device="cpu"
    )
    assert checkpointed.phases["backward"] < kept.phases["backward"]
    assert checkpointed.phases["sampling"] == kept.phases["sampling"]
    assert kept.peak_phase == "backward" and "gradient_checkpointing=True" in kept.advice


def test_a_colocated_vllm_engine_holds_its_share(tmp_path, tiny_config):
    share = int(0.3 * 80 * 2**30)
    fields = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    awake = plan_memory(
        config(tmp_path, **fields), tiny_config, lora(), "cuda", device_bytes=80 * 2**30
    )
    assert all(value > share for value in awake.phases.values())  # held in every phase
    assert "vllm_gpu_memory_utilization" in awake.advice
    fields["vllm_enable_sleep_mode"] = True  # released while training
    asleep = plan_memory(
        config(tmp_path, **fields), tiny_config, lora(), "cuda", device_bytes=80 * 2**30
    )
    assert asleep.peak_phase == "sampling"
    assert asleep.phases["sampling"] == awake.phases["sampling"]
    assert asleep.phases["backward"] < share
    assert "vllm_gpu_memory_utilization" in asleep.advice


def test_the_table_marks_the_peak_phase(tmp_path, tiny_config):
    plan = plan_memory(config(tmp_path), tiny_config, lora(), device="cpu")
    assert isinstance(plan, MemoryPlan) and plan.peak_bytes == max(plan.phases.values())
    lines = plan.table().splitlines()
    peak = [line for line in lines if "<- peak" in line]
    assert len(peak) == 1 and peak[0].startswith(plan.peak_phase)
    assert {line.split()[0] for line in lines[2:-1]} == set(plan.phases)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.peak_bytes = 0


def test_a_plan_that_fits_is_not_refused_and_one_that_does_not_names_what_to_change(
    tmp_path, tiny_config
):
    plan = plan_memory(config(tmp_path), tiny_config, lora(), device="cpu")
    check_fits(plan, plan.peak_bytes)  # exactly enough: runs
    with pytest.raises(ValueError, match=f"in the {plan.peak_phase} phase") as error:
        check_fits(plan, plan.peak_bytes - 1)
    assert plan.advice in str(error.value) and "--ignore_memory_plan" in str(error.value)
    check_fits(plan, plan.peak_bytes - 1, ignore=True)  # the override


def recipe_arguments(tiny_model_dir, tmp_path, *extra):
    argv = [
        "--config", TINY_CPU,
        "--model_name_or_path", tiny_model_dir,
        "--output_dir", str(tmp_path / "run"),
        "--num_train_samples", "16",
        "--num_eval_samples", "4",
        *extra,
    ]  # fmt: skip
    return parser().parse_args_and_config(argv)


def test_the_recipes_plan_flag_prints_the_plan_and_loads_no_weights(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    def no_weights(*args, **kwargs):
        raise AssertionError("--plan loaded the model's weights")

    monkeypatch.setattr(recipe.AutoModelForCausalLM, "from_pretrained", no_weights)
    assert recipe.main(*recipe_arguments(tiny_model_dir, tmp_path, "--plan", "true")) is None
    printed = capsys.readouterr().out
    assert "memory plan (cpu, predicted;" in printed and "<- peak" in printed


def test_the_recipe_stops_before_loading_a_run_that_will_not_fit(
    tiny_model_dir, tmp_path, monkeypatch
):
    def no_weights(*args, **kwargs):
        raise AssertionError("the recipe loaded weights for a run that does not fit")

    monkeypatch.setattr(recipe.AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setattr(memory_plan_module, "free_bytes", lambda device: 2**20)  # 1 MiB free
    with pytest.raises(
        ValueError, match="will not fit.*backward phase.*gradient_checkpointing=True"
    ):
        recipe.main(*recipe_arguments(tiny_model_dir, tmp_path))
    # --ignore_memory_plan goes on to load the model
    with pytest.raises(AssertionError, match="loaded weights"):
        recipe.main(*recipe_arguments(tiny_model_dir, tmp_path, "--ignore_memory_plan", "true"))
