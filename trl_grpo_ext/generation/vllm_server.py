"""Generation on an unmodified vLLM server, through its OpenAI-compatible API.

The server is started by the user, on this machine or another one::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server \\
        --model MODEL --logprobs-mode processed_logprobs --enable-lora --max-lora-rank 64

`VLLMServerEngine.generate` sends each prompt's token ids to `/v1/completions` (with `n`, a seed,
`logprobs=1`, `return_token_ids`, `return_tokens_as_token_ids`) and returns the tensors of
`generate_with_transformers(..., return_logprobs=True)`. New LoRA weights are published as
adapter versions (`/v1/load_lora_adapter`, the server started with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); the adapter folder must be readable by the server under
the same path. A server has no way to take full weights: full fine-tuning needs the colocated
engine.

A request that fails to connect, times out, or meets a restarting server (HTTP 5xx) is retried
`retries` times, waiting `backoff`, 2 * `backoff`, ... seconds; then a `ConnectionError` names
the URL. Only `urllib` from the standard library is used.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .vllm_sampling import (
    adapter_rank,
    prompt_seeds,
    sampling_fields,
    to_tensors,
    unpadded_prompts,
)


class VLLMServerError(ConnectionError):
    """The vLLM server did not answer within the retry bound, or refused a request."""


class VLLMServerEngine:
    """Generation on a running vLLM server (`python -m vllm.entrypoints.openai.api_server`).

    Args:
        base_url (`str`):
            The server's address, e.g. `http://127.0.0.1:8000` (TRL's `vllm_server_base_url`, or
            `http://{vllm_server_host}:{vllm_server_port}`).
        timeout (`float`, *optional*, defaults to 240):
            Seconds to wait for the server at start-up (`wait_until_ready`) and for one request.
        retries (`int`, *optional*, defaults to 3):
            Attempts after the first for a request that fails to connect, times out or gets a 5xx.
        backoff (`float`, *optional*, defaults to 1.0):
            Seconds before the first retry; doubled each time.
        max_concurrent_requests (`int`, *optional*, defaults to 32):
            Prompts in flight at once (the server batches them).
        adapter_prefix (`str`, *optional*, defaults to `"adapter"`):
            Published versions are named `{adapter_prefix}-v{version}` on the server. Training
            processes that share one server need distinct prefixes (`build_engine` gives each
            its process index): each loads and unloads its own versions, and two processes
            loading the same name would collide.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 240.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_concurrent_requests: int = 32,
        adapter_prefix: str = "adapter",
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_concurrent_requests = max_concurrent_requests
        self.adapter_prefix = adapter_prefix
        self.adapter_name = None  # the latest published adapter version, as the server names it
        self.adapter_version = None
        self._model = None

    # --- HTTP ---------------------------------------------------------------------------------
    def _request(self, path: str, payload: dict | None = None, *, retries: int | None = None):
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        retries = self.retries if retries is None else retries
        last_error = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read().decode(errors="replace")
                try:
                    return json.loads(body)
                except ValueError:  # the adapter endpoints answer in plain text
                    return body
            except urllib.error.HTTPError as error:
                message = error.read().decode(errors="replace")
                if error.code < 500:  # the server answered: retrying would not change it
                    raise VLLMServerError(
                        f"The vLLM server at {url} refused the request (HTTP {error.code}): "
                        f"{message}"
                    ) from None
                last_error = f"HTTP {error.code}: {message}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as error:
                last_error = repr(getattr(error, "reason", error))
        raise VLLMServerError(
            f"The vLLM server at {url} did not answer after {retries + 1} attempts "
            f"({last_error}). Check that it is running and reachable (vllm_server_base_url)."
        )

    def wait_until_ready(self) -> None:
        """Waits up to `timeout` seconds for the server's `/health` to answer."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._request("/health", retries=0)
                return
            except VLLMServerError:
                if time.monotonic() > deadline:
                    raise VLLMServerError(
                        f"The vLLM server at {self.base_url} was not up after {self.timeout} s. "
                        "Start it first (python -m vllm.entrypoints.openai.api_server ...)."
                    ) from None
                time.sleep(1.0)

    @property
    def model(self) -> str:
        """The base model's name on the server."""
        if self._model is None:
            models = self._request("/v1/models")["data"]
            self._model = next(
                (entry["id"] for entry in models if not entry.get("parent")), models[0]["id"]
            )
        return self._model

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        """Samples `num_return_sequences` completions per prompt with the latest published
        weights; one request per prompt, `max_concurrent_requests` at a time.

        Returns:
            `(prompt_ids, prompt_mask, completion_ids, logps)`, as
            `generate_with_transformers(..., return_logprobs=True)`.
        """
        group_size = generation_config.num_return_sequences or 1
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        seeds = prompt_seeds(seed, len(prompts), group_size)
        model = self.adapter_name or self.model
        payloads = [
            self._completion_payload(ids, generation_config, prompt_seed, model)
            for ids, prompt_seed in zip(prompts, seeds)
        ]
        workers = max(1, min(self.max_concurrent_requests, len(payloads)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            responses = list(pool.map(lambda p: self._request("/v1/completions", p), payloads))
        completions, logprobs = [], []
        for response in responses:
            for choice in sorted(response["choices"], key=lambda choice: choice["index"]):
                completions.append(list(choice["token_ids"]))
                logprobs.append([float(value) for value in choice["logprobs"]["token_logprobs"]])
        return to_tensors(prompt_ids, prompt_mask, completions, logprobs, generation_config)

    @staticmethod
    def _completion_payload(prompt: list[int], generation_config, seed, model) -> dict:
        fields = sampling_fields(generation_config, seed)
        fields["logprobs"] = 1  # the OpenAI API's minimum; the sampled token's is always there
        return dict(
            model=model,
            prompt=prompt,
            **fields,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            skip_special_tokens=False,
        )

    # --- weights -------------------------------------------------------------------------------
    def publish_adapter(self, adapter_dir, version: int) -> None:
        """Loads the PEFT adapter saved in `adapter_dir` as version `version` and makes it the one
        later `generate` calls use; the previous version is unloaded. A version the server
        already has (published again after a resume, by this engine or by the run that stopped
        while the server stayed up) is replaced in place."""
        name = f"{self.adapter_prefix}-v{version}"
        # In place always: a name that is not loaded yet is simply loaded, and one that is gets
        # the new weights, where vLLM would refuse a second load of the name.
        payload = dict(lora_name=name, lora_path=os.path.abspath(adapter_dir), load_inplace=True)
        try:
            self._request("/v1/load_lora_adapter", payload)
        except VLLMServerError as error:
            raise self._adapter_error(error, adapter_dir) from None
        previous, self.adapter_name, self.adapter_version = self.adapter_name, name, version
        if previous is not None and previous != name:
            self._request("/v1/unload_lora_adapter", {"lora_name": previous})

    def _adapter_error(self, error: VLLMServerError, adapter_dir) -> VLLMServerError:
        message = str(error)
        if "max_lora_rank" in message:
            rank = adapter_rank(adapter_dir)
            return VLLMServerError(
                f"The adapter's LoRA rank {rank} is above the --max-lora-rank of the vLLM server "
                f"at {self.base_url}: restart the server with --max-lora-rank {rank} (or more), "
                f"or train with a smaller lora_r. ({message})"
            )
        if "HTTP 404" in message or "HTTP 405" in message or "not enabled" in message.lower():
            return VLLMServerError(
                f"The vLLM server at {self.base_url} cannot load LoRA adapters: start it with "
                "--enable-lora --max-lora-rank R and the environment variable "
                f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True. ({message})"
            )
        return error

    def load_weights(self, named_tensors) -> None:
        """Full weights cannot reach an unmodified vLLM server."""
        raise ValueError(
            f"The vLLM server at {self.base_url} cannot take full weights: an unmodified vLLM "
            "server only loads LoRA adapters. Train with LoRA (use_peft=True), or use "
            "vllm_mode='colocate' for full fine-tuning."
        )
