"""Run the tool calls of a batch: each rollout's calls in the order the model wrote them.

A call is `(toolset, tool_call)`, `tool_call` as `transformers`' `parse_response` gives it:
`{"type": "function", "function": {"name": ..., "arguments": {...}}}`. Its result is the tool's
return value, or `{"error": message}` (as in TRL) when the tool is unknown, the arguments do not
fit its signature, it raises, or it runs past the timeout: a failure is a message to the model,
never the end of the run. A rollout's results keep the order of its calls (TRL puts the results
of async tools after the sync ones, whatever the order of the calls).

Where calls run:

- **Default (`max_workers=1`), as TRL does.** Sync tools run on the thread that calls `run` (the
  main thread in synchronous training), one after another: rollout 0's calls, then rollout 1's,
  as TRL runs them. Async tools (`async def`, or a tool with an `async_call`) run on one event
  loop, in a thread of its own, as TRL's do. A rollout's calls still run one after the other,
  each starting when the one before has returned, but the async calls of different rollouts
  overlap: while rollout 0 awaits its call, rollout 1's calls run. (TRL awaits a rollout's async
  calls together, then goes to the next rollout.) A sync call on the calling thread cannot be
  stopped, so `timeout` does not apply to it (TRL has no timeout at all).
- **Threads (`max_workers` > 1), opt-in.** Sync calls run on `max_workers` worker threads, each
  rollout's calls one after the other on one of them. An environment made by `create` (the
  `Agent` makes every environment this way) lives on one worker: it is made there, and its
  `reset`, tool methods and `get_reward` (through `call_on`) run there only, so an object bound
  to the thread that made it (an SQLite connection) keeps working. Other rollouts are spread
  over the workers in turn. A Python thread cannot be stopped: a sync call past its timeout
  keeps its worker until it returns; a fresh worker takes its place for rollouts without an
  environment, and the calls of an environment living on it fail at once meanwhile (its next
  `reset` waits). Daemon threads, so a tool that never returns does not block the interpreter's
  exit.

An async call past the timeout is cancelled. A call that fails for a threading reason (an SQLite
object used from another thread, `signal` used off the main thread) is reported once per tool
with a warning that says why, besides its error result.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any

from .functions import ToolSet, async_function
from .results import ToolResult, error_result

ToolCall = tuple[ToolSet, dict]

_TIMED_OUT = object()  # what an async call past its timeout gives


def threading_failure(error: BaseException) -> bool:
    """Whether `error` says that an object was used from a thread it cannot be used from: an
    SQLite connection made in another thread, or `signal` (e.g. `signal.alarm`, which math_verify
    uses for its timeouts) off the main thread."""
    message = str(error)
    sqlite3 = sys.modules.get("sqlite3")  # imported if the tool uses SQLite
    if sqlite3 is not None and isinstance(error, sqlite3.ProgrammingError):
        return "thread" in message
    return isinstance(error, ValueError) and "signal only works in main thread" in message


class _Worker:
    """A thread that runs the sync calls queued for it, in order."""

    def __init__(self, runner: ToolRunner) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stuck = False  # running a call past its timeout
        name = f"ToolRunner-worker-{len(runner._all_workers)}"
        self.thread = threading.Thread(target=runner._work, args=(self,), name=name, daemon=True)
        self.thread.start()


class _Job:
    """One sync call sent to a worker thread."""

    def __init__(self, name: str, call, wake) -> None:
        self.name, self.call, self.wake = name, call, wake
        self.future: Future = Future()
        self.started: float | None = None
        self.worker: _Worker | None = None


class ToolRunner:
    """Runs the tool calls of a batch. Use it as a context manager, or call `close()`.

    Args:
        max_workers (`int`, *optional*, defaults to `1`):
            `1`: sync tools run on the calling thread, as in TRL. More: sync calls run on that
            many worker threads, with environments bound to one of them (see the module's
            docstring for what threads require).
        timeout (`float` or `None`, *optional*, defaults to `60.0`):
            Seconds an async call or a sync call on a worker thread may run (from when it
            starts); `None`: no limit. It does not apply to sync calls on the calling thread.
        timeout_setting (`str`, *optional*, defaults to `"ToolRunner(timeout=...)"`):
            Where a user raises the limit, named in the timeout error.
        workers_setting (`str`, *optional*, defaults to `"ToolRunner(max_workers=...)"`):
            Where a user sets the number of threads, named in the threading warning.
    """

    def __init__(
        self,
        max_workers: int = 1,
        timeout: float | None = 60.0,
        timeout_setting: str = "ToolRunner(timeout=...)",
        workers_setting: str = "ToolRunner(max_workers=...)",
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"`max_workers` must be at least 1, got {max_workers}.")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"`timeout` must be positive or None, got {timeout}.")
        self.max_workers, self.timeout = max_workers, timeout
        self.timeout_setting, self.workers_setting = timeout_setting, workers_setting
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []  # the free rotation; a stuck one is replaced here
        self._all_workers: list[_Worker] = []
        self._next_worker = 0
        self._homes: dict[int, tuple[Any, _Worker]] = {}  # id(environment) -> (it, its worker)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._closed = False

    @property
    def threaded(self) -> bool:
        """Whether sync calls run on worker threads (`max_workers` > 1)."""
        return self.max_workers > 1

    # --- environments -------------------------------------------------------------------------

    def create(self, factory):
        """`factory()`: on the calling thread by default; with threads, on the worker that will
        run every call of the new object (it is bound to it)."""
        if not self.threaded:
            return factory()
        with self._lock:
            worker = self._take_worker()
        instance = self._on(worker, factory)
        with self._lock:
            self._homes[id(instance)] = (instance, worker)
        return instance

    def call_on(self, instance, function):
        """`function()` on the thread `instance` is bound to (`create`): the calling thread
        by default. Waits, with no timeout (a `reset` or `get_reward`)."""
        worker = self._home(instance)
        return function() if worker is None else self._on(worker, function)

    def _home(self, instance) -> _Worker | None:
        if not self.threaded or instance is None:
            return None
        with self._lock:
            home = self._homes.get(id(instance))
            if home is None:  # made elsewhere: it lives on one worker from now on
                home = self._homes[id(instance)] = (instance, self._take_worker())
            return home[1]

    def _on(self, worker: _Worker, function):
        job = _Job(getattr(function, "__name__", "call"), function, wake=lambda: None)
        self._submit(worker, job)
        return job.future.result()

    # --- calls --------------------------------------------------------------------------------

    def run(self, calls: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Run the calls of every rollout, each rollout's in order; return the results per
        rollout, in call order."""
        wake = threading.Event()  # set when a call in flight starts or ends

        def notify(*_):
            wake.set()

        results: list[list[Any]] = [[None] * len(rollout) for rollout in calls]
        position = [0] * len(calls)
        homes = self._homes_of(calls)
        environments = [
            bool(rollout) and rollout[0][0].environment is not None for rollout in calls
        ]
        in_flight: dict[int, tuple[int, str, Any]] = {}  # rollout -> (call index, name, job)

        def advance(i: int) -> None:
            """Run rollout i's calls from its position on, until one is in flight or none is
            left."""
            while position[i] < len(calls[i]):
                j = position[i]
                toolset, tool_call = calls[i][j]
                name, call = self._prepare(toolset, tool_call)
                if isinstance(call, ToolResult):
                    results[i][j] = call
                elif (coroutine_function := call.coroutine_function) is not None:
                    future = self._start_async(coroutine_function, call.arguments)
                    future.add_done_callback(notify)
                    in_flight[i] = (j, name, future)
                    return
                elif homes[i] is not None:
                    job = _Job(name, call, wake=notify)
                    job.future.add_done_callback(notify)
                    if homes[i].stuck and homes[i] not in self._workers:
                        if not environments[i]:  # any worker will do
                            with self._lock:
                                homes[i] = self._take_worker()
                            continue
                        results[i][j] = error_result(name, self._busy_message(name))
                    else:
                        self._submit(homes[i], job)
                        in_flight[i] = (j, name, job)
                        return
                else:
                    results[i][j] = self._call_here(name, call)
                position[i] += 1

        for i in range(len(calls)):
            advance(i)
        while in_flight:
            wake.clear()
            now, deadline = time.monotonic(), float("inf")
            for i, (j, name, job) in list(in_flight.items()):
                future, started = (
                    (job.future, job.started) if isinstance(job, _Job) else (job, None)
                )
                if self.timeout is None:
                    started = None  # no deadline
                if future.done():
                    results[i][j] = self._outcome(name, future)
                elif started is not None and now - started >= self.timeout:
                    results[i][j] = self._time_out(job)
                else:
                    if started is not None:
                        deadline = min(deadline, started + self.timeout)
                    continue
                del in_flight[i]
                position[i] += 1
                advance(i)
            if in_flight:
                wake.wait(None if deadline == float("inf") else max(deadline - now, 0.0))
        return results

    def _homes_of(self, calls: list[list[ToolCall]]) -> list[_Worker | None]:
        """The worker that runs each rollout's sync calls (None: the calling thread)."""
        homes = []
        for rollout in calls:
            if not self.threaded or not rollout:
                homes.append(None)
                continue
            environment = rollout[0][0].environment
            if environment is not None:
                homes.append(self._home(environment))
            else:
                with self._lock:
                    homes.append(self._take_worker())
        return homes

    def _prepare(self, toolset: ToolSet, tool_call: dict):
        """`(name, _Call)` for a call that can run, `(name, ToolResult)` else."""
        if tool_call.get("type") != "function":
            name = tool_call.get("name", "unknown")
            return name, error_result(name, f"Unsupported tool call type: {tool_call.get('type')}")
        function = tool_call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments") or {}
        if name not in toolset:
            return name, error_result(name, f"Tool {name} not found.")
        if not isinstance(arguments, dict):
            message = f"The arguments of tool {name} must be a JSON object, got {arguments!r}."
            return name, error_result(name, message)
        try:
            inspect.signature(toolset[name]).bind(**arguments)
        except TypeError as error:
            return name, error_result(name, f"Invalid arguments for tool {name}: {error}")
        except ValueError:  # no signature to check (some builtins): the call itself will tell
            pass
        return name, _Call(toolset[name], async_function(toolset[name]), arguments)

    def _call_here(self, name: str, call: _Call) -> ToolResult:
        try:
            return ToolResult(name, call())
        except Exception as error:  # as TRL: a tool's exception is a message to the model
            self._warn_if_threading(name, error)
            return error_result(name, str(error))

    def _outcome(self, name: str, future: Future) -> ToolResult:
        if future.cancelled():
            return error_result(name, f"Tool {name} was cancelled.")
        error = future.exception()
        if error is not None:
            self._warn_if_threading(name, error)
            return error_result(name, str(error))
        if future.result() is _TIMED_OUT:
            return error_result(name, self._timeout_message(name))
        return ToolResult(name, future.result())

    def _timeout_message(self, name: str) -> str:
        return (
            f"Tool {name} timed out after {self.timeout:g} s. Raise the limit with "
            f"`{self.timeout_setting}` if the tool needs longer."
        )

    def _busy_message(self, name: str) -> str:
        return (
            f"Tool {name} was not run: the thread its environment lives on is still running an "
            f"earlier call that timed out after {self.timeout:g} s."
        )

    def _time_out(self, job: _Job) -> ToolResult:
        with self._lock:  # a worker that finishes now clears `stuck` after this
            if job.future.done():
                return self._outcome(job.name, job.future)
            worker = job.worker
            worker.stuck = True
            if worker in self._workers and not self._closed:
                self._workers[self._workers.index(worker)] = self._start_worker()
        return error_result(job.name, self._timeout_message(job.name))

    def _warn_if_threading(self, name: str, error: BaseException) -> None:
        if not threading_failure(error):
            return
        with self._lock:
            if name in self._warned:
                return
            self._warned.add(name)
        thread = threading.current_thread()
        if self.threaded:
            where = (
                f"{self.workers_setting.replace('...', str(self.max_workers))} runs sync tools "
                "on worker threads"
            )
            advice = f"use the default {self.workers_setting.replace('...', '1')}"
        else:
            where = f"sync tools run on the thread that samples the rollouts, here {thread.name!r}"
            advice = "run the rollouts on the main thread (synchronous training)"
        warnings.warn(
            f"Tool {name} failed because it ran on a thread it cannot run on: {error}. "
            f"{where[0].upper() + where[1:]}. Either {advice}, or make the tool thread-safe "
            "(for example, open its SQLite connection with check_same_thread=False, or time it "
            "out without signal). Its calls come back to the model as errors, counted in "
            "tools/failure_frequency.",
            RuntimeWarning,
            stacklevel=2,
        )

    # --- threads ------------------------------------------------------------------------------

    def _take_worker(self) -> _Worker:  # holds self._lock
        if self._closed:
            raise RuntimeError("This ToolRunner is closed.")
        while len(self._workers) < self.max_workers:
            self._workers.append(self._start_worker())
        worker = self._workers[self._next_worker % self.max_workers]
        self._next_worker += 1
        return worker

    def _start_worker(self) -> _Worker:  # holds self._lock
        worker = _Worker(self)
        self._all_workers.append(worker)
        return worker

    def _submit(self, worker: _Worker, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("This ToolRunner is closed.")
        worker.jobs.put(job)

    def _work(self, worker: _Worker) -> None:
        while (job := worker.jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            job.worker, job.started = worker, time.monotonic()
            job.wake()  # the batch now has a deadline for this call
            try:
                job.future.set_result(job.call())
            except BaseException as error:  # a tool's SystemExit must not kill the worker
                job.future.set_exception(error)
            with self._lock:
                worker.stuck = False

    # --- the event loop -----------------------------------------------------------------------

    def _start_async(self, coroutine_function, arguments: dict) -> Future:
        timeout = self.timeout

        async def bounded():
            task = asyncio.ensure_future(coroutine_function(**arguments))
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                return _TIMED_OUT
            return task.result()

        return asyncio.run_coroutine_threadsafe(bounded(), self._event_loop())

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("This ToolRunner is closed.")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(
                    target=self._loop.run_forever, name="ToolRunner-loop", daemon=True
                )
                self._loop_thread.start()
            return self._loop

    def close(self) -> None:
        """Stop the worker threads and the event loop and wait for them (a call still running past
        its timeout keeps its thread until it returns)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, loop, loop_thread = list(self._all_workers), self._loop, self._loop_thread
        for worker in workers:
            worker.jobs.put(None)
        for worker in workers:
            if not worker.stuck:
                worker.thread.join()
        if loop is not None:
            # calls still on the loop (cancelled past their timeout and cleaning up, as
            # run_python kills its program, or left running) get a few seconds to end
            try:
                asyncio.run_coroutine_threadsafe(_finish_tasks(5.0), loop).result(timeout=15.0)
            except Exception:  # the loop is wedged by a tool that blocks it: stop it anyway
                pass
            loop.call_soon_threadsafe(loop.stop)
            loop_thread.join()
            loop.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _Call:
    """A tool call ready to run: `call()` runs it synchronously; `coroutine_function` is set when
    it is to be awaited instead."""

    def __init__(self, function, coroutine_function, arguments: dict) -> None:
        self.function, self.coroutine_function = function, coroutine_function
        self.arguments = arguments

    def __call__(self):
        return self.function(**self.arguments)


async def _finish_tasks(seconds: float) -> None:
    """Let the other tasks of the running loop end (a cancelled call cleaning up), then cancel
    those still running; wait up to `seconds` for each."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    if not tasks:
        return
    _, running = await asyncio.wait(tasks, timeout=seconds)
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=seconds)
