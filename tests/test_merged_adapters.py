"""Sampling with the LoRA adapters merged into the base weights (`generation.merged_adapters`):
the same tokens and log-probs as the adapters unmerged, the base weights the same bits after,
and no merge where it would not be exact enough."""

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GenerationConfig

from trl_grpo_ext.generation import PromptEncoder
from trl_grpo_ext.generation.merged_adapters import merged_lora
from trl_grpo_ext.generation.transformers_engine import (
    TransformersEngine,
    generate_with_transformers,
    seeded,
)
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

PROMPTS = ["1+2=", "10+17=", "3+3=?"]


def lora_model(dtype=torch.float32, seed=0, **lora_kwargs):
    """The tiny model with LoRA on all linear layers, its B matrices random (not PEFT's zeros),
    so that the adapters change every layer's output."""
    model, tokenizer = tiny_model_and_tokenizer(seed=seed)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", **lora_kwargs
    )
    model = get_peft_model(model.to(dtype), config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    return model.eval(), tokenizer


def sampling(tokenizer, max_new_tokens=12, num_return_sequences=4) -> GenerationConfig:
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def merged_states(model) -> list[bool]:
    """Whether the first LoRA layer was merged, at each of its forward passes from now on."""
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    seen, forward = [], layer.forward

    def spy(*args, **kwargs):
        seen.append(layer.merged)
        return forward(*args, **kwargs)

    layer.forward = spy
    return seen


class Policy:
    """The engines' policy: a block that yields `model`."""

    def __init__(self, model):
        self.model = model

    def __call__(self):
        return self

    def __enter__(self):
        return self.model

    def __exit__(self, *exc):
        return False


def sample(model, tokenizer, seed=0, merge=None):
    config = sampling(tokenizer)
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    with merge if merge is not None else torch.no_grad(), seeded(seed):
        _, _, completion_ids, logps = generate_with_transformers(
            model, prompt_ids, prompt_mask, generation_config=config, return_logprobs=True
        )
    return completion_ids, logps


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_merged_sampling_draws_the_same_tokens_and_log_probs():
    model, tokenizer = lora_model()
    before = base_weights(model)
    unmerged_ids, unmerged_logps = sample(model, tokenizer)
    merge = merged_lora(model)
    merged_ids, merged_logps = sample(model, tokenizer, merge=merge)

    assert torch.equal(merged_ids, unmerged_ids)
    torch.testing.assert_close(merged_logps, unmerged_logps, atol=1e-5, rtol=1e-5)
    # The adapters matter here: without them, other log-probs.
    with model.disable_adapter():
        base_ids, base_logps = sample(model, tokenizer)
    assert not torch.allclose(base_logps, unmerged_logps, atol=1e-2)
    # The base weights are the same bits afterwards, and the layers unmerged again.
    after = base_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert torch.equal(sample(model, tokenizer)[1], unmerged_logps)


def test_inside_the_block_the_layers_use_the_merged_weights():
    model, _ = lora_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    original = layer.base_layer.weight.detach().clone()
    x = torch.randn(3, original.shape[1])
    expected = layer(x)
    with merged_lora(model) as merged:
        assert merged
        want = original + layer.get_delta_weight("default")
        assert torch.equal(layer.base_layer.weight, want)  # W + s B A, out of place
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.base_layer.weight, original)


def test_an_error_while_sampling_still_restores_the_base_weights():
    model, _ = lora_model()
    before = base_weights(model)
    with pytest.raises(RuntimeError, match="sampling failed"):
        with merged_lora(model):
            raise RuntimeError("sampling failed")
    after = base_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not any(getattr(m, "merged", False) for m in model.modules())


@pytest.mark.parametrize(
    "dtype, lora_kwargs, reason",
    [
        (torch.bfloat16, {}, "bfloat16"),
        (torch.float32, {"use_dora": True}, "variant"),
        pytest.param(
            torch.float32,
            {"lora_bias": True},
            "lora_bias",
            # PEFT's own note that such adapters cannot be merged: what this case checks
            marks=pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed"),
        ),
    ],
)
def test_no_merge_where_it_is_not_exact_enough(dtype, lora_kwargs, reason, caplog):
    model, _ = lora_model(dtype, **lora_kwargs)
    before = base_weights(model)
    with caplog.at_level(logging.INFO, logger="trl_grpo_ext.generation.merged_adapters"):
        with merged_lora(model) as merged:
            assert not merged
            layer = model.base_model.model.model.layers[0].self_attn.q_proj
            assert not layer.merged
    assert "unmerged" in caplog.text and reason in caplog.text
    after = base_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_quantized_models_sample_unmerged(caplog):
    model, _ = lora_model()
    model.is_loaded_in_4bit = True  # as transformers marks a bitsandbytes 4-bit model
    with caplog.at_level(logging.INFO, logger="trl_grpo_ext.generation.merged_adapters"):
        with merged_lora(model) as merged:
            assert not merged
    assert "4-bit or 8-bit" in caplog.text


def test_a_model_without_adapters_is_left_alone():
    model, _ = tiny_model_and_tokenizer(seed=0)
    with merged_lora(model) as merged:
        assert not merged


def test_the_transformers_engine_samples_merged_with_the_same_tokens(caplog):
    model, tokenizer = lora_model()
    before = base_weights(model)
    config = sampling(tokenizer)
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    seen = merged_states(model)
    merged = TransformersEngine(Policy(model)).generate(prompt_ids, prompt_mask, config, seed=3)
    unmerged = TransformersEngine(Policy(model), merge_adapters="never").generate(
        prompt_ids, prompt_mask, config, seed=3
    )
    assert seen and all(seen[: len(seen) // 2]) and not any(seen[len(seen) // 2 :])
    assert torch.equal(merged[2], unmerged[2])
    after = base_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_merge_when_asked_rounded_once(dtype):
    """`sample_with_merged_adapters="always"`: bf16 and fp16 weights are merged too, `W + s B A`
    summed in float32 and rounded once; the base weights are the same bits afterwards, and the
    log-probs of the same tokens stay close to the unmerged adapters' (the rounding moves them)."""
    model, tokenizer = lora_model(dtype)
    before = base_weights(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    original = layer.base_layer.weight.detach().clone()
    with merged_lora(model) as merged:
        assert not merged  # not by default
    with merged_lora(model, low_precision=True) as merged:
        assert merged and layer.merged
        want = (original.float() + layer.get_delta_weight("default").float()).to(dtype)
        assert torch.equal(layer.base_layer.weight, want)
    assert torch.equal(layer.base_layer.weight, original) and not layer.merged
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        unmerged = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        with merged_lora(model, low_precision=True):
            merged = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    moved = (merged - unmerged).abs()
    assert 0 < moved.max() < 0.5
    after = base_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_the_trainer_samples_merged_in_bf16_when_asked(tmp_path):
    from trl_grpo_ext import GroupRelativeConfig
    from trl_grpo_ext.generation.engines import build_engine
    from trl_grpo_ext.generation.settings import EngineSettings

    model, tokenizer = lora_model(torch.bfloat16)
    seen = merged_states(model)
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    config = sampling(tokenizer, max_new_tokens=4, num_return_sequences=1)
    for setting, expected in [("exact", False), ("always", True), ("never", False)]:
        args = GroupRelativeConfig(
            output_dir=str(tmp_path), sample_with_merged_adapters=setting, report_to=[]
        )
        settings = EngineSettings.from_config(args)
        engine = build_engine(settings, Policy(model), lambda: model, None, 4, tokenizer)
        engine.generate(prompt_ids, prompt_mask, config, seed=1)
        assert seen and all(merged is expected for merged in seen), setting
        seen.clear()


@pytest.mark.parametrize("setting, merged", [("exact", True), ("never", False)])
def test_the_asynchronous_worker_samples_merged_as_the_engine_does(setting, merged):
    """The asynchronous rollout worker's sampling (`process_worker.sample_batch`, which runs in
    its process) merges as `sample_with_merged_adapters` says, with the same tokens and
    behaviour log-probs either way in float32."""
    from trl_grpo_ext.generation.process_worker import sample_batch

    model, tokenizer = lora_model()
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    config = sampling(tokenizer, max_new_tokens=8, num_return_sequences=2)
    want = sample_batch(model, prompts, config, 3, merge_adapters="never")
    seen = merged_states(model)
    got = sample_batch(model, prompts, config, 3, merge_adapters=setting)
    assert seen and all(state is merged for state in seen)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=1e-5)
