"""Compiled decoding (`generation.compiled_decoding`), CUDA's default, here on the CPU with
compiling forced (`CompileConfig._compile_all_devices`, as `generate` takes it) and torch's
`eager` backend: dynamo traces and guards each shape as on a GPU, without the minutes inductor
takes on a CPU (the `slow` test runs inductor). A run over prompts of many lengths and batches of
other sizes compiles at most one graph per bucket, and none again when the shapes come back;
greedy tokens are those of uncompiled decoding; the sampled tokens' log-probs are those of an
uncompiled pass over them; settings that ask otherwise, and setups where it cannot run, keep
the dynamic path, the reason logged once."""

import contextlib
import logging
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters
from transformers import CompileConfig

from trl_grpo_ext.generation import PromptEncoder, compiled_decoding, sampling_config
from trl_grpo_ext.generation.compiled_decoding import DecodingShape, bucket, decoding_shape
from trl_grpo_ext.generation.rollout import completion_mask_from_ids
from trl_grpo_ext.generation.transformers_engine import (
    TransformersEngine,
    generate_with_transformers,
    seeded,
)
from trl_grpo_ext.logprobs import completion_logprobs
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

MAX_NEW_TOKENS = 8
PROMPTS = ["1+2=", "10+17=", "what is 123+456?", "7*8=", "99-1 is", "5*5="]


@pytest.fixture
def tiny():
    """A model of its own for each test: `generate` keeps the longest static cache it has made
    on the model, and dynamo's graphs start from none."""
    torch._dynamo.reset()
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    return model.eval(), tokenizer


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(compiled_decoding, "_said", set())


def forced(backend="eager") -> CompileConfig:
    """`generate`'s compile config for every device, one graph per shape."""
    compile_config = CompileConfig(backend=backend, dynamic=False, mode=None)
    compile_config._compile_all_devices = True
    return compile_config


def config(tokenizer, group_size=1, greedy=False, **generation_kwargs):
    return sampling_config(
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=group_size,
        greedy=greedy,
        generation_kwargs=generation_kwargs,
    )


def graphs() -> int:
    """The graphs dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


def test_buckets_hold_their_values_with_at_most_a_third_of_padding():
    assert [bucket(value) for value in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    for value in range(1, 5000):
        assert value <= bucket(value) and (bucket(value) - value) * 3 < bucket(value)
    # a handful of buckets however many sizes: 24 for every size up to 4096
    assert len({bucket(value) for value in range(1, 4097)}) == 24
    assert decoding_shape(rows=14, prompt_length=37, max_new_tokens=256) == DecodingShape(16, 384)
    with pytest.raises(ValueError):
        bucket(0)


def test_a_run_of_many_prompt_lengths_and_batch_sizes_compiles_once_per_bucket(tiny):
    """Training batches (1 prompt x 2 completions) of prompts of five lengths, then evaluation
    batches of another size (greedy, 3 prompts): at most one graph per (rows, cache length)
    bucket, where compiling each shape met would compile more; run again, nothing compiles."""
    model, tokenizer = tiny
    encoder = PromptEncoder(tokenizer)
    prompts = [f"{'9' * digits}+1=" for digits in range(1, 6)]  # 4 to 8 tokens
    batches = [([prompt], 2, False) for prompt in prompts]
    batches += [(prompts[:3], 1, True), (prompts[2:], 1, True)]
    encoded = [(encoder.encode(rows), group, greedy) for rows, group, greedy in batches]
    shapes = {(len(ids) * group, ids.shape[1]) for (ids, _), group, _ in encoded}
    buckets = {decoding_shape(rows, length, MAX_NEW_TOKENS) for rows, length in shapes}
    bound = len({shape.rows for shape in buckets}) * len({shape.cache_length for shape in buckets})
    assert len(shapes) > bound  # a graph per shape met would be more than the buckets allow

    def run():
        for index, (prompts, group, greedy) in enumerate(encoded):
            settings = config(tokenizer, group, greedy, compile_config=forced())
            with seeded(index):
                out = generate_with_transformers(model, *prompts, generation_config=settings)
            assert out[2].shape[0] == len(prompts[0]) * group  # the padded rows dropped

    before = graphs()
    run()
    compiled = graphs() - before
    assert 1 <= compiled <= bound
    run()  # every shape again: a shape compiling again fails here
    assert graphs() - before == compiled


def test_greedy_tokens_are_those_of_uncompiled_decoding(tiny):
    """Five prompts of several lengths: six rows compiled (one a padded copy), a static cache
    of a bucket's length, in one graph (no break); the tokens are those of the dynamic cache,
    uncompiled."""
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS[:5])
    caches = []  # (rows, positions) of the KV cache of each forward pass

    def cache_shape(module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        caches.append(tuple(cache.layers[0].keys.shape[::2]))  # (rows, heads, positions, dim)

    hook = model.register_forward_hook(cache_shape, with_kwargs=True)
    before = graphs()
    compiled = generate_with_transformers(
        model, *prompts, generation_config=config(tokenizer, greedy=True, compile_config=forced())
    )
    hook.remove()
    assert graphs() > before  # the compiled call decoded
    # the batch's size: 6 rows, the 16 tokens of the longest prompt and 8 new ones in 24
    # positions, not the model's 2,048
    assert prompts[0].shape == (5, 16) and model.config.max_position_embeddings == 2048
    assert set(caches) == {(6, 24)}
    plain = generate_with_transformers(
        model, *prompts, generation_config=config(tokenizer, greedy=True, disable_compile=True)
    )
    assert graphs() == before + 1
    for got, want in zip(compiled, plain):
        assert torch.equal(got, want)


def test_the_engine_compiles_once_for_its_batches_with_merged_adapters_and_float32_head(tiny):
    """`TransformersEngine`, as the trainer samples: each batch in a block that merges the LoRA
    adapters and computes the head in float32 (new tensors each time); batches of one shape
    compile one graph, and later batches none."""
    model, tokenizer = tiny
    adapters = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(model, adapters).eval()  # B != 0: the adapters move the outputs
    engine = TransformersEngine(
        lambda: contextlib.nullcontext(model),
        cast_lm_head_to_fp32=True,
        merge_adapters="exact",
        pack_weights=False,  # oneDNN's CPU layout, which a GPU has not
    )
    prompts = PromptEncoder(tokenizer).encode(PROMPTS[:2])
    before = graphs()
    for seed in range(3):
        engine.generate(*prompts, config(tokenizer, group_size=2, compile_config=forced()), seed)
        assert graphs() == before + 1


def assert_logprobs_of_an_uncompiled_pass(model, tokenizer, sampled, tolerance):
    """The log-probs returned with the sampled tokens against the trainer's uncompiled pass
    over prompt and completion (`completion_logprobs`), up to each completion's end."""
    prompt_ids, prompt_mask, completion_ids, logps = sampled
    mask, _ = completion_mask_from_ids(completion_ids, [tokenizer.eos_token_id])  # (N, T)
    with torch.no_grad():
        want = completion_logprobs(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, mask], dim=1),
            completion_ids,
        )  # (N, T)
    assert mask.sum() > len(mask)  # several tokens a row
    torch.testing.assert_close(logps * mask, want * mask, rtol=tolerance, atol=tolerance)


def test_sampled_logprobs_are_those_of_an_uncompiled_pass(tiny):
    """Five prompts x 3 completions: 15 rows compiled as 16; each sampled token's log-prob from
    the compiled steps within float32 rounding of the uncompiled pass over the completion."""
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS[:5])
    before = graphs()
    with seeded(2):
        sampled = generate_with_transformers(
            model,
            *prompts,
            generation_config=config(tokenizer, group_size=3, compile_config=forced()),
            return_logprobs=True,
        )
    assert graphs() > before
    assert sampled[2].shape == (15, MAX_NEW_TOKENS) and sampled[3].shape == (15, MAX_NEW_TOKENS)
    assert torch.equal(sampled[0], prompts[0].repeat_interleave(3, dim=0))
    assert_logprobs_of_an_uncompiled_pass(model, tokenizer, sampled, 1e-5)


def test_settings_that_ask_otherwise_and_setups_without_it_sample_dynamically(
    tiny, monkeypatch, caplog
):
    """`disable_compile` and an explicit `cache_implementation` are used as given (TRL's
    behaviour); a CPU without forcing, ZeRO-3 and an old torch fall back to the dynamic cache
    with the reason logged once, and sample what the dynamic path samples."""
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS[:3])
    inputs = {"input_ids": prompts[0], "attention_mask": prompts[1]}
    caplog.set_level(logging.INFO, logger=compiled_decoding.__name__)
    for settings in ({"disable_compile": True}, {"cache_implementation": "dynamic"}):
        assert not compiled_decoding.runs(
            model, config(tokenizer, compile_config=forced(), **settings), inputs
        )
    assert caplog.records == []  # the user's choice: nothing to say

    def sample(settings):
        with seeded(4):
            return generate_with_transformers(model, *prompts, generation_config=settings)

    dynamic = sample(config(tokenizer, group_size=2, disable_compile=True))
    before = graphs()
    assert torch.equal(sample(config(tokenizer, group_size=2))[2], dynamic[2])  # on the CPU
    assert torch.equal(sample(config(tokenizer, group_size=2))[2], dynamic[2])
    monkeypatch.setattr(compiled_decoding, "is_deepspeed_zero3_enabled", lambda: True)
    for _ in range(2):
        got = sample(config(tokenizer, group_size=2, compile_config=forced()))
        assert torch.equal(got[2], dynamic[2])
    monkeypatch.setattr(compiled_decoding, "is_deepspeed_zero3_enabled", lambda: False)
    images = {**inputs, "pixel_values": torch.zeros(3, 4)}
    assert not compiled_decoding.runs(model, config(tokenizer, compile_config=forced()), images)
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    assert not compiled_decoding.runs(model, config(tokenizer, compile_config=forced()), inputs)
    assert graphs() == before
    said = [
        (record.levelname, record.getMessage())
        for record in caplog.records
        if record.name == compiled_decoding.__name__
    ]
    assert said == [
        ("INFO", "Compiled decoding is off (the model is on cpu, not CUDA): the dynamic cache "
         "samples."),
        ("WARNING", "Compiled decoding is off (the model is sharded (ZeRO-3 or FSDP), whose "
         "ranks decode in step): the dynamic cache samples."),
        ("WARNING", "Compiled decoding is off (the prompts carry pixel_values, whose rows are not "
         "bucketed): the dynamic cache samples."),
        ("WARNING", "Compiled decoding is off (torch 2.5.1+cu124 is older than 2.6): the dynamic "
         "cache samples."),
    ]  # fmt: skip


@pytest.mark.slow  # inductor compiles C++ on a CPU: about a minute
def test_inductor_compiled_decoding_keeps_greedy_tokens_and_logprobs(tiny):
    """With torch's inductor backend (what a GPU runs, there with CUDA graphs): the greedy tokens
    of uncompiled decoding, and sampled tokens' log-probs within float32 rounding."""
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS[:5])
    compile_config = forced("inductor")
    compiled = generate_with_transformers(
        model,
        *prompts,
        generation_config=config(tokenizer, greedy=True, compile_config=compile_config),
    )
    plain = generate_with_transformers(
        model, *prompts, generation_config=config(tokenizer, greedy=True, disable_compile=True)
    )
    assert torch.equal(compiled[2], plain[2])
    with seeded(2):
        sampled = generate_with_transformers(
            model,
            *prompts,
            generation_config=config(tokenizer, group_size=1, compile_config=compile_config),
            return_logprobs=True,
        )
    assert not math.isnan(float(sampled[3].sum()))
    assert_logprobs_of_an_uncompiled_pass(model, tokenizer, sampled, 1e-4)
