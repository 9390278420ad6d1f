"""The shortcuts of sampling and of the log-probs hold on the layer kinds users train: full
attention (Llama), sliding-window attention over every layer (Mistral) or some (Gemma 3, OLMo 3),
and hybrids of attention and recurrent layers (Qwen3.5's linear attention, Falcon-H1's
state-space layers beside attention). Each is checked against a plain forward pass of whole
rows, with rows longer than the windows: a group's rows packed into one sequence only where
every layer attends as the packed mask says, a prompt's cache repeated for its group and
finished rows leaving the batch where the cache's rows can be selected (hybrids' recurrent
states included), for the caches `cache_implementation` (TRL's option) picks too. A training step then runs on each, and moves
the adapter only."""

import pytest
import torch
from peft import LoraConfig
from test_logprobs import assert_matches_full_logits, batch
from trainer_helpers import make_trainer
from transformers import AutoConfig, AutoModelForCausalLM

from trl_grpo_ext.generation import compacting, sampling_config
from trl_grpo_ext.generation.transformers_engine import generate_with_transformers, seeded
from trl_grpo_ext.logprobs import _shared_prompt_logits, token_logprobs
from trl_grpo_ext.tiny import build_tiny_tokenizer

VOCAB, WINDOW = 64, 6
PAD, ENDS = 0, [1, 3, 4, 5, 6]  # a few end tokens, so that rows finish at different steps
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    initializer_range=0.2,
    pad_token_id=PAD,
    eos_token_id=1,
    bos_token_id=2,
)
# name: (model_type, config fields, whether a group's rows of 14 tokens are packed under SDPA's
# attention by blocks, and under eager attention)
ARCHITECTURES = {
    "llama": ("llama", {}, (True, True)),
    "mistral, rows inside the window": ("mistral", {"sliding_window": 32}, (True, True)),
    "mistral, rows past the window": ("mistral", {"sliding_window": WINDOW}, (True, False)),
    "gemma3, sliding and full layers": (
        "gemma3_text",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        (True, False),
    ),
    "olmo3, sliding and full layers": (
        "olmo3",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        (True, False),
    ),
    "qwen3.5, linear attention and full layers": (
        "qwen3_5_text",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        (False, False),
    ),
    "falcon-h1, state-space beside attention": (
        "falcon_h1",
        {
            "mamba_d_ssm": 32,
            "mamba_n_heads": 4,
            "mamba_d_head": 8,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        (False, False),
    ),
}


def build(name, attention="sdpa", **overrides):
    """The model and whether its group rows are packed, under `attention`."""
    model_type, fields, packed = ARCHITECTURES[name]
    try:
        config = AutoConfig.for_model(model_type, **{**SMALL, **overrides}, **fields)
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.eval(), packed[attention == "eager"]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_logprobs_and_gradients_match_whole_rows(name, attention):
    model, packed = build(name, attention)
    inputs = batch(VOCAB, 3, 4)  # three prompts of 10 tokens, four completions of 4 each
    assert inputs[0].shape[1] > WINDOW
    assert (_shared_prompt_logits(model, *inputs[:2], inputs[2].shape[1]) is not None) == packed
    model.train()  # as the trainer runs the policy
    assert_matches_full_logits(model, inputs, logprob_chunk_tokens=5)


def completion_mask(completion_ids):
    """1 up to and including each row's first end token."""
    ends = torch.isin(completion_ids, torch.tensor(ENDS)).long()
    return (ends.cumsum(1) - ends == 0).long()


def sample(model, compact=True, cache_implementation=None, temperature=1.0):
    """Four completions of at most 12 tokens (rows of 18, three times the window) for each of
    three prompts of 6 tokens, the first left-padded, seeded: `generate_with_transformers`'s
    (prompt ids, prompt mask, completion ids, sampled log-probs)."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(7, VOCAB, (3, 6), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, :2], prompt_mask[0, :2] = PAD, 0
    config = sampling_config(
        max_new_tokens=12,
        eos_token_id=ENDS,
        pad_token_id=PAD,
        num_return_sequences=4,
        temperature=temperature,
        cache_implementation=cache_implementation,  # TRL's option, for generate's cache
    )
    with seeded(5):
        return generate_with_transformers(
            model,
            prompt_ids,
            prompt_mask,
            generation_config=config,
            return_logprobs=True,
            compact_finished_rows=compact,
        )


def assert_logprobs_of_a_forward_pass(model, sampled, temperature=1.0):
    """The sampled tokens' log-probs are those of one forward pass over the whole rows, up to
    and including each row's end."""
    ids, mask, completion_ids, logps = sampled
    kept = completion_mask(completion_ids)
    assert 0 < kept.sum() < kept.numel()  # some rows ended early
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([ids, completion_ids], 1),
            attention_mask=torch.cat([mask, kept], 1),
        ).logits[:, ids.shape[1] - 1 : -1]
    want = token_logprobs(logits, completion_ids, temperature)
    torch.testing.assert_close(logps * kept, want * kept, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name, cache_implementation",
    [(name, None) for name in ARCHITECTURES]
    + [
        (name, cache)
        for name in ("llama", "gemma3, sliding and full layers")
        for cache in ("dynamic", "static")
    ],
)
def test_sampled_logprobs_are_those_of_a_forward_pass(name, cache_implementation):
    model, _ = build(name)
    rows = []  # of each forward pass, sampling with compaction
    record = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    compacted = sample(model, True, cache_implementation, temperature=0.9)
    record.remove()
    every_row = sample(model, False, cache_implementation, temperature=0.9)
    assert torch.equal(compacted[2], every_row[2])
    # Each prompt encoded once, finished rows leaving, where the cache's rows can be selected:
    # all but a static cache.
    levers = cache_implementation != "static"
    assert (rows[0] == 3) == levers  # the first pass: the 3 prompts, or their 12 rows
    # (transformers before 5.24 samples with `generate` itself: every row to the end)
    assert (min(rows[1:]) < 12) == (levers and compacting.can_compact(model))
    assert_logprobs_of_a_forward_pass(model, compacted, temperature=0.9)
    assert_logprobs_of_a_forward_pass(model, every_row, temperature=0.9)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_one_training_step_moves_the_adapter_only(name, tmp_path):
    tokenizer = build_tiny_tokenizer()
    model, _ = build(
        name,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    base = {k: v.clone() for k, v in model.state_dict().items()}
    # the attention projections every kind has (PEFT refuses LoRA on Mamba's out_proj)
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        peft_config=adapter,
        max_steps=1,
        max_completion_length=8,
    )
    trainer.train()
    weights = trainer.model.state_dict()
    trained = [k for k, v in weights.items() if "lora_B" in k and v.abs().sum() > 0]
    assert trained  # lora_B starts at zero
    for key, value in weights.items():
        if "lora_" not in key:
            assert torch.equal(
                value, base[key.replace("base_model.model.", "").replace(".base_layer", "")]
            ), key


TEXT = {k: v for k, v in SMALL.items() if k != "bos_token_id"}
# Vision-language models on text-only rows: name -> (model_type, config fields)
VISION_LANGUAGE = {
    "qwen2.5-vl, rotary offsets kept on the model": (
        "qwen2_5_vl",
        {
            "text_config": {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": 32,
            },
        },
    ),
    "gemma3, sliding and full layers": (
        "gemma3",
        {
            "text_config": {
                **TEXT,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            "mm_tokens_per_image": 4,
        },
    ),
}


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
def test_vision_language_models_on_text_rows(name):
    """Packed log-probs and sampled log-probs as a forward pass of whole rows: Qwen2.5-VL keeps
    each prompt's rotary offset on the model between `generate` calls, repeated for the group."""
    from transformers import AutoModelForImageTextToText

    model_type, fields = VISION_LANGUAGE[name]
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    for parameter_name, parameter in model.named_parameters():  # no image: no gradient there
        if "language_model" not in parameter_name and "lm_head" not in parameter_name:
            parameter.requires_grad_(False)
    inputs = batch(VOCAB, 3, 4)
    assert _shared_prompt_logits(model, *inputs[:2], inputs[2].shape[1]) is not None  # packed
    assert_matches_full_logits(model, inputs, logprob_chunk_tokens=5)

    assert_logprobs_of_a_forward_pass(model, sample(model))


def test_qwen_vl_with_images_drops_finished_rows_with_their_rotary_offsets():
    """Qwen2.5-VL with images: each prompt's rotary offset differs (-2 per image here), kept on
    the model and folded into the 3D position ids `generate` carries; finished rows leave the
    batch with their position ids, the same tokens as every row running to the end, and the
    sampled log-probs are a forward pass's of whole rows with their images."""
    from transformers import AutoModelForImageTextToText

    image, group = 60, 4
    model_type, fields = VISION_LANGUAGE["qwen2.5-vl, rotary offsets kept on the model"]
    vision_ids = dict(image_token_id=image, video_token_id=61, vision_start_token_id=62)
    try:
        config = AutoConfig.for_model(model_type, **fields, **vision_ids, vision_end_token_id=63)
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    # prompt i holds i images of 4 tokens each (4 x 4 patches, merged 2 x 2); the first is padded
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(7, 56, (3, 14), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, :3], prompt_mask[0, :3] = PAD, 0
    prompt_ids[1, 5:9] = prompt_ids[2, 4:8] = prompt_ids[2, 9:13] = image
    vision = model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = torch.randn(3, 16, patch, generator=generator)  # (images, patches, features)
    images_of = [[], [0], [1, 2]]
    image_inputs = {
        "pixel_values": pixel_values.flatten(0, 1),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * 3),
        "mm_token_type_ids": (prompt_ids == image).long(),
    }
    config = sampling_config(
        max_new_tokens=12,
        eos_token_id=ENDS,
        pad_token_id=PAD,
        num_return_sequences=group,
        temperature=0.9,
        generation_kwargs={"suppress_tokens": [60, 61, 62, 63]},  # no image token sampled
    )
    rows = []  # of each forward pass
    record = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    sampled = {}
    for compact in (True, False):
        rows.clear()
        with seeded(5):
            sampled[compact] = generate_with_transformers(
                model,
                prompt_ids,
                prompt_mask,
                generation_config=config,
                return_logprobs=True,
                image_inputs=image_inputs,
                compact_finished_rows=compact,
            )
        # (transformers before 5.24 samples with `generate` itself: every row to the end)
        dropped = min(rows[1:]) < 3 * group
        assert rows[0] == 3 and dropped == (compact and compacting.can_compact(model))
    record.remove()
    assert model.model.rope_deltas.flatten().tolist() == [0] * 4 + [-2] * 4 + [-4] * 4
    assert torch.equal(sampled[True][2], sampled[False][2])

    ids, mask, completion_ids, _ = sampled[True]
    kept = completion_mask(completion_ids)
    rows_images = [k for prompt in range(3) for _ in range(group) for k in images_of[prompt]]
    full = torch.cat([ids, completion_ids], 1)
    with torch.no_grad():
        logits = model(
            input_ids=full,
            attention_mask=torch.cat([mask, kept], 1),
            pixel_values=pixel_values[rows_images].flatten(0, 1),
            image_grid_thw=torch.tensor([[1, 4, 4]] * len(rows_images)),
            mm_token_type_ids=(full == image).long(),
        ).logits[:, ids.shape[1] - 1 : -1]
    # the behaviour log-probs are under the distribution sampled from: the suppressed image
    # tokens out, the rest renormalised (docs/async.md)
    logits[..., [60, 61, 62, 63]] = float("-inf")
    want = token_logprobs(logits, completion_ids, 0.9)
    for logps in (sampled[True][3], sampled[False][3]):
        torch.testing.assert_close(logps * kept, want * kept, atol=1e-5, rtol=1e-5)
