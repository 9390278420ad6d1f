"""An LLM judge as a reward function: an OpenAI-compatible chat-completions server scores
completions against a rubric (TRL users write this themselves; ART's RULER is the group mode).

`judge_reward(base_url=..., model=..., rubric=...)` returns a reward function in TRL's convention
(`f(prompts=..., completions=..., **kwargs) -> list[float | None]`, named `judge`) that sends
`POST {base_url}/chat/completions` (`base_url` ends in `/v1`: a `vllm serve` server or any
provider; `api_key` as a `Bearer` token):

- `mode="pointwise"`: one request per completion; the judge replies with a score from 0 to 10,
  alone or after text such as `Score: 6` (the last `Score:` wins); the reward is score / 10.
- `mode="group"`: one request per group (consecutive completions of the same prompt, as the
  trainer orders them), all its completions numbered in one message, RULER-style; the judge
  replies with a JSON list of 0-10 scores in the order given; each reward is its score / 10.

Requests run concurrently, at most `max_concurrency` at a time (a thread pool of that size). A
judgment that fails (connection, timeout, HTTP status, an unparseable or out-of-range reply) is
`None` for its samples, which the trainer excludes from their advantages, never a silent 0 and
never an exception; each is counted in the `judge/failures` metric (logged through TRL's
`log_metric`; a warning names the first error of the batch). `judge/latency_s` (mean seconds per
request), `judge/requests`, `judge/cache_hits`, `judge/prompt_tokens` and
`judge/completion_tokens` (the server's `usage`, summed over the batch) are logged with it.

With `cache_dir`, every successful judgment is stored on disk, one small JSON file per key, the
SHA-256 of (judge model, rubric, mode, prompt, completion): a resumed or repeated run asks again
for nothing it was told before. A group is sent again only when one of its completions is new;
failures are not cached.

`check_server()` asks `GET {base_url}/models` once, so that a run can stop before training when
the judge cannot be reached (the recipe does, for `reward_funcs: [judge]`: docs/recipes.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ._convention import completion_text
from .registry import register_reward

logger = logging.getLogger(__name__)

MODES = ("pointwise", "group")
MAX_SCORE = 10.0

POINTWISE_INSTRUCTIONS = (
    "You are a strict judge. Read the task given to an assistant and the assistant's response, "
    "then grade the response against this rubric:\n\n{rubric}\n\nEnd your reply with a line "
    "`Score: N`, where N is a number from 0 (worst) to 10 (best)."
)
GROUP_INSTRUCTIONS = (
    "You are a strict judge. Read the task given to an assistant and {count} candidate "
    "responses, then grade each response against this rubric, comparing them with each other:"
    "\n\n{rubric}\n\nReply with a JSON list of {count} numbers from 0 (worst) to 10 (best), one "
    "per response, in the order given, e.g. [3, 7]."
)

_SCORE_AFTER_LABEL = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_BARE_SCORE = re.compile(r"^\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*10)?\s*\**\s*\.?\s*$")
_JSON_LIST = re.compile(r"\[[^\[\]]*\]")


class JudgmentError(ValueError):
    """A judge's reply that holds no valid score (or the request that failed)."""


def parse_pointwise(reply: str) -> float:
    """The score of a pointwise reply, from 0 to 10: the number after the last `Score:` label, or
    the reply itself when it is a bare number (`7`, `7/10`).

    Raises:
        `JudgmentError`: when the reply has no such number, or it is outside [0, 10].
    """
    labelled = _SCORE_AFTER_LABEL.findall(reply)
    if labelled:
        value = float(labelled[-1])
    else:
        bare = _BARE_SCORE.match(reply)
        if bare is None:
            raise JudgmentError(f"no `Score: N` in the judge's reply {reply[-200:]!r}")
        value = float(bare.group(1))
    return _checked(value)


def parse_group(reply: str, count: int) -> list[float]:
    """The `count` scores of a group reply, each from 0 to 10: the last JSON list of `count`
    numbers in the reply.

    Raises:
        `JudgmentError`: when no list of `count` numbers from 0 to 10 is found.
    """
    for candidate in reversed(_JSON_LIST.findall(reply)):
        try:
            values = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if len(values) == count and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            return [_checked(float(v)) for v in values]
    raise JudgmentError(f"no JSON list of {count} scores in the judge's reply {reply[-200:]!r}")


def _checked(value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_SCORE):
        raise JudgmentError(f"the judge's score {value} is outside 0-{MAX_SCORE:g}")
    return value


def render_prompt(prompt) -> str:
    """A prompt as the judge reads it: the string, or each message as `role: content`."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(
        f"{message.get('role', 'user')}: {completion_text([message])}" for message in prompt
    )


@dataclass
class _Outcome:
    """What one request brought back: scores (None on failure), its cost, its error."""

    scores: list[float | None]
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    requested: bool = True


@dataclass
class JudgeStats:
    """Totals over the judge's lifetime (the metrics are per batch)."""

    requests: int = 0
    failures: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class JudgeReward:
    """A reward function in TRL's convention that asks an LLM judge; see `judge_reward`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        rubric: str,
        mode: str = "pointwise",
        cache_dir: str | os.PathLike | None = None,
        max_concurrency: int = 8,
        timeout: float = 60.0,
        api_key: str | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
        extra_body: dict | None = None,
    ):
        import httpx

        if mode not in MODES:
            raise ValueError(f"judge_reward: mode={mode!r}; expected one of {MODES}.")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"judge_reward: base_url={base_url!r}; expected the server's OpenAI-compatible "
                "root URL, e.g. 'http://127.0.0.1:8000/v1'."
            )
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"judge_reward: max_concurrency={max_concurrency!r}; expected >= 1.")
        if not rubric or not isinstance(rubric, str):
            raise ValueError("judge_reward: rubric must be a non-empty string.")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.rubric, self.mode = model, rubric, mode
        self.max_concurrency, self.timeout = max_concurrency, timeout
        self.max_tokens, self.temperature = max_tokens, temperature
        self.extra_body = dict(extra_body or {})
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        if self.cache_dir is not None:
            os.makedirs(self.cache_dir, exist_ok=True)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_concurrency),
        )
        self.stats = JudgeStats()
        self.__name__ = "judge"

    # ------------------------------------------------------------------ the reward function

    def __call__(self, prompts, completions, log_metric: Callable | None = None, **kwargs):
        texts = [completion_text(completion) for completion in completions]
        prompt_texts = [render_prompt(prompt) for prompt in prompts]
        if len(prompt_texts) != len(texts):
            raise ValueError(f"judge: {len(prompt_texts)} prompts for {len(texts)} completions.")
        if self.mode == "pointwise":
            jobs = [[index] for index in range(len(texts))]
        else:
            jobs = _groups(prompt_texts)
        rewards: list[float | None] = [None] * len(texts)
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            outcomes = list(
                pool.map(
                    lambda job: self._judge(prompt_texts[job[0]], [texts[i] for i in job]), jobs
                )
            )
        for job, outcome in zip(jobs, outcomes):
            for index, score in zip(job, outcome.scores):
                rewards[index] = None if score is None else score / MAX_SCORE
        self._log(outcomes, rewards, log_metric)
        return rewards

    def check_server(self) -> None:
        """Asks `GET {base_url}/models` once, before any judgment: the server answers, accepts
        the key and, where it lists its models (vLLM, OpenAI), serves `model`. A server that
        answers with another status (a provider without that endpoint) passes.

        Raises:
            `ConnectionError`: when nothing answers at the URL's host and port in `timeout`.
            `ValueError`: when the server refuses the key (401, 403) or does not serve `model`.
        """
        import httpx

        base_url = self.url[: -len("/chat/completions")]
        address = httpx.URL(base_url)
        port = address.port or (443 if address.scheme == "https" else 80)
        try:
            response = self._client.get(base_url + "/models", timeout=min(self.timeout, 10.0))
        except httpx.HTTPError as error:
            raise ConnectionError(
                f"The judge server at {address.host}:{port} ({base_url}) cannot be reached "
                f"({type(error).__name__}: {error}). Start it (e.g. `vllm serve <model folder> "
                f"--port {port}`) or point the judge's base_url at a running one."
            ) from None
        if response.status_code in (401, 403):
            raise ValueError(
                f"The judge server at {address.host}:{port} refused the request to "
                f"{base_url}/models (HTTP {response.status_code}): give its API key."
            )
        if response.status_code != 200:
            return
        try:
            served = [entry["id"] for entry in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            return
        if self.model not in served:
            raise ValueError(
                f"The judge server at {address.host}:{port} does not serve the model "
                f"{self.model!r}; it serves {served}. Give one of these as the judge's model "
                "(vLLM names a model by its --served-model-name, else by its path)."
            )

    def close(self) -> None:
        """Closes the HTTP connections."""
        self._client.close()

    def __repr__(self) -> str:
        return f"JudgeReward(model={self.model!r}, mode={self.mode!r}, url={self.url!r})"

    # ------------------------------------------------------------------ one judgment

    def _judge(self, prompt: str, completions: list[str]) -> _Outcome:
        keys = [self._key(prompt, completion) for completion in completions]
        cached = [self._read_cache(key) for key in keys]
        if all(score is not None for score in cached):
            return _Outcome(scores=cached, requested=False)
        if self.mode == "pointwise":
            system = POINTWISE_INSTRUCTIONS.format(rubric=self.rubric)
            user = f"Task:\n{prompt}\n\nResponse:\n{completions[0]}"
        else:
            system = GROUP_INSTRUCTIONS.format(rubric=self.rubric, count=len(completions))
            answers = "\n\n".join(
                f"Response {number}:\n{completion}"
                for number, completion in enumerate(completions, start=1)
            )
            user = f"Task:\n{prompt}\n\n{answers}"
        outcome = self._request(system, user, len(completions))
        if outcome.error is None:
            for key, score in zip(keys, outcome.scores):
                self._write_cache(key, score)
        return outcome

    def _request(self, system: str, user: str, count: int) -> _Outcome:
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **self.extra_body,
        }
        started = time.perf_counter()
        usage: dict = {}
        try:
            response = self._client.post(self.url, json=body)
            latency = time.perf_counter() - started
            if response.status_code != 200:
                raise JudgmentError(f"HTTP {response.status_code}: {response.text[:200]!r}")
            payload = response.json()
            usage = payload.get("usage") or {}
            reply = payload["choices"][0]["message"]["content"] or ""
            if self.mode == "pointwise":
                scores: list[float | None] = [parse_pointwise(reply)]
            else:
                scores = list(parse_group(reply, count))
            error = None
        except Exception as failure:  # noqa: BLE001 - a judgment that fails is None, not a crash
            latency = time.perf_counter() - started
            scores, error = [None] * count, f"{type(failure).__name__}: {failure}"
        return _Outcome(
            scores=scores,
            latency_s=latency,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            error=error,
        )

    # ------------------------------------------------------------------ cache and metrics

    def _key(self, prompt: str, completion: str) -> str:
        identity = json.dumps([self.model, self.rubric, self.mode, prompt, completion])
        return hashlib.sha256(identity.encode()).hexdigest()

    def _read_cache(self, key: str) -> float | None:
        if self.cache_dir is None:
            return None
        try:
            with open(os.path.join(self.cache_dir, key + ".json"), encoding="utf-8") as file:
                return float(json.load(file)["score"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_cache(self, key: str, score: float) -> None:
        if self.cache_dir is None:
            return
        # Written whole, then renamed: a reader (another process of the run) never sees half.
        handle, temporary = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump({"score": score, "model": self.model}, file)
        os.replace(temporary, os.path.join(self.cache_dir, key + ".json"))

    def _log(self, outcomes: list[_Outcome], rewards: list, log_metric: Callable | None) -> None:
        requested = [outcome for outcome in outcomes if outcome.requested]
        failures = sum(score is None for score in rewards)
        metrics = {
            "judge/failures": float(failures),
            "judge/requests": float(len(requested)),
            "judge/cache_hits": float(len(outcomes) - len(requested)),
            "judge/prompt_tokens": float(sum(o.prompt_tokens for o in requested)),
            "judge/completion_tokens": float(sum(o.completion_tokens for o in requested)),
        }
        if requested:
            metrics["judge/latency_s"] = sum(o.latency_s for o in requested) / len(requested)
        with self.stats.lock:
            self.stats.requests += len(requested)
            self.stats.failures += failures
            self.stats.cache_hits += len(outcomes) - len(requested)
            self.stats.prompt_tokens += int(metrics["judge/prompt_tokens"])
            self.stats.completion_tokens += int(metrics["judge/completion_tokens"])
        if callable(log_metric):
            for name, value in metrics.items():
                log_metric(name, value)
        errors = [outcome.error for outcome in requested if outcome.error is not None]
        if errors:
            logger.warning(
                "judge %r at %s: %d of %d requests failed; their %d samples get None (excluded "
                "from training). First error: %s",
                self.model,
                self.url,
                len(errors),
                len(requested),
                failures,
                errors[0],
            )


def _groups(prompts: list[str]) -> list[list[int]]:
    """Indices of consecutive runs of the same prompt: the trainer's groups."""
    groups: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


@register_reward("judge", factory=True)
def judge_reward(
    *,
    base_url: str,
    model: str,
    rubric: str,
    mode: str = "pointwise",
    cache_dir: str | os.PathLike | None = None,
    max_concurrency: int = 8,
    timeout: float = 60.0,
    api_key: str | None = None,
    max_tokens: int = 512,
    temperature: float = 0.0,
    extra_body: dict | None = None,
) -> JudgeReward:
    """A reward function that asks an LLM judge served with an OpenAI-compatible API.

    Args:
        base_url (`str`):
            The server's API root, ending in `/v1` (`http://127.0.0.1:8000/v1` for `vllm serve`);
            requests go to `{base_url}/chat/completions`.
        model (`str`):
            The judge model's name on that server.
        rubric (`str`):
            What makes a response good, in words; part of the judge's instructions.
        mode (`str`, *optional*, defaults to `"pointwise"`):
            `"pointwise"`: one request per completion, a `Score: N` reply (0-10). `"group"`: one
            request per group of completions of the same prompt, a JSON list of 0-10 scores.
        cache_dir (`str` or `os.PathLike`, *optional*):
            A folder where judgments are kept, keyed by (model, rubric, mode, prompt,
            completion); none are kept when unset.
        max_concurrency (`int`, *optional*, defaults to `8`):
            The most requests in flight at once.
        timeout (`float`, *optional*, defaults to `60.0`):
            Seconds to wait for a request; one that takes longer is a failure (None).
        api_key (`str`, *optional*):
            Sent as `Authorization: Bearer <api_key>`.
        max_tokens (`int`, *optional*, defaults to `512`):
            The most tokens of the judge's reply.
        temperature (`float`, *optional*, defaults to `0.0`):
            The judge's sampling temperature.
        extra_body (`dict`, *optional*):
            More fields of the request body, e.g. vLLM's `structured_outputs`.

    Returns:
        [`JudgeReward`]: a reward function named `judge`, in TRL's convention; rewards are
        score / 10, `None` where the judgment failed.

    Example:
        >>> reward = judge_reward(
        ...     base_url="http://127.0.0.1:8000/v1", model="HuggingFaceTB/SmolLM2-135M-Instruct",
        ...     rubric="Is the answer correct and concise?", mode="group", cache_dir="judge-cache",
        ... )  # doctest: +SKIP
    """
    return JudgeReward(
        base_url=base_url,
        model=model,
        rubric=rubric,
        mode=mode,
        cache_dir=cache_dir,
        max_concurrency=max_concurrency,
        timeout=timeout,
        api_key=api_key,
        max_tokens=max_tokens,
        temperature=temperature,
        extra_body=extra_body,
    )
