"""Sampling and log-probs of rollouts, against a slow reference: each row alone, unpadded, in a
plain forward pass of the model."""

from types import SimpleNamespace

import pytest
import torch
from logprob_helpers import processed_logprobs_by_hand
from transformers import GenerationConfig

from trl_grpo_ext.generation import PromptEncoder
from trl_grpo_ext.generation.rollout import completion_mask_from_ids
from trl_grpo_ext.generation.transformers_engine import generate_with_transformers
from trl_grpo_ext.logprobs import (
    _shared_prompt_logits,
    completion_logprobs,
    packing_pays,
    token_logprobs,
)
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

PROMPTS = ["1+2=", "10+17=", "3+3=?"]  # different lengths, so the prompts are left-padded


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    return model.eval(), tokenizer


def sampling(tokenizer, group_size=4, **kwargs):
    return GenerationConfig(
        do_sample=True,
        max_new_tokens=6,
        num_return_sequences=group_size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs,
    )


def reference_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask, temperature):
    """Each row alone, its padding removed, the whole sequence through the model."""
    rows = []
    for ids, keep, completion in zip(prompt_ids, prompt_mask, completion_ids):
        prompt = ids[keep.bool()]
        logits = model(input_ids=torch.cat([prompt, completion])[None]).logits
        aligned = logits[:, len(prompt) - 1 : -1]  # position t predicts completion token t
        rows.append(token_logprobs(aligned, completion[None], temperature))
    return torch.cat(rows) * mask


def sample(model, tokenizer, config, seed=0, **kwargs):
    torch.manual_seed(seed)
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    return generate_with_transformers(
        model, prompt_ids, prompt_mask, generation_config=config, **kwargs
    )


def test_packed_logprobs_and_gradients_match_each_row_alone(tiny):
    model, tokenizer = tiny
    prompt_ids, prompt_mask, completion_ids = sample(model, tokenizer, sampling(tokenizer))
    mask, _ = completion_mask_from_ids(completion_ids, [tokenizer.eos_token_id])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, mask], 1)

    assert (
        _shared_prompt_logits(model, input_ids, attention_mask, completion_ids.shape[1]) is not None
    )
    packed = completion_logprobs(model, input_ids, attention_mask, completion_ids, 0.7) * mask
    (packed.sum()).backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = reference_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask, 0.7)
    reference.sum().backward()
    reference_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    torch.testing.assert_close(packed, reference, atol=2e-5, rtol=1e-5)
    for got, want in zip(packed_grads, reference_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "group_size, options",
    [
        (4, {"top_k": 0}),  # each prompt encoded once, the group continued from its cache
        (4, {"top_k": 5, "top_p": 0.9}),  # of the filtered distribution, renormalised
        (1, {"top_k": 0}),  # one plain generate call
        (1, {"top_k": 5, "top_p": 0.9}),
    ],
)
def test_sampling_logprobs_are_the_log_probs_of_the_sampled_tokens(tiny, group_size, options):
    model, tokenizer = tiny
    config = sampling(tokenizer, group_size, temperature=0.7, **options)
    prompt_ids, prompt_mask, completion_ids, logps = sample(
        model, tokenizer, config, return_logprobs=True
    )
    assert logps.shape == completion_ids.shape
    mask, _ = completion_mask_from_ids(completion_ids, [tokenizer.eos_token_id])
    # the distribution each token was drawn from (TRL's processed log-probs)
    settings = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, **options}
    output = (prompt_ids, prompt_mask, completion_ids)
    reference = processed_logprobs_by_hand(model, output, mask, settings)
    torch.testing.assert_close(logps.double() * mask, reference, atol=2e-5, rtol=1e-5)
    if not settings["top_k"] and settings["top_p"] == 1.0:  # unfiltered: the trainer's log-probs
        trainers = reference_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask, 0.7)
        torch.testing.assert_close(logps * mask, trainers, atol=2e-5, rtol=1e-5)
    # The same tokens as without log-probs, from the same seed.
    assert torch.equal(sample(model, tokenizer, config)[2], completion_ids)


def test_prompt_once_sampling_matches_one_generate_call_when_deterministic(tiny):
    model, tokenizer = tiny
    config = sampling(tokenizer, top_k=1)  # sampling that always picks the most likely token
    _, _, completion_ids = sample(model, tokenizer, config)
    encoded = tokenizer(
        PROMPTS, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    output = model.generate(**encoded, generation_config=config)
    expected = output[:, encoded["input_ids"].shape[1] :]
    assert completion_ids.shape[0] == len(PROMPTS) * 4
    assert torch.equal(completion_ids, expected)


def test_packing_only_where_it_costs_less():
    """The cost model against the measured cases of SmolLM2-135M (hidden 576, MLP 1536, G = 8):
    packing took 0.60x the time of separate rows with 57 prompt and 64 completion tokens, and
    1.40x with 256 completion tokens."""
    smollm2 = SimpleNamespace(config=SimpleNamespace(hidden_size=576, intermediate_size=1536))
    assert packing_pays(smollm2, 57, 64, 8)
    assert not packing_pays(smollm2, 57, 256, 8)
    assert packing_pays(smollm2, 2000, 256, 8)  # a long few-shot prompt
    # Hand count for d = m = 1, P = 1, T = 1, G = 2: a token costs 14 in its linear layers;
    # packed: 3 tokens x (14 + 4 x 3) = 78; rows: 2 x 2 tokens x (14 + 4 x 2) = 88.
    unit = SimpleNamespace(config=SimpleNamespace(hidden_size=1, intermediate_size=1))
    assert packing_pays(unit, 1, 1, 2)
    # P = 1, T = 3, G = 2: packed 7 x (14 + 28) = 294 > rows 2 x 4 x (14 + 16) = 240.
    assert not packing_pays(unit, 1, 3, 2)
