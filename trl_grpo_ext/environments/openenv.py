"""An OpenEnv environment server as the trainer's `environment_factory`.

OpenEnv (openenv-core) serves an `Environment` over HTTP with `create_app` (uvicorn; no Docker
needed on loopback); each WebSocket connection to its `/ws` endpoint is a session of its own.
`from_openenv(url)` returns an `environment_factory` whose instances are OpenEnv clients:

- each rollout opens a session of its own (a new connection, the rollout's previous one closed)
  and resets it in `reset(**row)`, whose observation is appended to the prompt; a step before a
  reset is an error, so no step reaches a session that was not reset;
- `mode="tools"` (multi-turn): one tool, `step` by default, whose parameters are the fields of
  the server's action (its `/schema`); each call the model makes steps the session and returns
  the observation; a call after the episode is done steps nothing and says so;
- `mode="completion"`: no tools; the completion is the action (`action(text)` builds it, by
  default `{field: text}` for an action with one field), stepped once when the rollout is scored;
- the reward is the server's: the sum of the rewards its observations carried during the rollout
  (`get_reward`, the `OpenEnv` reward function; with `mode="completion"`, `openenv`).

The model sees an observation as the string of its one text field, or else as the JSON of its
fields (without `done`, `reward` and `metadata`); `observation=` renders it otherwise. Clients run
on one background event loop shared by every instance.

`serve_environment(env, action_cls, observation_cls)` serves an `Environment` factory on
loopback in this process (uvicorn in a thread) and returns its URL; `server=` takes a callable
that starts a server and returns its URL, called once.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from ._imports import require
from ._tool_environment import ToolSpec, environment_class

MODES = ("tools", "completion")
_JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}

# ------------------------------------------------------------------ one loop for every client

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="openenv-clients", daemon=True).start()
        return _loop


def _run(coroutine) -> Any:
    return asyncio.run_coroutine_threadsafe(coroutine, _background_loop()).result()


# ------------------------------------------------------------------ the server


def _host_port(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlparse(url)
    default = 443 if parsed.scheme in ("https", "wss") else 80
    return parsed.hostname or "", parsed.port or default


def fetch_schema(url: str, timeout: float = 10.0) -> dict:
    """The server's `/schema` (`action`, `observation`, `state` JSON schemas).

    Raises:
        `ConnectionError`: naming the host and port, when the server cannot be reached.
    """
    host, port = _host_port(url)
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/schema", timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise ConnectionError(
            f"The OpenEnv server at {host}:{port} answered /schema with HTTP {error.code}; is "
            f"{url} an OpenEnv environment server (openenv.core.create_app)?"
        ) from error
    except (OSError, ValueError) as error:
        raise ConnectionError(
            f"Cannot reach the OpenEnv server at {host}:{port} ({url}): {error}. Start it (e.g. "
            "`uvicorn my_env.server.app:app --port PORT`, or serve_environment(...)) or fix the "
            "URL."
        ) from error


class LocalServer:
    """An OpenEnv app served by uvicorn on loopback, in a thread of this process."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"The OpenEnv server on {self.host}:{self.port} did not start.")
            self._thread.join(0.02)

    def stop(self) -> None:
        """Stops the server and waits for its thread."""
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_environment(
    env: Callable, action_cls: type, observation_cls: type, max_concurrent_envs: int = 64
) -> LocalServer:
    """Serves the OpenEnv `Environment` factory `env` on a free loopback port, in this process.

    Args:
        env (`Callable[[], Environment]`): the environment class or factory (one per session).
        action_cls (`type`): its `Action` subclass.
        observation_cls (`type`): its `Observation` subclass.
        max_concurrent_envs (`int`, *optional*, defaults to `64`): sessions at once (the class
            must set `SUPPORTS_CONCURRENT_SESSIONS = True` for more than 1); at least the
            number of rollouts of a generation batch.

    Returns:
        [`LocalServer`]: `.url` for `from_openenv`, `.stop()` when done.
    """
    core = require("openenv.core.env_server", "openenv-core")
    app = core.create_app(env, action_cls, observation_cls, max_concurrent_envs=max_concurrent_envs)
    return LocalServer(app)


# ------------------------------------------------------------------ the environments


def render_observation(observation: dict) -> str:
    """What the model reads of an observation: its one text field, or its fields as JSON."""
    fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, default=str)


def _observation_dict(observation) -> dict:
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    if isinstance(observation, dict):
        return dict(observation)
    return {"observation": observation}


class OpenEnvSession:
    """The base of the environment class `from_openenv` makes: one OpenEnv session per rollout.

    Its only public method is `reset` (and, in "tools" mode, `get_reward` and the made `step`
    tool); everything else is private, since public methods are the model's tools."""

    _url: str = ""
    _client_class: type | None = None
    _action: Callable[[dict], Any] = staticmethod(lambda arguments: arguments)
    _render: Callable[[dict], str] = staticmethod(render_observation)
    _reset_kwargs: Callable[[dict], dict] = staticmethod(lambda row: {})
    _timeout: float = 60.0

    def __init__(self):
        self._client = None
        self._rewards: list[float] = []
        self._done = False
        self._was_reset = False

    def reset(self, **row) -> str:
        """Opens a session of its own for this rollout (closing the previous one) and resets it."""
        self._close()
        self._client = self._client_class(base_url=self._url, message_timeout_s=self._timeout)
        host, port = _host_port(self._url)
        try:
            _run(self._client.connect())
        except ConnectionError as error:
            raise ConnectionError(
                f"Cannot open a session on the OpenEnv server at {host}:{port}: {error}"
            ) from error
        result = _run(self._client.reset(**self._reset_kwargs(row)))
        self._rewards, self._done, self._was_reset = [], bool(result.done), True
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        return self._render(_observation_dict(result.observation))

    def _total_reward(self) -> float | None:
        """The sum of the rewards the server gave during the rollout (None before a reset)."""
        return sum(self._rewards) if self._was_reset else None

    def _step(self, arguments: dict) -> str:
        if not self._was_reset:
            raise RuntimeError("The OpenEnv session was not reset; reset(**row) comes first.")
        if self._done:
            return "The episode is over: nothing was done."
        result = _run(self._client.step(self._action(arguments)))
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        self._done = bool(result.done)
        return self._render(_observation_dict(result.observation))

    def _call_tool(self, name: str, arguments: dict) -> str:
        return self._step(arguments)

    def _close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            _run(client.disconnect())


class OpenEnvToolSession(OpenEnvSession):
    """A session stepped by the model's tool calls; its reward is the server's."""

    def get_reward(self) -> float | None:
        """The sum of the rewards the server gave during the rollout (None before a reset)."""
        return self._total_reward()


def _action_fields(schema: dict) -> dict:
    properties = dict(schema.get("action", {}).get("properties", {}))
    properties.pop("metadata", None)
    return properties


def _step_spec(tool_name: str, schema: dict) -> ToolSpec:
    action = schema.get("action", {})
    required = set(action.get("required", []))
    parameters, docs = [], {}
    for name, field in _action_fields(schema).items():
        annotation = _JSON_TYPES.get(field.get("type"), str)
        default = inspect.Parameter.empty if name in required else field.get("default")
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
        docs[name] = field.get("description") or field.get("title") or ""
    description = action.get("description") or "Take one action in the environment."
    return ToolSpec(tool_name, description + " Returns the new observation.", parameters, docs)


def _completion_reward(name: str, action: Callable[[str], Any]):
    from ..rewards import completion_text

    def reward(completions, environments=None, **kwargs) -> list[float | None]:
        if environments is None:
            raise ValueError(
                f"The {name} reward steps each rollout's OpenEnv session; it needs the trainer's "
                "`environments` (use it with the environment_factory from_openenv returned)."
            )
        values = []
        for completion, environment in zip(completions, environments, strict=True):
            environment._step(action(completion_text(completion)))
            values.append(environment._total_reward())
        return values

    reward.__name__ = reward.__qualname__ = name
    return reward


def _checked_inputs(url, server, client_class, mode, action, reset_kwargs, observation):
    """`from_openenv`'s arguments checked: `(url, client_class)`, the server's HTTP address
    (started by `server` when given) and the client class (`GenericEnvClient` by default); a
    wrong kind of argument is a `TypeError` or `ValueError` that says what was expected."""
    from openenv.core import EnvClient, GenericEnvClient

    if mode not in MODES:
        raise ValueError(f"from_openenv: mode={mode!r}; expected one of {MODES}.")
    if (url is None) == (server is None):
        raise ValueError(
            "from_openenv: give the server's `url`, or `server`, a callable that starts it and "
            "returns its URL (one of the two)."
        )
    if server is not None:
        if not callable(server):
            raise TypeError(f"from_openenv: server is a {type(server).__name__}, not a callable.")
        url = server()
    if not isinstance(url, str) or not url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ValueError(
            f"from_openenv: url={url!r}; expected the server's address, e.g. "
            "'http://127.0.0.1:8000'."
        )
    url = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    client_class = client_class or GenericEnvClient
    if not (isinstance(client_class, type) and issubclass(client_class, EnvClient)):
        raise TypeError(
            f"from_openenv: client_class is {client_class!r}; expected a subclass of "
            "openenv.core.EnvClient (the environment's client, or GenericEnvClient)."
        )
    for name, value in (
        ("action", action),
        ("reset_kwargs", reset_kwargs),
        ("observation", observation),
    ):
        if value is not None and not callable(value):
            raise TypeError(f"from_openenv: {name} is a {type(value).__name__}, not a callable.")
    return url, client_class


def from_openenv(
    url: str | None = None,
    *,
    server: Callable[[], str] | None = None,
    client_class: type | None = None,
    mode: str = "tools",
    action: Callable | None = None,
    tool_name: str = "step",
    reset_kwargs: Callable[[dict], dict] | None = None,
    observation: Callable[[dict], str] | None = None,
    timeout: float = 60.0,
) -> dict:
    """An OpenEnv environment server as `GroupRelativeTrainer` keyword arguments.

    Args:
        url (`str`, *optional*):
            The server's URL (`http://127.0.0.1:8000`). Give `url` or `server`.
        server (`Callable[[], str]`, *optional*):
            Starts a server (e.g. `lambda: serve_environment(MyEnv, MyAction, MyObs).url`) and
            returns its URL; called once, now.
        client_class (`type`, *optional*):
            An `openenv.core.EnvClient` subclass (the environment's own client); defaults to
            `GenericEnvClient` (actions and observations as dicts).
        mode (`str`, *optional*, defaults to `"tools"`):
            `"tools"`: the model's calls of the `step` tool step the session (multi-turn).
            `"completion"`: the completion is the action, stepped once when scored.
        action (`Callable`, *optional*):
            Builds the client's action: from the tool's arguments (a dict) in `"tools"` mode,
            from the completion's text in `"completion"` mode. Defaults: the dict itself; the
            text as the action's only field.
        tool_name (`str`, *optional*, defaults to `"step"`):
            The name the model calls the step tool by.
        reset_kwargs (`Callable[[dict], dict]`, *optional*):
            The server's `reset` arguments for a dataset row; by default its `seed` column if it
            has one, else none.
        observation (`Callable[[dict], str]`, *optional*):
            Renders an observation (a dict) for the model (`render_observation` by default).
        timeout (`float`, *optional*, defaults to `60.0`):
            Seconds to wait for each answer of the server.

    Returns:
        `dict`: `environment_factory` (and `reward_funcs` in `"completion"` mode).

    Raises:
        `ConnectionError`: naming host and port, when the server cannot be reached.
    """
    require("openenv.core", "openenv-core")
    url, client_class = _checked_inputs(
        url, server, client_class, mode, action, reset_kwargs, observation
    )
    schema = fetch_schema(url, timeout)
    fields = _action_fields(schema)

    attributes = {
        "_url": url,
        "_client_class": client_class,
        "_render": staticmethod(observation or render_observation),
        "_reset_kwargs": staticmethod(
            reset_kwargs or (lambda row: {"seed": row["seed"]} if "seed" in row else {})
        ),
        "_timeout": timeout,
    }
    if mode == "tools":
        spec = _step_spec(tool_name, schema)
        cls = environment_class("OpenEnv", OpenEnvToolSession, [spec])
        if action is not None:
            attributes["_action"] = staticmethod(action)
        for name, value in attributes.items():
            setattr(cls, name, value)
        return {"environment_factory": cls}

    if action is None:
        if len(fields) != 1:
            raise ValueError(
                f"from_openenv: the server's action has the fields {sorted(fields)}; with "
                "mode='completion', pass action=, a function from the completion's text to the "
                "action."
            )
        (only_field,) = fields
        action = lambda text: {only_field: text}  # noqa: E731
    # No get_reward: the reward function below steps the session with the completion and is
    # the only reward.
    cls = type("OpenEnvSession", (OpenEnvSession,), {})
    for name, value in attributes.items():
        setattr(cls, name, value)
    return {"environment_factory": cls, "reward_funcs": [_completion_reward("openenv", action)]}
