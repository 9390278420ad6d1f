"""The colocated vLLM engine in sleep mode (GPU only) wakes up into memory that the trainer's
allocator has handed back first, as TRL does; vLLM itself is faked here."""

from types import SimpleNamespace

import torch
from transformers import GenerationConfig

from trl_grpo_ext.generation import vllm_colocate


class FakeLLM:
    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags=None):
        self.calls.append("wake_up")

    def sleep(self, level=1):
        self.calls.append("sleep")

    def generate(self, prompts, sampling_params, lora_request, use_tqdm):
        self.calls.append("generate")
        step = {7: SimpleNamespace(logprob=-0.5)}
        sample = SimpleNamespace(index=0, token_ids=[7], logprobs=[step])
        return [SimpleNamespace(outputs=[sample]) for _ in prompts]


def test_the_cache_is_emptied_before_the_engine_wakes_up(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(vllm_colocate, "sampling_params", lambda config, seed: None)
    engine = object.__new__(vllm_colocate.VLLMColocateEngine)
    engine.llm, engine.enable_sleep_mode, engine.adapter = FakeLLM(calls), True, None
    config = GenerationConfig(max_new_tokens=1, do_sample=True, num_return_sequences=1)
    prompt_ids, prompt_mask = torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long)
    *_, completion_ids, logps = engine.generate(prompt_ids, prompt_mask, config, seed=0)
    assert calls == ["empty_cache", "wake_up", "generate", "sleep"]
    assert completion_ids.tolist() == [[7]] and logps.tolist() == [[-0.5]]
