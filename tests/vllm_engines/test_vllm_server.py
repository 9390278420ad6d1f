"""The server engine against a real, unmodified vLLM server (started by the `vllm_server`
fixture): the same checks as the colocated engine, the errors a user meets, and a server killed
in the middle of a run. Faults injected into training runs are in test_server_faults.py."""

import threading
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm_helpers import (  # noqa: E402
    SERVER_MAX_LORA_RANK,
    assert_filtered_logprobs_are_the_processed_ones,
    assert_greedy_matches_transformers,
    assert_sampled_logprobs_match_trainer,
    assert_stop_strings_end_where_transformers_does,
    completion_mask,
    config,
    lora_adapter,
)

from trl_grpo_ext.generation.transformers_engine import generate_with_transformers  # noqa: E402
from trl_grpo_ext.generation.vllm_server import VLLMServerEngine, VLLMServerError  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server_engine(vllm_server):
    base_url = vllm_server
    engine = VLLMServerEngine(base_url, timeout=5, backoff=0.2)
    engine.wait_until_ready()
    return engine


def test_greedy_output_equals_transformers_token_for_token(
    server_engine, hf_model, tokenizer, prompts
):
    assert_greedy_matches_transformers(server_engine, hf_model, tokenizer, prompts)


def test_sampled_token_logprobs_are_the_trainers(server_engine, hf_model, tokenizer, prompts):
    assert_sampled_logprobs_match_trainer(server_engine, hf_model, tokenizer, prompts)


def test_top_k_and_top_p_log_probs_are_those_of_the_filtered_distribution(
    server_engine, hf_model, tokenizer, prompts
):
    assert_filtered_logprobs_are_the_processed_ones(server_engine, hf_model, tokenizer, prompts)


def test_stop_strings_end_completions_where_transformers_ends_them(
    server_engine, hf_model, tokenizer, prompts
):
    assert_stop_strings_end_where_transformers_does(server_engine, hf_model, tokenizer, prompts)


def test_top_k_1_sampling_equals_greedy(server_engine, tokenizer, prompts):
    greedy = server_engine.generate(*prompts, config(tokenizer, greedy=True))
    top1 = server_engine.generate(
        *prompts, config(tokenizer, top_k=1, temperature=1.5, num_return_sequences=2), seed=5
    )
    assert torch.equal(top1[2][::2], greedy[2]) and torch.equal(top1[2][1::2], greedy[2])


def test_published_adapter_versions_advance_and_generation_uses_the_latest(
    server_engine, hf_model, tokenizer, prompts, tmp_path
):
    greedy = config(tokenizer, greedy=True)
    base = server_engine.generate(*prompts, greedy)[2]
    for version, seed in [(1, 1), (2, 2), (2, 3)]:  # version 2 published again: replaced
        peft_model = lora_adapter(hf_model, tmp_path / f"v{version}-{seed}", seed=seed)
        server_engine.publish_adapter(tmp_path / f"v{version}-{seed}", version)
        assert server_engine.adapter_version == version
        output = server_engine.generate(*prompts, greedy)
        with torch.no_grad():
            expected = generate_with_transformers(
                peft_model, *prompts, generation_config=greedy, return_logprobs=True
            )
        assert not torch.equal(output[2], base)
        assert torch.equal(output[2], expected[2])
        mask = completion_mask(expected[2], tokenizer.eos_token_id)
        torch.testing.assert_close(output[3] * mask, expected[3] * mask, atol=1e-4, rtol=0)
    served = [entry["id"] for entry in server_engine._request("/v1/models")["data"]]
    assert "adapter-v1" not in served and "adapter-v2" in served  # older versions unloaded


def test_adapter_rank_above_the_servers_max_lora_rank_is_a_clear_error(
    server_engine, hf_model, tmp_path
):
    rank = 2 * SERVER_MAX_LORA_RANK
    lora_adapter(hf_model, tmp_path / "big", seed=0, rank=rank)
    with pytest.raises(VLLMServerError, match=f"--max-lora-rank {rank}") as error:
        server_engine.publish_adapter(tmp_path / "big", 9)
    assert server_engine.base_url in str(error.value)


def test_full_fine_tuning_against_a_server_is_a_clear_error(server_engine, hf_model):
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        server_engine.load_weights(hf_model.state_dict().items())


def test_a_server_that_is_down_is_a_clear_error_naming_the_url(tokenizer, prompts):
    engine = VLLMServerEngine("http://127.0.0.1:9", timeout=1, backoff=0.1)
    engine._served, engine._logprobs_checked = ("model", "model"), True
    with pytest.raises(VLLMServerError, match=r"127\.0\.0\.1:9/v1/completions.*for 1 s"):
        engine.generate(*prompts, config(tokenizer, greedy=True))


def test_two_training_processes_share_one_server(
    vllm_server, hf_model, tokenizer, prompts, tmp_path
):
    """Each process of a multi-process run publishes the same versions under its own names, at
    its own pace, and generates with its own latest adapter."""
    base_url = vllm_server
    engines = [
        VLLMServerEngine(base_url, timeout=5, adapter_prefix=f"adapter-p{rank}")
        for rank in range(2)
    ]
    greedy = config(tokenizer, greedy=True)
    for version in range(3):
        peft_model = lora_adapter(hf_model, tmp_path / f"v{version}", seed=version)
        with torch.no_grad():
            expected = generate_with_transformers(peft_model, *prompts, generation_config=greedy)
        for engine in engines:
            engine.publish_adapter(tmp_path / f"v{version}", version)
        for engine in reversed(engines):  # one process's unload never hits the other's adapter
            assert torch.equal(engine.generate(*prompts, greedy)[2], expected[2])
    served = {entry["id"] for entry in engines[0]._request("/v1/models")["data"]}
    assert {"adapter-p0-v2", "adapter-p1-v2"} <= served
    assert not served & {"adapter-p0-v1", "adapter-p1-v1", "adapter-p0-v0", "adapter-p1-v0"}
    for engine in engines:
        engine._request("/v1/unload_lora_adapter", {"lora_name": engine.adapter_name})


def test_a_restarted_run_republishes_a_version_the_server_still_has(
    vllm_server, hf_model, tokenizer, prompts, tmp_path
):
    """The trainer stopped (preempted) while the server stayed up; the resumed run's new engine
    publishes the checkpoint's version, which the server still holds from the stopped run."""
    base_url = vllm_server
    greedy = config(tokenizer, greedy=True)
    stopped = VLLMServerEngine(base_url, timeout=5, adapter_prefix="run")
    lora_adapter(hf_model, tmp_path / "stopped", seed=1)
    stopped.publish_adapter(tmp_path / "stopped", 4)
    resumed = VLLMServerEngine(base_url, timeout=5, adapter_prefix="run")
    peft_model = lora_adapter(hf_model, tmp_path / "resumed", seed=2)
    resumed.publish_adapter(tmp_path / "resumed", 4)  # vLLM refuses a second plain load
    with torch.no_grad():
        expected = generate_with_transformers(peft_model, *prompts, generation_config=greedy)
    assert torch.equal(resumed.generate(*prompts, greedy)[2], expected[2])  # the new weights
    resumed._request("/v1/unload_lora_adapter", {"lora_name": "run-v4"})


def test_a_server_killed_mid_run_is_a_clear_error_within_the_bound(
    killable_server, tokenizer, prompts
):
    """Killed while it generates: the engine waits `timeout` seconds for it to come back, then
    fails naming the URL."""
    engine = VLLMServerEngine(killable_server.base_url, timeout=2, backoff=0.2)
    long_run = config(tokenizer, max_new_tokens=400, num_return_sequences=16, temperature=1.0)
    errors = []

    def generate():
        try:
            for seed in range(100):
                engine.generate(*prompts, long_run, seed=seed)
        except VLLMServerError as error:
            errors.append(error)

    worker = threading.Thread(target=generate)
    worker.start()
    time.sleep(1.0)
    killable_server.kill()
    worker.join(timeout=60)  # a hang, not a speed bound: the engine gives up after 2 s
    assert not worker.is_alive() and errors, "generate neither failed nor finished"
    assert killable_server.base_url in str(errors[0])
    assert "did not answer for 2 s (vllm_server_timeout" in str(errors[0])
