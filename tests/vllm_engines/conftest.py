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
import time  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm_helpers import MAX_LORA_RANK  # noqa: E402

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
    from trl_grpo_ext.generation.vllm_colocate import VLLMColocateEngine

    set_num_threads = torch.set_num_threads
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    engine = VLLMColocateEngine(vllm_model_dir, max_model_len=512, max_lora_rank=MAX_LORA_RANK)
    engine.process_state = dict(
        rng_kept=torch.equal(rng_before, torch.get_rng_state()),
        set_num_threads_kept=torch.set_num_threads is set_num_threads,
    )
    return engine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """A real, unmodified vLLM server on a free local port; yields `(base_url, process)`."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vllm_model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited; see {log.name}")
            try:
                urllib.request.urlopen(f"{base_url}/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server did not start; see {log.name}") from None
                time.sleep(1)
        yield base_url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
