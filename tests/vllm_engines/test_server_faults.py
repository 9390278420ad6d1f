"""Faults injected into training runs on a real vLLM server. Each must end in an error that names
its cause, within a bounded time, with the last checkpoint intact, and the run must resume from
it once the fault is gone.

Faults go through a small HTTP proxy (stdlib `http.server`, in a thread) in front of the one real
server of the session, which is told to delay, fail or refuse requests, or to forward to a second
server with other weights; starting a vLLM server per fault would cost a minute each. The server
killed outright is test_vllm_training.py's `test_a_server_killed_mid_run_fails_clearly_...`; the
servers set up against the docs (no LoRA, raw log-probs, a small --max-lora-rank) are real ones.
"""

import re
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("vllm")

from trainer_helpers import lora_config, make_trainer, odd_first_byte  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from vllm_helpers import SERVER_MAX_LORA_RANK, config  # noqa: E402

from trl_grpo_ext.checkpoints import last_complete_checkpoint  # noqa: E402
from trl_grpo_ext.generation.vllm_server import VLLMServerEngine, VLLMServerError  # noqa: E402

pytestmark = pytest.mark.vllm

BOUND = 180  # seconds a faulty run may take to fail; more is a hang
REQUEST_TIMEOUT = 10  # the engine's per-request timeout in the slow fault's run, which exceeds it
# Elsewhere: long enough for a fresh server's first requests, which compile its kernels.
WARM_UP_TIMEOUT = 120


class FaultProxy(ThreadingHTTPServer):
    """Forwards every request to `upstream`, except those to `fault_path` while `fault` is set:
    "slow" answers after the test ends, "error" with `status` and `message`."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream, self.fault, self.fault_path = upstream, None, None
        self.status, self.message, self.injected = 500, "injected internal error", 0
        self.released = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def inject(self, fault, path, status=500, message="injected internal error"):
        self.fault, self.fault_path, self.status, self.message = fault, path, status, message

    def clear(self, upstream=None):
        self.fault, self.upstream = None, upstream or self.upstream

    def stop(self):
        self.released.set()  # slow answers end now
        self.shutdown()
        self.server_close()
        self._thread.join()


class ProxyHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._handle(None)

    def do_POST(self):
        self._handle(self.rfile.read(int(self.headers["Content-Length"])))

    def _handle(self, body):
        proxy = self.server
        if proxy.fault is not None and self.path == proxy.fault_path:
            proxy.injected += 1
            if proxy.fault == "slow":
                proxy.released.wait()
            else:
                return self._send(proxy.status, proxy.message.encode())
        headers = {"Content-Type": "application/json"} if body is not None else {}
        request = urllib.request.Request(proxy.upstream + self.path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return self._send(response.status, response.read())
        except urllib.error.HTTPError as error:
            return self._send(error.code, error.read())

    def _send(self, status, data):
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (its timeout)
            pass


@pytest.fixture
def proxy(vllm_server):
    proxy = FaultProxy(vllm_server)
    yield proxy
    proxy.stop()


def run_bounded(function):
    """Runs `function()` in a thread; returns its exception (None if it returned). A run still
    going after BOUND seconds is a hang and fails the test."""
    outcome = []

    def target():
        try:
            function()
            outcome.append(None)
        except Exception as error:  # noqa: BLE001 - returned to the test
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"the run hung (> {BOUND} s)"
    return outcome[0]


def server_trainer(model_dir, output_dir, url, request_timeout=WARM_UP_TIMEOUT, **config):
    """A trainer of a few steps on the server at `url`, saving a checkpoint every 2 steps."""
    settings = dict(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=5,
        reward_funcs=odd_first_byte,
        max_steps=4,
        max_completion_length=2,
        save_strategy="steps",
        save_steps=2,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = make_trainer(output_dir, model=model, tokenizer=tokenizer, **{**settings, **config})
    trainer.rollouts.engine.request_timeout = request_timeout
    return trainer


class AfterFirstSave(TrainerCallback):
    def __init__(self, action):
        self.action = action

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.action()


# fault -> (what the proxy does after the checkpoint of step 2, max_staleness, the error)
FAULTS = {
    "slow": (
        lambda proxy, other: proxy.inject("slow", "/v1/completions"),
        None,
        rf"did not answer within {REQUEST_TIMEOUT} s",
    ),
    "http_500_on_generate": (
        lambda proxy, other: proxy.inject("error", "/v1/completions"),
        1,
        r"failed the request \(HTTP 500\): injected internal error",
    ),
    "adapter_load_refused": (
        lambda proxy, other: proxy.inject(
            "error", "/v1/load_lora_adapter", 400, "LoRA adapter refused: out of LoRA slots"
        ),
        1,
        r"/v1/load_lora_adapter refused the request \(HTTP 400\): LoRA adapter refused",
    ),
    "restarted_with_another_model": (
        lambda proxy, other: proxy.clear(upstream=other),
        1,
        "restarted with a different model",
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_mid_run_names_its_cause_and_the_run_resumes(
    fault, proxy, vllm_server, other_model_server, vllm_model_dir, tmp_path
):
    inject, max_staleness, message = FAULTS[fault]
    settings = dict(max_staleness=max_staleness)
    if fault == "slow":
        settings["request_timeout"] = REQUEST_TIMEOUT
    trainer = server_trainer(vllm_model_dir, tmp_path, proxy.url, **settings)
    trainer.add_callback(AfterFirstSave(lambda: inject(proxy, other_model_server)))
    error = run_bounded(trainer.train)
    assert isinstance(error, VLLMServerError), repr(error)
    assert proxy.url in str(error)
    assert re.search(message, str(error)), str(error)
    checkpoint = last_complete_checkpoint(str(tmp_path))
    assert checkpoint is not None and checkpoint.endswith("checkpoint-2")

    proxy.clear(upstream=vllm_server)  # the fault is gone: the same address works again
    resumed = server_trainer(vllm_model_dir, tmp_path, proxy.url, **settings)
    assert run_bounded(lambda: resumed.train(resume_from_checkpoint=True)) is None
    assert resumed.state.global_step == 4


@pytest.mark.parametrize("max_staleness", [None, 1])
def test_an_adapter_above_the_servers_max_lora_rank_is_the_error_the_user_sees(
    vllm_server, vllm_model_dir, tmp_path, max_staleness
):
    """Asynchronous rollouts used to log the refusal and fail later with a TypeError."""
    rank = 2 * SERVER_MAX_LORA_RANK
    peft_config = lora_config(r=rank)
    trainer = server_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_server,
        max_staleness=max_staleness,
        peft_config=peft_config,
    )
    error = run_bounded(trainer.train)
    assert isinstance(error, VLLMServerError), repr(error)
    assert f"restart the server with --max-lora-rank {rank}" in str(error)


@pytest.mark.parametrize("max_staleness", [None, 1])
def test_a_server_without_lora_is_the_error_the_user_sees(
    other_model_server, vllm_model_dir, tmp_path, max_staleness
):
    trainer = server_trainer(
        vllm_model_dir, tmp_path, other_model_server, max_staleness=max_staleness
    )
    error = run_bounded(trainer.train)
    assert isinstance(error, VLLMServerError), repr(error)
    assert "--enable-lora" in str(error) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in str(error)


def test_a_server_without_processed_logprobs_is_an_error_naming_the_flag(
    other_model_server, tokenizer, prompts
):
    """vLLM's default log-probs come from before temperature: the importance weights would be
    biased at any temperature other than 1."""
    engine = VLLMServerEngine(other_model_server, timeout=5)
    with pytest.raises(VLLMServerError, match="--logprobs-mode processed_logprobs"):
        engine.generate(*prompts, config(tokenizer, num_return_sequences=2, temperature=0.7))


def test_the_documented_server_passes_the_logprobs_check(vllm_server, prompts):
    engine = VLLMServerEngine(vllm_server, timeout=5)
    engine.check_logprobs_mode(prompts[0][0][prompts[1][0].bool()].tolist())
    assert engine._logprobs_checked
