"""The colocated vLLM engine against `transformers` on the same tiny model: it samples exactly
the settings of the config, its log-probs are the trainer's, and published weights are used."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm_helpers import (  # noqa: E402
    MAX_LORA_RANK,
    assert_filtered_logprobs_are_the_processed_ones,
    assert_greedy_matches_transformers,
    assert_sampled_logprobs_match_trainer,
    assert_stop_strings_end_where_transformers_does,
    completion_mask,
    config,
    lora_adapter,
)

from trl_grpo_ext.generation.transformers_engine import generate_with_transformers  # noqa: E402
from trl_grpo_ext.generation.vllm_sampling import sampling_params  # noqa: E402

pytestmark = pytest.mark.vllm


def test_sampling_params_carry_every_setting_of_the_config(tokenizer):
    settings = dict(
        max_new_tokens=9,
        num_return_sequences=4,
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
    )
    params = sampling_params(config(tokenizer, **settings), seed=3)
    assert (params.n, params.max_tokens, params.seed) == (4, 9, 3)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert params.min_p == pytest.approx(0.05) and params.repetition_penalty == 1.1
    assert params.stop_token_ids == [tokenizer.eos_token_id] and params.logprobs == 0
    # disabled filters: top_k=0 and min_p=None are vLLM's "consider all tokens"
    params = sampling_params(config(tokenizer, top_k=0, min_p=None), seed=None)
    assert (params.top_k, params.min_p, params.top_p) == (0, 0.0, 1.0)
    assert params.temperature == 0.0 or config(tokenizer).do_sample
    assert sampling_params(config(tokenizer, greedy=True)).temperature == 0.0


def test_settings_vllm_cannot_honour_are_a_clear_error(tokenizer):
    beams = config(tokenizer, generation_kwargs={"num_beams": 2, "no_repeat_ngram_size": 3})
    with pytest.raises(ValueError, match="no_repeat_ngram_size, num_beams.*use_vllm=False"):
        sampling_params(beams)


def test_starting_the_engine_keeps_the_random_generators_and_set_num_threads(colocate_engine):
    assert colocate_engine.process_state == dict(rng_kept=True, set_num_threads_kept=True)


def test_greedy_output_equals_transformers_token_for_token(
    colocate_engine, hf_model, tokenizer, prompts
):
    assert_greedy_matches_transformers(colocate_engine, hf_model, tokenizer, prompts)


def test_top_k_1_sampling_equals_greedy(colocate_engine, tokenizer, prompts):
    greedy = colocate_engine.generate(*prompts, config(tokenizer, greedy=True))
    top1 = colocate_engine.generate(
        *prompts, config(tokenizer, top_k=1, temperature=1.5, num_return_sequences=2), seed=5
    )
    assert torch.equal(top1[2][::2], greedy[2]) and torch.equal(top1[2][1::2], greedy[2])


def test_sampled_token_logprobs_are_the_trainers(colocate_engine, hf_model, tokenizer, prompts):
    assert_sampled_logprobs_match_trainer(colocate_engine, hf_model, tokenizer, prompts)


def test_top_k_and_top_p_log_probs_are_those_of_the_filtered_distribution(
    colocate_engine, hf_model, tokenizer, prompts
):
    assert_filtered_logprobs_are_the_processed_ones(colocate_engine, hf_model, tokenizer, prompts)


def test_published_adapter_versions_advance_and_generation_uses_the_latest(
    colocate_engine, hf_model, tokenizer, prompts, tmp_path
):
    greedy = config(tokenizer, greedy=True)
    base = colocate_engine.generate(*prompts, greedy)[2]
    try:
        for version, seed in [(1, 1), (2, 2)]:
            peft_model = lora_adapter(hf_model, tmp_path / f"v{version}", seed=seed)
            colocate_engine.publish_adapter(tmp_path / f"v{version}", version)
            assert colocate_engine.adapter_version == version
            output = colocate_engine.generate(*prompts, greedy)
            with torch.no_grad():
                expected = generate_with_transformers(
                    peft_model, *prompts, generation_config=greedy, return_logprobs=True
                )
            assert not torch.equal(output[2], base)  # the adapter changes the output...
            assert torch.equal(output[2], expected[2])  # ...into peft's, token for token
            mask = completion_mask(expected[2], tokenizer.eos_token_id)
            torch.testing.assert_close(output[3] * mask, expected[3] * mask, atol=1e-4, rtol=0)
        with pytest.raises(ValueError, match=f"max_lora_rank={2 * MAX_LORA_RANK}"):
            lora_adapter(hf_model, tmp_path / "big", seed=3, rank=2 * MAX_LORA_RANK)
            colocate_engine.publish_adapter(tmp_path / "big", 3)
    finally:
        colocate_engine.adapter = None


def test_load_weights_replaces_the_engines_weights(colocate_engine, tokenizer, prompts):
    from trl_grpo_ext.tiny import build_tiny_model

    other = build_tiny_model(
        tokenizer, seed=1, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2
    ).eval()
    original = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    greedy = config(tokenizer, greedy=True)
    colocate_engine.load_weights(other.state_dict().items())
    try:
        with torch.no_grad():
            expected = generate_with_transformers(other, *prompts, generation_config=greedy)
        assert torch.equal(colocate_engine.generate(*prompts, greedy)[2], expected[2])
    finally:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(
            colocate_engine.llm.llm_engine.model_config.model
        )
        colocate_engine.load_weights(base.state_dict().items())
    assert all(torch.equal(original[name], tensor) for name, tensor in other.state_dict().items())


def test_a_failed_generation_is_an_error_and_the_engine_stays_usable(
    colocate_engine, tokenizer, prompts, tmp_path
):
    from vllm.lora.request import LoRARequest

    greedy = config(tokenizer, greedy=True)
    expected = colocate_engine.generate(*prompts, greedy)[2]
    colocate_engine.adapter = LoRARequest("adapter-v9", 99, str(tmp_path / "deleted"))
    try:
        with pytest.raises(Exception, match="adapter-v9"):
            colocate_engine.generate(*prompts, greedy)
    finally:
        colocate_engine.adapter = None
    # the failed requests were dropped: the next call runs (it waited on them forever before)
    assert not colocate_engine.llm.llm_engine.has_unfinished_requests()
    assert torch.equal(colocate_engine.generate(*prompts, greedy)[2], expected)


def test_stop_strings_end_completions_where_transformers_ends_them(
    colocate_engine, hf_model, tokenizer, prompts
):
    assert_stop_strings_end_where_transformers_does(colocate_engine, hf_model, tokenizer, prompts)
