"""`judge_reward` against a stub OpenAI-compatible server on loopback: what it sends, how it reads
the replies, its failures (None plus a metric), its timeout, its bounded concurrency, its cache
and its group mode. (tests/vllm_engines/test_vllm_judge.py asks a real vLLM server.)"""

import json
import socket
import time

import pytest

from trl_grpo_ext.rewards import judge_reward
from trl_grpo_ext.rewards.judge import JudgmentError, parse_group, parse_pointwise
from trl_grpo_ext.scoring import call_reward_funcs


def response_of(body) -> str:
    """The response text of a pointwise request, as the judge reads it."""
    return body["messages"][1]["content"].split("Response:\n", 1)[1]


def score_by_length(body) -> str:
    """The stub's judgment: the response's length in characters, as `Score: N`."""
    return f"The response is fine.\nScore: {len(response_of(body))}"


class Metrics:
    def __init__(self):
        self.logged = {}

    def __call__(self, name, value):
        self.logged[name] = value


def test_pointwise_sends_one_request_per_completion_and_reads_score_over_ten(stub_factory):
    stub = stub_factory(score_by_length)
    reward = judge_reward(
        base_url=stub.base_url, model="judge-model", rubric="Be brief.", api_key="secret"
    )
    metrics = Metrics()
    completions = [[{"role": "assistant", "content": "x" * n}] for n in (3, 7, 10)]
    prompts = [[{"role": "user", "content": "Say x."}]] * 3
    rewards = reward(prompts=prompts, completions=completions, log_metric=metrics)
    assert rewards == [0.3, 0.7, 1.0]
    assert len(stub.bodies) == 3
    body = stub.bodies[0]
    assert body["model"] == "judge-model"
    assert "Be brief." in body["messages"][0]["content"]
    assert "user: Say x." in body["messages"][1]["content"]
    assert all(headers["Authorization"] == "Bearer secret" for headers in stub.headers)
    assert metrics.logged["judge/failures"] == 0
    assert metrics.logged["judge/requests"] == 3
    assert metrics.logged["judge/prompt_tokens"] == 30
    assert metrics.logged["judge/completion_tokens"] == 9
    assert metrics.logged["judge/latency_s"] > 0
    assert reward.__name__ == "judge"


@pytest.mark.parametrize(
    ("reply", "score"),
    [("7", 7.0), ("Score: 6", 6.0), ("Good. **Score:** 8.5", 8.5), ("score = 2\nScore: 4", 4.0)],
)
def test_pointwise_replies_parse(reply, score):
    assert parse_pointwise(reply) == score


@pytest.mark.parametrize("reply", ["I like it", "Score: 11", "Score: -1", "7 out of 10, maybe 8"])
def test_pointwise_replies_without_a_valid_score_fail(reply):
    with pytest.raises(JudgmentError):
        parse_pointwise(reply)


def test_group_replies_parse():
    assert parse_group("Ranking done: [1, 9.5, 3]", 3) == [1.0, 9.5, 3.0]
    with pytest.raises(JudgmentError):
        parse_group("[1, 2]", 3)
    with pytest.raises(JudgmentError):
        parse_group("[1, 12, 3]", 3)


def test_failures_are_none_and_counted_never_zero_nor_an_exception(stub_factory):
    def reply(body):
        text = response_of(body)
        if text == "unparseable":
            return "I cannot decide."
        if text == "server error":
            return (500, "internal error")
        if text == "not json":
            return (200, "<html>")
        return "Score: 5"

    stub = stub_factory(reply)
    reward = judge_reward(base_url=stub.base_url, model="m", rubric="r")
    metrics = Metrics()
    completions = ["unparseable", "fine", "server error", "not json"]
    rewards = call_reward_funcs(
        [reward],
        prompts=["p"] * 4,
        completions=completions,
        completion_ids=[[1]] * 4,
        log_metric=metrics,
    )
    assert rewards[:, 0].isnan().tolist() == [True, False, True, True]
    assert rewards[1, 0].item() == 0.5
    assert metrics.logged["judge/failures"] == 3
    assert reward.stats.failures == 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server_gives_none_for_every_sample():
    reward = judge_reward(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", rubric="r")
    metrics = Metrics()
    assert reward(prompts=["p", "p"], completions=["a", "b"], log_metric=metrics) == [None, None]
    assert metrics.logged["judge/failures"] == 2


def test_a_slow_judge_times_out_into_none(stub_factory):
    stub = stub_factory(lambda body: "Score: 9", delay=1.0)
    reward = judge_reward(base_url=stub.base_url, model="m", rubric="r", timeout=0.2)
    started = time.perf_counter()
    assert reward(prompts=["p"], completions=["a"]) == [None]
    assert time.perf_counter() - started < 0.9  # it did not wait for the reply
    assert reward.stats.failures == 1


def test_requests_in_flight_never_exceed_max_concurrency(stub_factory):
    stub = stub_factory(lambda body: "Score: 1", delay=0.2, together=3)  # 3 must overlap
    reward = judge_reward(base_url=stub.base_url, model="m", rubric="r", max_concurrency=3)
    completions = [f"answer {i}" for i in range(12)]
    assert reward(prompts=["p"] * 12, completions=completions) == [0.1] * 12
    assert len(stub.bodies) == 12
    assert stub.most_in_flight == 3  # concurrent, up to the limit and never above it


def test_cache_hits_make_no_request_and_a_new_judge_reads_the_same_folder(stub_factory, tmp_path):
    stub = stub_factory(score_by_length)
    arguments = dict(base_url=stub.base_url, model="m", rubric="r", cache_dir=tmp_path)
    first = judge_reward(**arguments)
    assert first(prompts=["p", "p"], completions=["ab", "abcd"]) == [0.2, 0.4]
    assert len(stub.bodies) == 2
    resumed = judge_reward(**arguments)  # a resumed run: a new reward function, the same folder
    metrics = Metrics()
    rewards = resumed(
        prompts=["p", "p", "p"], completions=["ab", "abcd", "abc"], log_metric=metrics
    )
    assert rewards == [0.2, 0.4, 0.3]
    assert len(stub.bodies) == 3  # only "abc" was asked
    assert metrics.logged["judge/cache_hits"] == 2
    assert metrics.logged["judge/requests"] == 1
    # another rubric, prompt or judge model is another key: asked again
    judge_reward(**{**arguments, "rubric": "other"})(prompts=["p"], completions=["ab"])
    judge_reward(**{**arguments, "model": "other"})(prompts=["p"], completions=["ab"])
    judge_reward(**arguments)(prompts=["q"], completions=["ab"])
    assert len(stub.bodies) == 6


def test_failures_are_not_cached(stub_factory, tmp_path):
    replies = iter(["no score", "Score: 4"])
    stub = stub_factory(lambda body: next(replies))
    reward = judge_reward(base_url=stub.base_url, model="m", rubric="r", cache_dir=tmp_path)
    assert reward(prompts=["p"], completions=["a"]) == [None]
    assert reward(prompts=["p"], completions=["a"]) == [0.4]
    assert len(stub.bodies) == 2


def test_group_mode_sends_one_request_per_group_in_the_given_order(stub_factory, tmp_path):
    def reply(body):
        user = body["messages"][1]["content"]
        count = user.count("Response ")
        # scores 2, 4, 6, ... by the position the judge was given each response at
        return "Scores: " + json.dumps([2 * (i + 1) for i in range(count)])

    stub = stub_factory(reply)
    reward = judge_reward(
        base_url=stub.base_url, model="m", rubric="r", mode="group", cache_dir=tmp_path
    )
    prompts = ["p1"] * 3 + ["p2"] * 3
    completions = ["a", "b", "c", "d", "e", "f"]
    metrics = Metrics()
    rewards = reward(prompts=prompts, completions=completions, log_metric=metrics)
    assert rewards == pytest.approx([0.2, 0.4, 0.6, 0.2, 0.4, 0.6])
    assert len(stub.bodies) == 2
    # the two requests run at once: either may have arrived first
    first = next(b for b in stub.bodies if "p1" in b["messages"][1]["content"])
    first = first["messages"][1]["content"]
    assert first.index("Response 1:\na") < first.index("Response 2:\nb") < first.index("c")
    assert "JSON list of 3" in stub.bodies[0]["messages"][0]["content"]
    assert metrics.logged["judge/requests"] == 2
    # all cached: nothing asked again
    assert reward(prompts=prompts, completions=completions) == rewards
    assert len(stub.bodies) == 2


def test_group_mode_failure_is_none_for_the_whole_group(stub_factory):
    stub = stub_factory(lambda body: "[1, 2]")  # two scores for three responses
    reward = judge_reward(base_url=stub.base_url, model="m", rubric="r", mode="group")
    metrics = Metrics()
    assert reward(prompts=["p"] * 3, completions=["a", "b", "c"], log_metric=metrics) == [None] * 3
    assert metrics.logged["judge/failures"] == 3


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"mode": "listwise"}, "mode="),
        ({"base_url": "127.0.0.1:8000"}, "base_url="),
        ({"max_concurrency": 0}, "max_concurrency="),
        ({"rubric": ""}, "rubric"),
    ],
)
def test_wrong_arguments_are_clear_errors(arguments, message):
    with pytest.raises(ValueError, match=message):
        judge_reward(
            **{"base_url": "http://127.0.0.1:1/v1", "model": "m", "rubric": "r", **arguments}
        )
