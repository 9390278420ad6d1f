"""Finished rows leave the batch while sampling (`generation.compacting`): the same completions
and behaviour log-probs as running every row to the end, for the same seed, under each
generation setting, and fewer rows in each forward pass once rows have finished; each token drawn
from the processed distribution (inverse transform sampling, against a slow reference and by
frequency)."""

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import CompileConfig

from trl_grpo_ext.generation import PromptEncoder, sampling_config
from trl_grpo_ext.generation.compacting import _next_tokens, sample_by_inversion
from trl_grpo_ext.generation.rollout import completion_mask_from_ids
from trl_grpo_ext.generation.transformers_engine import (
    TransformersEngine,
    generate_with_transformers,
    seeded,
)
from trl_grpo_ext.tiny import tiny_model_and_tokenizer
from trl_grpo_ext.tiny_vlm import tiny_vlm_and_processor

PROMPTS = ["1+2=", "10+17=", "3+3=?"]
# The tiny model's random weights sample nearly uniformly over its 259 tokens: with 20 more end
# tokens about one row in 13 ends at each step, so rows end all through the batch.
MANY_ENDS = list(range(20))


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    return model.eval(), tokenizer


class RowsPerPass:
    """Counts the rows of each forward pass (a hook on the first decoder layer)."""

    def __init__(self, layer):
        self.rows = []
        self.handle = layer.register_forward_hook(
            lambda _, args, __: self.rows.append(len(args[0]))
        )

    def take(self) -> list[int]:
        rows, self.rows = self.rows, []
        return rows


def sample(model, prompts, config, compact, seed=3, **kwargs):
    with seeded(seed):
        return generate_with_transformers(
            model,
            *prompts,
            generation_config=config,
            return_logprobs=True,
            compact_finished_rows=compact,
            **kwargs,
        )


def assert_same(got, want, ends, group_size):
    """The same tokens (padding after each end included), and the same log-probs up to each
    completion's end; after it, the log-probs are no part of the completion."""
    for got_ids, want_ids in zip(got[:3], want[:3]):
        assert torch.equal(got_ids, want_ids)
    mask = running_mask(want[2], ends, group_size)
    torch.testing.assert_close(got[3] * mask, want[3] * mask, rtol=1e-5, atol=1e-5)


def running_mask(completion_ids, ends, group_size, pad=None):
    """1 where a row is still sampling: up to its first end token and, with `pad`, up to the
    last token before the padding that follows a stop string. With G > 1 the first token does
    not count: it is sampled from the prompts' pass, and the rows' own loop starts after it."""
    if group_size == 1:
        mask, _ = completion_mask_from_ids(completion_ids, ends)  # (N, T)
    else:
        mask, _ = completion_mask_from_ids(completion_ids[:, 1:], ends)  # (N, T - 1)
        mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)  # (N, T)
    if pad is not None:
        mask = mask * (completion_ids != pad).cummin(dim=1).values
    return mask


SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top-p, top-k": dict(temperature=1.0, top_p=0.9, top_k=20),
    "min-p, repetition penalty": dict(min_p=0.05, repetition_penalty=1.3),
    "min_new_tokens": dict(generation_kwargs={"min_new_tokens": 6}),
    "suppressed tokens": dict(generation_kwargs={"suppress_tokens": [21, 22, 23]}),
}


@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_completions_and_logprobs_as_running_every_row(tiny, setting, group_size):
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    ends = [tokenizer.eos_token_id, *MANY_ENDS]
    config = sampling_config(
        max_new_tokens=24,
        eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=group_size,
        **SETTINGS[setting],
    )
    counter = RowsPerPass(model.model.layers[0])
    want = sample(model, prompts, config, compact=False)
    full_rows = counter.take()
    got = sample(model, prompts, config, compact=True)
    rows = counter.take()
    assert_same(got, want, ends, group_size)
    lengths = completion_mask_from_ids(want[2], ends)[0].sum(1)
    assert lengths.min() < want[2].shape[1]  # some rows end before the last step
    assert sum(rows) < sum(full_rows)
    if "min_new_tokens" in setting:
        assert lengths.min() >= 6


def test_finished_rows_leave_the_batch_at_the_next_pass(tiny):
    """After the prompts' pass (B rows) and the first pass of the B*G rows, each forward pass
    holds exactly the rows still sampling: those whose end lies beyond the token it samples."""
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    ends = [tokenizer.eos_token_id, *MANY_ENDS]
    config = sampling_config(
        max_new_tokens=30,
        eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=4,
    )
    counter = RowsPerPass(model.model.layers[0])
    completion_ids = sample(model, prompts, config, compact=True)[2]  # (12, T)
    rows = counter.take()
    lengths = running_mask(completion_ids, ends, 4).sum(1)  # tokens each row sampled itself
    assert rows[0] == len(PROMPTS)
    assert rows[1:] == [int((lengths > step).sum()) for step in range(1, len(rows))]
    assert rows[-1] < rows[1] == 12


def test_stop_strings_end_rows_as_before(tiny):
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    ends = [tokenizer.eos_token_id]
    config = sampling_config(
        max_new_tokens=30,
        eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=4,
        generation_kwargs={"stop_strings": ["a", "1", "e"]},
    )
    counter = RowsPerPass(model.model.layers[0])
    want = sample(model, prompts, config, compact=False, tokenizer=tokenizer)
    full_rows = counter.take()
    got = sample(model, prompts, config, compact=True, tokenizer=tokenizer)
    assert sum(counter.take()) < sum(full_rows)
    for got_ids, want_ids in zip(got[:3], want[:3]):
        assert torch.equal(got_ids, want_ids)
    mask = running_mask(want[2], ends, 4, pad=tokenizer.pad_token_id)
    torch.testing.assert_close(got[3] * mask, want[3] * mask, rtol=1e-5, atol=1e-5)


def test_greedy_decoding_drops_rows_too(tiny):
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    ends = [tokenizer.eos_token_id, *range(60)]
    config = sampling_config(
        max_new_tokens=20, eos_token_id=ends, pad_token_id=tokenizer.pad_token_id, greedy=True
    )
    want = sample(model, prompts, config, compact=False)
    got = sample(model, prompts, config, compact=True)
    assert_same(got, want, ends, 1)


def test_rows_stay_without_an_end_token(tiny):
    """Without an end-of-sequence token `generate` keeps sampling after a stop string: no row
    leaves the batch, and the tokens are the same."""
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    config = sampling_config(
        max_new_tokens=12,
        eos_token_id=[],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=2,
        generation_kwargs={"stop_strings": ["a", "1"]},
    )
    config.eos_token_id = None
    counter = RowsPerPass(model.model.layers[0])
    want = sample(model, prompts, config, compact=False, tokenizer=tokenizer)
    full_rows = counter.take()
    got = sample(model, prompts, config, compact=True, tokenizer=tokenizer)
    assert counter.take() == full_rows
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)


def test_prompts_with_images(tiny):
    """The tiny VLM: the group's rows continue from the prompts' cache without the images, and
    leave the batch as they finish, with the same tokens."""
    model, processor = tiny_vlm_and_processor(seed=0, initializer_range=0.2)
    model.eval()
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    images = [[Image.new("RGB", (20, 30), color)] for color in [(255, 0, 0), (0, 0, 255)]]
    encoded = processor(text=[text, text], images=images, return_tensors="pt")
    prompts = encoded.pop("input_ids"), encoded.pop("attention_mask")
    tokenizer = processor.tokenizer
    ends = [tokenizer.eos_token_id, *MANY_ENDS]
    config = sampling_config(
        max_new_tokens=20,
        eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=4,
    )
    language_model = model.model.language_model
    counter = RowsPerPass(language_model.layers[0])
    want = sample(model, prompts, config, compact=False, image_inputs=dict(encoded))
    full_rows = counter.take()
    got = sample(model, prompts, config, compact=True, image_inputs=dict(encoded))
    assert sum(counter.take()) < sum(full_rows)
    assert_same(got, want, ends, 4)


@pytest.mark.parametrize("lora", [None, "plain", "CAUSAL_LM"])
def test_the_engine_drops_finished_rows_by_default(lora):
    """Also under LoRA (the trainer's policy, sampled with its adapters merged), with PEFT's
    plain `PeftModel` and with `task_type="CAUSAL_LM"` (TRL's `get_peft_config`), whose
    `PeftModelForCausalLM` prepares the inputs of each step itself."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    layer = model.model.layers[0]
    if lora:
        task_type = {"task_type": lora} if lora != "plain" else {}
        config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], **task_type)
        model = get_peft_model(model, config)
    model.eval()
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    config = sampling_config(
        max_new_tokens=24,
        eos_token_id=[tokenizer.eos_token_id, *MANY_ENDS],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=4,
    )
    counter = RowsPerPass(layer)
    engines = {
        compact: TransformersEngine(lambda: contextlib.nullcontext(model), **options)
        for compact, options in [(True, {}), (False, {"compact_finished_rows": False})]
    }
    got = engines[True].generate(*prompts, config, seed=5)
    rows = counter.take()
    want = engines[False].generate(*prompts, config, seed=5)
    assert sum(rows) < sum(counter.take())
    assert torch.equal(got[2], want[2])


def test_without_a_cache_every_row_runs_as_in_generate(tiny):
    model, tokenizer = tiny
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    ends = [tokenizer.eos_token_id, *MANY_ENDS]
    config = sampling_config(
        max_new_tokens=10,
        eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=2,
        generation_kwargs={"use_cache": False},
    )
    want = sample(model, prompts, config, compact=False)
    got = sample(model, prompts, config, compact=True)
    assert_same(got, want, ends, 1)  # no prompts' cache to share: one loop samples it all


def test_a_static_cache_decodes_with_the_compiled_forward_as_generate_does(tiny, monkeypatch):
    """A static cache with a `compile_config` (on a GPU, a static cache alone) has `generate`
    compile the decoding steps' forward; the engine's loop runs them through the same call."""
    model, tokenizer = tiny
    calls = []

    def compiled_call(compile_config):  # stands in for torch.compile's wrapper
        def call(*args, **kwargs):
            calls.append(compile_config)
            return model.__call__(*args, **kwargs)

        return call

    monkeypatch.setattr(model, "get_compiled_call", compiled_call, raising=False)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # as on a GPU, where a static cache compiles
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    options = dict(
        max_new_tokens=8,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=2,
    )
    static = {"cache_implementation": "static"}
    plain = sample(model, prompts, sampling_config(**options, generation_kwargs=static), True)
    assert calls == []  # without a compile config, not on a CPU
    config = sampling_config(
        **options, generation_kwargs={**static, "compile_config": compile_config}
    )
    got = sample(model, prompts, config, compact=True)
    # every decoding step after the prompts' pass, through the compiled call
    assert len(calls) == got[2].shape[1] - 1
    assert all(call._compile_all_devices for call in calls)  # the config given
    assert all(torch.equal(a, b) for a, b in zip(got[:3], plain[:3]))
    calls.clear()
    with seeded(3):
        model.generate(input_ids=prompts[0], attention_mask=prompts[1], generation_config=config)
    assert len(calls) == got[2].shape[1] - 1  # transformers' own loop: the same calls
    # TRL's generation config turns compiling off: `disable_compile`, its opt-out here
    calls.clear()
    off = {**static, "compile_config": compile_config, "disable_compile": True}
    got = sample(model, prompts, sampling_config(**options, generation_kwargs=off), True)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(got[:3], plain[:3]))


def inverse_cdf_reference(weights: list[float], uniform: float) -> int:
    """The first token whose running sum of weights exceeds `uniform` times their total, one
    addition at a time in Python floats (float64)."""
    total = sum(weights)
    running = 0.0
    for token, weight in enumerate(weights):
        running += weight
        if running > uniform * total:
            return token
    return max(token for token, weight in enumerate(weights) if weight > 0)


def test_sampling_by_inversion_takes_the_token_the_reference_takes():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 50, generator=generator)  # (n, V), not normalised
    probs[probs < 0.3] = 0  # tokens of probability 0, the last ones of some rows included
    probs[:8, -10:] = 0
    probs[0, :3] = 0  # with uniform 0: the first token of probability > 0, not token 0
    uniform = torch.rand(64, dtype=torch.float64, generator=generator)
    uniform[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-12], dtype=torch.float64)
    got = sample_by_inversion(probs, uniform)
    want = [inverse_cdf_reference(row.tolist(), float(u)) for row, u in zip(probs, uniform)]
    assert got.tolist() == want
    assert bool((probs[torch.arange(64), got] > 0).all())  # never a token of probability 0


def test_sampled_tokens_follow_the_processed_distribution():
    """Frequencies of 200,000 draws (one step of `_next_tokens`, as the loop samples) against
    the softmax of the scores, within 5 standard deviations per token; -inf scores never."""
    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, -3.0])  # (V,)
    draws = 200_000
    torch.manual_seed(0)
    tokens = _next_tokens(
        scores.expand(draws, -1), torch.arange(draws), draws, do_sample=True
    )  # (draws,)
    probs = torch.softmax(scores.double(), dim=-1)
    frequencies = torch.bincount(tokens, minlength=len(scores)).double() / draws
    deviation = (probs * (1 - probs) / draws).sqrt()
    assert bool(((frequencies - probs).abs() <= 5 * deviation + 1e-12).all()), frequencies
    assert frequencies[4] == 0
