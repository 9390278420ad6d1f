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

What the engine checks, so that a server set up differently from the trainer is an error that
says what to change, never a silent bias:

- before the first batch, that the server's log-probs are those of the sampling distribution
  (`--logprobs-mode processed_logprobs`): the importance-sampling correction divides by them;
- before each adapter is published, that the server still serves the model it served at the
  start: a server restarted with another model would otherwise go on with other base weights.

A server that stops answering (connection refused or dropped, HTTP 502/503/504: down or
restarting) is waited for up to `timeout` seconds (`vllm_server_timeout`, also the start-up wait),
retrying with a doubling back-off; a restarted server with the same model gets the latest
adapter again and the run goes on. A request the server fails (HTTP 500) is retried twice; one
that gets no answer within `request_timeout` seconds is not retried (the server is overloaded or
stuck, and a second copy of the request would only add to its work). Each ends in a
`VLLMServerError` that names the URL and the cause. Only `urllib` from the standard library is
used.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

from .images import refuse_images
from .vllm_sampling import (
    adapter_rank,
    prompt_seeds,
    sampling_fields,
    to_tensors,
    unpadded_prompts,
)
from .weights import OwnWeights

RETRIES_ON_SERVER_ERROR = 2  # HTTP 500: the server is up but failed; a bug rarely goes away
UNAVAILABLE = (502, 503, 504)  # a proxy with no server behind it, or a server starting up
PROBE_TEMPERATURE = 0.5
CLOSE_TIMEOUT = 5.0  # seconds `close` waits for the server to unload the adapter


class VLLMServerError(ConnectionError):
    """The vLLM server did not answer within the bounds, refused a request, or is set up in a way
    that would make training wrong. `status` is the HTTP status, when the server answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class VLLMServerEngine(OwnWeights):
    """Generation on a running vLLM server (`python -m vllm.entrypoints.openai.api_server`).

    Args:
        base_url (`str`):
            The server's address, e.g. `http://127.0.0.1:8000` (TRL's `vllm_server_base_url`, or
            `http://{vllm_server_host}:{vllm_server_port}`).
        timeout (`float`, *optional*, defaults to 240):
            Seconds to wait for the server to come up (`wait_until_ready`), as TRL's
            `vllm_server_timeout`; also how long a server that stops answering in the middle of a
            run is waited for (long enough for a restart) before the run fails.
        request_timeout (`float`, *optional*, defaults to 600):
            Seconds to wait for the answer to one request (one prompt's `n` completions).
        backoff (`float`, *optional*, defaults to 1.0):
            Seconds before the first retry; doubled each time, up to `max_backoff`.
        max_backoff (`float`, *optional*, defaults to 5.0):
            The longest wait between two retries (a server coming back is noticed soon).
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
        request_timeout: float = 600.0,
        backoff: float = 1.0,
        max_backoff: float = 5.0,
        max_concurrent_requests: int = 32,
        adapter_prefix: str = "adapter",
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.request_timeout = request_timeout
        self.backoff, self.max_backoff = backoff, max_backoff
        self.max_concurrent_requests = max_concurrent_requests
        self.adapter_prefix = adapter_prefix
        self.adapter_name = None  # the latest published adapter version, as the server names it
        self.adapter_version = None
        self._adapter_dir = None  # its folder, to load it again into a restarted server
        self._served = None  # (name, root) of the base model the server served first
        self._max_model_len = None
        self._logprobs_checked = False
        self._reload_lock = threading.Lock()

    # --- HTTP ---------------------------------------------------------------------------------
    def _request(self, path: str, payload: dict | None = None):
        """One request, retried while the server is unreachable or restarting (for up to
        `timeout` seconds) and twice on HTTP 500."""
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        deadline, delay, server_errors = None, self.backoff, 0
        while True:
            request = urllib.request.Request(url, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                    body = response.read().decode(errors="replace")
                try:
                    return json.loads(body)
                except ValueError:  # the adapter endpoints answer in plain text
                    return body
            except urllib.error.HTTPError as error:
                message = error.read().decode(errors="replace")
                if error.code == 500 and server_errors < RETRIES_ON_SERVER_ERROR:
                    server_errors += 1
                elif error.code not in UNAVAILABLE:  # retrying would not change the answer
                    verb = "failed" if error.code >= 500 else "refused"
                    raise VLLMServerError(
                        f"The vLLM server at {url} {verb} the request (HTTP {error.code}): "
                        f"{message}",
                        status=error.code,
                    ) from None
                cause = f"HTTP {error.code}: {message}"
            except TimeoutError:  # connected, but no answer in time
                raise VLLMServerError(
                    f"The vLLM server at {url} did not answer within {self.request_timeout:g} s. "
                    "It is overloaded or stuck: check its log, or lower max_concurrent_requests "
                    "or the completion length."
                ) from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                cause = repr(getattr(error, "reason", error))  # refused, dropped, unreachable
            now = time.monotonic()
            deadline = deadline or now + self.timeout
            if now >= deadline:
                raise VLLMServerError(
                    f"The vLLM server at {url} did not answer for {self.timeout:g} s "
                    f"(vllm_server_timeout; last: {cause}). Check that it is running and "
                    "reachable (vllm_server_base_url), then resume from the last checkpoint."
                )
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, self.max_backoff)

    def wait_until_ready(self) -> None:
        """Waits up to `timeout` seconds for the server's `/health` to answer."""
        try:
            self._request("/health")
        except VLLMServerError as error:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} was not up after {self.timeout:g} s "
                "(vllm_server_timeout). Start it first (python -m "
                f"vllm.entrypoints.openai.api_server ...). ({error})"
            ) from None

    def _base_model(self) -> tuple[str, str]:
        """`(name, root)` of the base model the server serves now."""
        base = self._base_entry()
        return base["id"], base.get("root") or base["id"]

    def _base_entry(self) -> dict:
        """The base model's entry of the server's `/v1/models` (adapters have a `parent`)."""
        models = self._request("/v1/models")["data"]
        return next((entry for entry in models if not entry.get("parent")), models[0])

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt plus completion the server takes (its `--max-model-len`), as its
        `/v1/models` reports it; None if it does not. Multi-turn rollouts end before a tool
        result would pass it: the server refuses such a prompt (HTTP 400)."""
        if self._max_model_len is None:
            self._max_model_len = self._base_entry().get("max_model_len")
        return self._max_model_len

    @property
    def model(self) -> str:
        """The base model's name on the server."""
        if self._served is None:
            self._served = self._base_model()
        return self._served[0]

    def check_same_model(self) -> None:
        """Raises if the server now serves another base model than the one it served first:
        it was restarted with another `--model`, and would generate from other weights."""
        first = self._served
        now = self._served = self._base_model()
        if first is not None and now != first:
            self._served = first
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} now serves {now[1]!r}, not {first[1]!r} "
                "that this run started with: it was restarted with a different model. Restart "
                f"it with --model {first[1]} and resume from the last checkpoint."
            )

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None, image_inputs=None):
        """Samples `num_return_sequences` completions per prompt with the latest published
        weights; one request per prompt, `max_concurrent_requests` at a time.

        Returns:
            `(prompt_ids, prompt_mask, completion_ids, logps)`, as
            `generate_with_transformers(..., return_logprobs=True)`.
        """
        refuse_images(self, image_inputs)
        group_size = generation_config.num_return_sequences or 1
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        if not self._logprobs_checked:
            self.check_logprobs_mode(prompts[0])
        seeds = prompt_seeds(seed, len(prompts), group_size)
        model = self.adapter_name or self.model
        payloads = [
            self._completion_payload(ids, generation_config, prompt_seed, model)
            for ids, prompt_seed in zip(prompts, seeds)
        ]
        workers = max(1, min(self.max_concurrent_requests, len(payloads)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            responses = list(pool.map(self._complete, payloads))
        completions, logprobs = [], []
        for response in responses:
            for choice in sorted(response["choices"], key=lambda choice: choice["index"]):
                completions.append(list(choice["token_ids"]))
                logprobs.append([float(value) for value in choice["logprobs"]["token_logprobs"]])
        return to_tensors(prompt_ids, prompt_mask, completions, logprobs, generation_config)

    def _complete(self, payload: dict) -> dict:
        try:
            return self._request("/v1/completions", payload)
        except VLLMServerError as error:
            # A 404 for our adapter: the server was restarted (and lost it) since it was loaded.
            if error.status != 404 or payload["model"] != self.adapter_name:
                raise
        self._reload_adapter(payload["model"])
        return self._request("/v1/completions", payload)

    def _reload_adapter(self, name: str) -> None:
        """Loads the latest adapter again into a server that restarted with the same model."""
        with self._reload_lock:  # the other prompts of the batch meet the same 404
            self.check_same_model()
            served = {entry["id"] for entry in self._request("/v1/models")["data"]}
            if name in served:
                return
            warnings.warn(
                f"The vLLM server at {self.base_url} was restarted: loading adapter {name} again.",
                stacklevel=2,
            )
            self._load_adapter(name, self._adapter_dir)

    def check_logprobs_mode(self, prompt: list[int]) -> None:
        """Raises unless the server's log-probs are those of the distribution it samples from
        (after temperature), i.e. it runs with `--logprobs-mode processed_logprobs`.

        Asks for the top-5 log-probs of the next token at temperature 1 and at
        `PROBE_TEMPERATURE`. Processed log-probs are `log softmax(z / T)`, so the gap between
        two tokens grows by 1 / T; raw ones (vLLM's default) do not depend on T. A model whose
        top tokens tie cannot tell the two apart and is let through.
        """
        gaps = []
        for temperature in (1.0, PROBE_TEMPERATURE):
            payload = dict(
                model=self.model,
                prompt=prompt,
                max_tokens=1,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                seed=0,
                logprobs=5,
                return_tokens_as_token_ids=True,
            )
            top = self._request("/v1/completions", payload)["choices"][0]["logprobs"]
            gaps.append(top["top_logprobs"][0])
        at_one, at_probe = gaps
        shared = sorted(set(at_one) & set(at_probe), key=lambda token: -at_one[token])
        values = [at_one[token] for token in shared] + [at_probe[token] for token in shared]
        if any(value > 1e-4 for value in values):
            self._logprobs_error("logits, not log-probs (--logprobs-mode *_logits)")
        if len(shared) >= 2:
            first, last = shared[0], shared[-1]
            gap_one = at_one[first] - at_one[last]
            gap_probe = at_probe[first] - at_probe[last]
            if gap_one > 1e-3 and gap_probe < gap_one * (1 + 1 / PROBE_TEMPERATURE) / 2:
                self._logprobs_error("log-probs from before temperature (raw_logprobs)")
        self._logprobs_checked = True

    def _logprobs_error(self, what: str) -> None:
        raise VLLMServerError(
            f"The vLLM server at {self.base_url} returns {what}: the importance-sampling "
            "correction needs the log-probs of the distribution it samples from, after "
            "temperature and top-k/top-p/min-p, and would be silently biased. Restart the server "
            "with --logprobs-mode processed_logprobs."
        )

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
        self.check_same_model()
        name = f"{self.adapter_prefix}-v{version}"
        self._load_adapter(name, adapter_dir)
        previous = self.adapter_name
        self.adapter_name, self.adapter_version, self._adapter_dir = name, version, adapter_dir
        if previous is not None and previous != name:
            try:
                self._request("/v1/unload_lora_adapter", {"lora_name": previous})
            except VLLMServerError as error:
                if error.status != 404:  # 404: a restarted server no longer has it
                    raise

    def _load_adapter(self, name: str, adapter_dir) -> None:
        # In place always: a name that is not loaded yet is simply loaded, and one that is gets
        # the new weights, where vLLM would refuse a second load of the name.
        payload = dict(lora_name=name, lora_path=os.path.abspath(adapter_dir), load_inplace=True)
        try:
            self._request("/v1/load_lora_adapter", payload)
        except VLLMServerError as error:
            raise self._adapter_error(error, adapter_dir) from None

    def _adapter_error(self, error: VLLMServerError, adapter_dir) -> VLLMServerError:
        message = str(error)
        if "max_lora_rank" in message:
            rank = adapter_rank(adapter_dir)
            return VLLMServerError(
                f"The adapter's LoRA rank {rank} is above the --max-lora-rank of the vLLM server "
                f"at {self.base_url}: restart the server with --max-lora-rank {rank} (or more), "
                f"or train with a smaller lora_r. ({message})",
                status=error.status,
            )
        if error.status in (404, 405) or "not enabled" in message.lower():
            return VLLMServerError(
                f"The vLLM server at {self.base_url} cannot load LoRA adapters: start it with "
                "--enable-lora --max-lora-rank R and the environment variable "
                f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True. ({message})",
                status=error.status,
            )
        return error

    def close(self) -> None:
        """Unloads the latest adapter version from the server, which keeps running for other
        runs (its adapter folder is about to be deleted). One attempt, bounded by
        `CLOSE_TIMEOUT`: a server that is down or was restarted has nothing to unload, and
        closing after a failed run must not wait `timeout` seconds for it. Then the adapter
        versions published are deleted."""
        name, self.adapter_name, self.adapter_version = self.adapter_name, None, None
        try:
            if name is not None:
                self._unload(name)
        finally:
            self.close_publisher()

    def _unload(self, name: str) -> None:
        request = urllib.request.Request(
            f"{self.base_url}/v1/unload_lora_adapter",
            data=json.dumps({"lora_name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=CLOSE_TIMEOUT) as response:
                response.read()
        except (OSError, http.client.HTTPException):  # down, restarted, or already unloaded
            pass

    def load_weights(self, named_tensors) -> None:
        """Full weights cannot reach an unmodified vLLM server."""
        raise ValueError(
            f"The vLLM server at {self.base_url} cannot take full weights: an unmodified vLLM "
            "server only loads LoRA adapters. Train with LoRA (use_peft=True), or use "
            "vllm_mode='colocate' for full fine-tuning."
        )
