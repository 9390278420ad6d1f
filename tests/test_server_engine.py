"""`VLLMServerEngine` against a stand-in server (stdlib `http.server`) that answers like vLLM's
OpenAI API and can be told to fail: the retry bounds, the errors a user meets, the log-prob mode
check, a server restarted with the same or another model, and the asynchronous worker's handling
of a failed adapter load. The real server is tested in tests/vllm_engines (`make test-vllm`)."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from agent_helpers import add, needs_trl_1_16
from test_agents import tool_trainer

from trl_grpo_ext.generation import sampling_config
from trl_grpo_ext.generation.async_rollout import RolloutPipeline
from trl_grpo_ext.generation.engines import EngineWorker
from trl_grpo_ext.generation.vllm_server import VLLMServerEngine, VLLMServerError
from trl_grpo_ext.generation.weights import OwnWeights

LOGITS = [2.0, 1.0, 0.5, -1.0, -3.0]  # the next-token logits the stand-in reports (top 5)


def log_softmax(values, temperature):
    scaled = [value / temperature for value in values]
    total = math.log(sum(math.exp(value) for value in scaled))
    return [value - total for value in scaled]


class StandIn(ThreadingHTTPServer):
    """A vLLM server's API: `/health`, `/v1/models`, the adapter endpoints, `/v1/completions`.

    `processed` picks the log-prob mode; `fail` maps a path to a list of HTTP statuses answered
    (one per request; None drops the connection) before it answers normally; `delay` delays
    completions."""

    daemon_threads = True

    def __init__(self, processed=True, root="/models/tiny"):
        super().__init__(("127.0.0.1", 0), Handler)
        self.processed, self.root = processed, root
        self.max_model_len = 512  # the server's --max-model-len
        self.adapters, self.fail, self.delay, self.requests = {}, {}, 0.0, []
        self.released = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def restart(self, root=None):
        """Like a restart: adapters gone, and maybe another model."""
        self.adapters.clear()
        self.root = root or self.root

    def stop(self):
        self.released.set()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._answer(None)

    def do_POST(self):
        self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def _answer(self, payload):
        server = self.server
        server.requests.append((self.path, payload))
        statuses = server.fail.get(self.path)
        if statuses:
            status = statuses.pop(0)
            if status is None:  # dropped: the connection closes with no answer
                self.close_connection = True
                return None
            return self._send(status, "injected failure")
        if self.path == "/health":
            return self._send(200, "")
        if self.path == "/v1/models":
            base = [{"id": server.root, "root": server.root, "parent": None,
                     "max_model_len": server.max_model_len}]  # fmt: skip
            adapters = [{"id": name, "root": path, "parent": server.root}
                        for name, path in server.adapters.items()]  # fmt: skip
            return self._send(200, {"data": base + adapters})
        if self.path == "/v1/load_lora_adapter":
            server.adapters[payload["lora_name"]] = payload["lora_path"]
            return self._send(200, "Success")
        if self.path == "/v1/unload_lora_adapter":
            if server.adapters.pop(payload["lora_name"], None) is None:
                return self._send(404, "cannot be found")
            return self._send(200, "Success")
        if payload["model"] not in (server.root, *server.adapters):
            return self._send(404, f"The model `{payload['model']}` does not exist.")
        server.released.wait(server.delay)
        temperature = payload["temperature"] if server.processed else 1.0
        top = dict(zip([f"token_id:{i}" for i in range(5)], log_softmax(LOGITS, temperature)))
        choice = {"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.5, -0.25],
                                                    "top_logprobs": [top]}}  # fmt: skip
        choices = [dict(choice, index=i) for i in range(payload.get("n", 1))]
        return self._send(200, {"choices": choices})

    def _send(self, status, body):
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.stop()


def engine_for(server, **kwargs):
    settings = dict(timeout=2.0, request_timeout=5.0, backoff=0.05)
    return VLLMServerEngine(server.url, **{**settings, **kwargs})


PROMPTS = (torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
SAMPLED = sampling_config(
    max_new_tokens=2, eos_token_id=[3], pad_token_id=0, num_return_sequences=2, temperature=0.7
)


def completions(server):
    return [payload for path, payload in server.requests if path == "/v1/completions"]


def test_generates_with_the_latest_adapter(stand_in, tmp_path):
    engine = engine_for(stand_in)
    engine.publish_adapter(tmp_path, 0)
    prompt_ids, _, completion_ids, logps = engine.generate(*PROMPTS, SAMPLED, seed=1)
    assert completion_ids.tolist() == [[1, 2]] * 4
    assert logps.tolist() == [[-0.5, -0.25]] * 4
    assert [payload["model"] for payload in completions(stand_in)[-2:]] == ["adapter-v0"] * 2


def test_a_server_with_raw_logprobs_is_an_error_naming_the_flag():
    server = StandIn(processed=False)
    try:
        with pytest.raises(VLLMServerError, match="--logprobs-mode processed_logprobs"):
            engine_for(server).generate(*PROMPTS, SAMPLED, seed=1)
        # checked once, on the first batch, with the base model and the first prompt
        probes = completions(server)
        assert [(p["temperature"], p["prompt"], p["max_tokens"]) for p in probes] == [
            (1.0, [5, 6], 1),
            (0.5, [5, 6], 1),
        ]
    finally:
        server.stop()


def test_the_logprobs_check_runs_once(stand_in):
    engine = engine_for(stand_in)
    for seed in range(3):
        engine.generate(*PROMPTS, SAMPLED, seed=seed)
    assert len(completions(stand_in)) == 2 + 3 * 2  # the two probes, then two prompts a call


def test_a_server_down_fails_after_the_timeout_naming_the_url_and_the_setting():
    engine = VLLMServerEngine("http://127.0.0.1:9", timeout=1.0, backoff=0.1)
    engine._served, engine._logprobs_checked = ("m", "m"), True
    start = time.monotonic()
    with pytest.raises(
        VLLMServerError, match=r"127\.0\.0\.1:9/v1/completions.*vllm_server_timeout"
    ):
        engine.generate(*PROMPTS, SAMPLED)
    assert time.monotonic() - start < 10  # bounded by the timeout, not by a retry count


def test_an_unavailable_server_is_waited_for_as_long_as_it_restarts(stand_in, tmp_path):
    """503s (a server starting up) for less than `timeout`: the request goes through."""
    engine = engine_for(stand_in, timeout=30.0)
    stand_in.fail["/v1/completions"] = [503] * 6  # the back-off doubles: 0.05 ... 1.6 s
    engine.generate(*PROMPTS, SAMPLED, seed=0)
    assert stand_in.fail["/v1/completions"] == []


def test_dropped_connections_are_retried(stand_in):
    engine = engine_for(stand_in, timeout=30.0)
    stand_in.fail["/v1/completions"] = [None] * 3
    engine.generate(*PROMPTS, SAMPLED, seed=0)
    assert stand_in.fail["/v1/completions"] == []


def test_http_500_is_retried_twice_then_reported_with_the_servers_message(stand_in):
    engine = engine_for(stand_in, timeout=30.0)
    engine._logprobs_checked = True
    stand_in.fail["/v1/completions"] = [500] * 10
    with pytest.raises(VLLMServerError, match=r"failed the request \(HTTP 500\): injected"):
        engine.generate(PROMPTS[0][:1], PROMPTS[1][:1], SAMPLED)
    assert len(stand_in.fail["/v1/completions"]) == 10 - 3


def test_a_server_slower_than_the_request_timeout_is_not_retried(stand_in):
    engine = engine_for(stand_in, request_timeout=0.5, timeout=30.0)
    engine._logprobs_checked = True
    stand_in.delay = 30.0
    with pytest.raises(VLLMServerError, match=r"did not answer within 0\.5 s"):
        engine.generate(PROMPTS[0][:1], PROMPTS[1][:1], SAMPLED)
    assert len(completions(stand_in)) == 1


def test_a_server_restarted_with_the_same_model_gets_the_adapter_again(stand_in, tmp_path):
    engine = engine_for(stand_in)
    engine.publish_adapter(tmp_path, 3)
    engine.generate(*PROMPTS, SAMPLED, seed=0)
    stand_in.restart()
    with pytest.warns(UserWarning, match="was restarted: loading adapter adapter-v3 again"):
        engine.generate(*PROMPTS, SAMPLED, seed=0)
    assert stand_in.adapters == {"adapter-v3": str(tmp_path)}
    engine.publish_adapter(tmp_path, 4)  # the next version replaces it as usual
    assert list(stand_in.adapters) == ["adapter-v4"]


@pytest.mark.parametrize("when", ["publish", "generate"])
def test_a_server_restarted_with_another_model_is_an_error_naming_both(stand_in, tmp_path, when):
    engine = engine_for(stand_in)
    engine.publish_adapter(tmp_path, 0)
    engine.generate(*PROMPTS, SAMPLED, seed=0)
    stand_in.restart(root="/models/other")
    with pytest.raises(VLLMServerError, match="restarted with a different model") as error:
        if when == "publish":
            engine.publish_adapter(tmp_path, 1)
        else:
            engine.generate(*PROMPTS, SAMPLED, seed=0)
    assert "'/models/other', not '/models/tiny'" in str(error.value)
    assert "--model /models/tiny" in str(error.value)


def test_a_server_without_lora_is_an_error_naming_the_flags(stand_in, tmp_path):
    stand_in.fail["/v1/load_lora_adapter"] = [404]
    with pytest.raises(VLLMServerError, match="--enable-lora"):
        engine_for(stand_in).publish_adapter(tmp_path, 0)


def test_start_up_waits_for_the_timeout(stand_in):
    stand_in.fail["/health"] = [503] * 3
    engine_for(stand_in).wait_until_ready()  # up within the timeout
    stand_in.fail["/health"] = [503] * 1000
    with pytest.raises(VLLMServerError, match=r"not up after 1 s \(vllm_server_timeout\)"):
        engine_for(stand_in, timeout=1.0).wait_until_ready()


def test_close_unloads_the_latest_adapter_and_gives_up_on_a_server_that_is_down(stand_in, tmp_path):
    """`trainer.rollouts.shutdown()` closes the engine: it had no `close` (an AttributeError)."""
    engine = engine_for(stand_in)
    engine.close()  # nothing published: nothing to unload
    assert not [path for path, _ in stand_in.requests if "lora" in path]
    engine.publish_adapter(tmp_path, 0)
    engine.publish_adapter(tmp_path, 1)
    assert set(stand_in.adapters) == {"adapter-v1"}
    engine.close()
    assert stand_in.adapters == {} and engine.adapter_name is None
    engine.publish_adapter(tmp_path, 2)
    stand_in.stop()  # down: closing after a failed run does not wait `timeout` for it
    down = engine_for(stand_in, timeout=30.0)
    down.adapter_name = "adapter-v2"
    started = time.monotonic()
    down.close()
    assert time.monotonic() - started < 10  # a hang would be 30 s of retries


@needs_trl_1_16
@pytest.mark.parametrize(("vllm_max_model_length", "expected"), [(None, 300), (200, 200)])
def test_tool_results_that_would_pass_the_servers_max_model_len_end_the_rollout(
    stand_in, tmp_path, vllm_max_model_length, expected
):
    """The tool loop used the model's 2048 positions: the server refused (HTTP 400) the next
    turn of a conversation longer than its --max-model-len, failing the run. The smaller of the
    server's limit and vllm_max_model_length counts."""
    stand_in.max_model_len = 300
    trainer = tool_trainer(
        tmp_path,
        tools=[add],
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=stand_in.url,
        vllm_max_model_length=vllm_max_model_length,
    )
    assert trainer.rollouts.engine.max_model_len == 300
    assert trainer.rollouts.tool_loop.max_model_len == expected


# ---------------------------------------------------------- the asynchronous worker


class Publisher:
    """`WeightPublisher`'s interface over the engine; `refuse` lists versions whose load fails."""

    def __init__(self, engine, refuse):
        self.engine, self.refuse, self.version = engine, refuse, None

    def snapshot(self, version):
        return version

    def load(self, snapshot, version):
        if version in self.refuse:
            raise VLLMServerError(f"adapter v{version} refused: start it with --enable-lora")
        self.version = version


class Engine(OwnWeights):
    def __init__(self, refuse):
        self.generated, self.publisher = [], Publisher(self, refuse)

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        self.generated.append(seed)
        return prompt_ids, prompt_mask, prompt_ids, torch.zeros(prompt_ids.shape)


@pytest.mark.parametrize("refused", [0, 2])
def test_a_failed_adapter_load_stops_the_asynchronous_worker_with_its_cause(refused):
    """The first load failing left version None (a TypeError later); a later one let the worker
    go on with the older adapter. Either way the load's own error must reach the trainer."""
    engine = Engine(refuse={refused})
    worker = EngineWorker(engine, generation_config=None)
    pipeline = RolloutPipeline(worker, max_staleness=2)
    prompts = (torch.ones(1, 1), torch.ones(1, 1))
    try:
        with pytest.raises(VLLMServerError, match="--enable-lora"):
            for step in range(6):
                upcoming = {index: (prompts, index) for index in range(step, 6)}
                pipeline.consume(step, upcoming)
        # Only the batches submitted before the failed load were generated (with k = 2, those
        # of steps up to refused + 1); none with the older adapter after it.
        assert engine.generated == (list(range(refused + 2)) if refused else [])
        with pytest.raises(VLLMServerError, match="--enable-lora"):  # and again, not a hang
            worker.update_weights(refused + 1)
    finally:
        pipeline.close()
