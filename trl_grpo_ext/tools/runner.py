"""Run the tool calls of a whole batch concurrently, each under a timeout.

A call is `(toolset, tool_call)`, `tool_call` as `transformers`' `parse_response` gives it:
`{"type": "function", "function": {"name": ..., "arguments": {...}}}`. Its result is the tool's
return value, or `{"error": message}` (as in TRL) when the tool is unknown, the arguments do not
fit its signature, it raises, or it runs past the timeout: a failure is a message to the model,
never the end of the run. Unlike TRL, which runs a rollout's sync tools one after the other and
puts async results after sync ones, all calls of the batch run at once and results keep the order
of the calls.

Sync tools run on at most `max_workers` daemon threads; async tools run together on one event loop
thread. A Python thread cannot be stopped: a sync call past its timeout keeps its thread until it
returns (then the thread exits), and a fresh worker takes its place, so the batch goes on at full
width. Daemon threads, so a tool that never returns does not block the interpreter's exit. An
async call past its timeout is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from .functions import ToolSet
from .results import ToolResult, error_result

ToolCall = tuple[ToolSet, dict]


class _Job:
    """One call in flight: a sync call queued for or running on a worker thread, or an async call
    on the event loop (which starts when submitted)."""

    def __init__(self, name: str, call, wake=None, future: Future | None = None) -> None:
        self.name, self.call, self.wake = name, call, wake
        self.future: Future = future if future is not None else Future()
        self.is_async = future is not None
        self.started: float | None = time.monotonic() if self.is_async else None
        self.worker: threading.Thread | None = None  # the thread running a sync call
        self.abandoned = False  # it ran past its timeout: its worker exits when it returns


class ToolRunner:
    """Runs the tool calls of a batch concurrently. Use it as a context manager, or call `close()`.

    Args:
        max_workers (`int`, *optional*, defaults to `8`):
            How many sync tool calls run at once.
        timeout (`float` or `None`, *optional*, defaults to `60.0`):
            Seconds one call may run (from when it starts); `None`: no limit.
        timeout_setting (`str`, *optional*, defaults to `"ToolRunner(timeout=...)"`):
            Where a user raises the limit, named in the timeout error.
    """

    def __init__(
        self,
        max_workers: int = 8,
        timeout: float | None = 60.0,
        timeout_setting: str = "ToolRunner(timeout=...)",
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"`max_workers` must be at least 1, got {max_workers}.")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"`timeout` must be positive or None, got {timeout}.")
        self.max_workers, self.timeout, self.timeout_setting = max_workers, timeout, timeout_setting
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []  # live, not abandoned
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._closed = False

    def run(self, calls: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Run every call of every rollout at once; return the results per rollout, in call order."""
        wake = threading.Condition()  # re-entrant: a cancel under it runs `notify` at once

        def notify(*_):
            with wake:
                wake.notify_all()

        results: list[list[Any]] = [[None] * len(rollout) for rollout in calls]
        pending = []  # (rollout index, call index, job)
        for i, rollout in enumerate(calls):
            for j, (toolset, tool_call) in enumerate(rollout):
                name, call = self._prepare(toolset, tool_call)
                if isinstance(call, ToolResult):
                    results[i][j] = call
                    continue
                if toolset.is_async(name):
                    job = _Job(name, call, future=self._start_async(call))
                else:
                    job = _Job(name, call, wake=notify)
                    self._submit(job)
                job.future.add_done_callback(notify)
                pending.append((i, j, job))
        with wake:
            while pending:
                now, waiting, deadline = time.monotonic(), [], float("inf")
                for i, j, job in pending:
                    if job.future.done():
                        results[i][j] = self._outcome(job)
                    elif self._overdue(job, now):
                        results[i][j] = self._time_out(job)
                    else:
                        waiting.append((i, j, job))
                        if self.timeout is not None and job.started is not None:
                            deadline = min(deadline, job.started + self.timeout)
                pending = waiting
                if pending:
                    wake.wait(None if deadline == float("inf") else max(deadline - now, 0.0))
        return results

    def _prepare(self, toolset: ToolSet, tool_call: dict):
        """`(name, callable of no argument)` for a call that can run, `(name, ToolResult)` else."""
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
        return name, lambda: toolset[name](**arguments)

    def _overdue(self, job: _Job, now: float) -> bool:
        started = job.started
        return self.timeout is not None and started is not None and now - started >= self.timeout

    def _outcome(self, job: _Job) -> ToolResult:
        if job.future.cancelled():
            return error_result(job.name, f"Tool {job.name} was cancelled.")
        if job.future.exception() is not None:
            return error_result(job.name, str(job.future.exception()))
        return ToolResult(job.name, job.future.result())

    def _time_out(self, job: _Job) -> ToolResult:
        if job.is_async:
            job.future.cancel()  # cancels the task on the loop
        else:
            with self._lock:  # a worker that finishes now sees `abandoned` and exits
                if job.future.done():
                    return self._outcome(job)
                job.abandoned = True
                self._workers.remove(job.worker)
                if not self._closed:
                    self._start_worker()
        return error_result(
            job.name,
            f"Tool {job.name} timed out after {self.timeout:g} s. Raise the limit with "
            f"`{self.timeout_setting}` if the tool needs longer.",
        )

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("This ToolRunner is closed.")
            while len(self._workers) < self.max_workers:
                self._start_worker()
        self._jobs.put(job)

    def _start_worker(self) -> None:  # holds self._lock
        thread = threading.Thread(target=self._work, name="ToolRunner-worker", daemon=True)
        self._workers.append(thread)
        thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            job.worker = threading.current_thread()
            job.started = time.monotonic()
            job.wake()  # the batch now has a deadline for this call
            try:
                job.future.set_result(job.call())
            except BaseException as error:  # a tool's SystemExit must not kill the worker
                job.future.set_exception(error)
            with self._lock:
                if job.abandoned:
                    return

    def _start_async(self, call) -> Future:
        return asyncio.run_coroutine_threadsafe(call(), self._event_loop())

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
            workers, loop, loop_thread = list(self._workers), self._loop, self._loop_thread
        for _ in workers:
            self._jobs.put(None)
        for thread in workers:
            thread.join()
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            loop_thread.join()
            loop.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
