"""A small pool of verifier worker processes with a hard per-call time limit.

Why processes: math-verify bounds its own time with `signal.alarm`, which only works in the main
thread, and no signal can stop sympy while it computes a huge integer in C (`10^{10^{10}}`). A
worker process can always be killed. Each worker runs `_verify.py` as its main program (so it
never imports torch through `trl_grpo_ext/__init__.py`), answers one JSON line per request, and
stops a request itself after `timeout` seconds of CPU time (a SIGPROF timer); the parent kills a
worker that has not answered within `hard_deadline(timeout)` wall-clock seconds (C code ignores
signals) and starts a fresh one. The pool is safe to use from many threads at
once, and a batch is spread over all workers, so scoring runs in parallel outside the GIL.

POSIX only (select on pipes); elsewhere, and with `TRL_GRPO_EXT_VERIFY_WORKERS=0`, `math_accuracy`
scores in-process instead.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

KILL_GRACE_S = 1.0  # see hard_deadline
STARTUP_TIMEOUT_S = 120.0  # importing sympy + math-verify on a loaded machine
PIPELINE_DEPTH = 4  # requests queued per worker: fewer process wake-ups per completion
PIPELINE_MAX_BYTES = 8_192  # only requests this small queue (4 of them fit any pipe buffer)
_WORKER_SCRIPT = str(Path(__file__).with_name("_verify.py"))
# `python -c` instead of `python _verify.py`: the script's folder must not shadow stdlib modules.
_BOOT = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"


def hard_deadline(timeout: float) -> float:
    """Wall-clock seconds a worker may spend on one request before it is killed. Its own timer
    stops Python code after `timeout` seconds of CPU; this generous bound catches C code that
    ignores signals, without killing a worker that is merely slowed by a loaded machine."""
    return 2 * timeout + KILL_GRACE_S


class WorkerStartError(RuntimeError):
    """A verifier worker process could not start (for example, math-verify is not installed)."""


class _Worker:
    """One worker process and the buffered reading end of its stdout."""

    def __init__(self, script: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        self.fd = self.process.stdout.fileno()
        self.ready = False
        self._buffer = b""

    def send(self, payload: bytes) -> None:
        view = memoryview(payload)
        while view:  # a raw pipe may take a large payload in several writes
            view = view[self.process.stdin.write(view) :]

    def read_lines(self) -> list[bytes]:
        """Read what is available (call after select says so); raise EOFError if the worker died."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise EOFError
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return lines

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                self.kill()
                raise WorkerStartError(f"verifier worker did not start within {timeout:.0f} s")
            try:
                lines = self.read_lines()
            except EOFError:
                self.kill()
                raise WorkerStartError(
                    f"verifier worker exited with code {self.process.wait()}"
                ) from None
            for line in lines:
                self._on_ready(line)

    def _on_ready(self, line: bytes) -> None:
        message = json.loads(line)
        if message != "ready":
            self.kill()
            raise WorkerStartError(f"verifier worker failed to start: {message.get('error')}")
        self.ready = True

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.process.stdin.close()  # the worker exits at end of input
            self.process.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class _Lane:
    """The requests one `map` call has queued on one worker, oldest (being scored) first."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.inflight: deque[int] = deque()
        self.deadline = math.inf

    def start_clock(self, timeout: float) -> None:
        # A fresh worker first imports math-verify; its clock starts at its "ready".
        wait = hard_deadline(timeout) if self.worker.ready else STARTUP_TIMEOUT_S
        self.deadline = time.monotonic() + wait


class VerifierPool:
    """`num_workers` verifier processes shared by all threads of this process.

    Args:
        num_workers (`int`):
            How many worker processes to run; each scores one completion at a time.
        script (`str`, *optional*, defaults to `_verify.py`):
            The worker program (tests swap in a misbehaving one).
    """

    def __init__(self, num_workers: int, script: str = _WORKER_SCRIPT) -> None:
        self.num_workers = num_workers
        self.script = script
        self.pid = os.getpid()
        self.restarts = 0  # workers killed for running past their deadline, or found dead
        self.broken = False  # a `map` failed half-way; `get_pool` replaces a broken pool
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        try:
            workers = [self._spawn() for _ in range(num_workers)]
            for worker in workers:
                worker.wait_ready(STARTUP_TIMEOUT_S)
        except WorkerStartError:
            self.close()
            raise
        for worker in workers:
            self._idle.put(worker)

    def _spawn(self) -> _Worker:
        try:
            worker = _Worker(self.script)
        except OSError as error:  # no processes left, no executable, ...
            raise WorkerStartError(f"cannot start a verifier worker: {error}") from error
        with self._lock:
            self._all.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and put a fresh one in the idle queue (it gets ready in the background)."""
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self.restarts += 1
        self._idle.put(self._spawn())

    def map(self, requests: list[tuple], timeout: float) -> list[list]:
        """Score `requests` (`(reference, completion, options)` tuples) on all workers at once.

        Each returns `[score, note]`: `[0.0, "timeout"]` after `timeout` seconds of CPU, and
        `[0.0, "timeout (worker killed)"]` if not answered `hard_deadline(timeout)` seconds after
        its worker started it.
        """
        results: list = [None] * len(requests)
        payloads = [
            (json.dumps([reference, completion, timeout, options]) + "\n").encode()
            for reference, completion, options in requests
        ]
        pending = deque(range(len(requests)))
        lanes: dict[int, _Lane] = {}  # fd -> the requests this call has queued on that worker

        def feed(lane: _Lane) -> None:
            # Only small requests queue behind another, so a write never blocks on a full pipe
            # while the worker computes (or hangs).
            while pending and len(lane.inflight) < PIPELINE_DEPTH:
                index = pending[0]
                if lane.inflight and len(payloads[index]) > PIPELINE_MAX_BYTES:
                    return
                try:
                    lane.worker.send(payloads[index])
                except OSError:  # a dead worker: select reports the end of its output
                    return
                pending.popleft()
                if not lane.inflight:
                    lane.start_clock(timeout)
                lane.inflight.append(index)

        def retire(fd: int, note: str) -> None:
            # The request being scored fails; the ones queued behind it go back to `pending`.
            lane = lanes.pop(fd)
            results[lane.inflight.popleft()] = [0.0, note]
            pending.extendleft(reversed(lane.inflight))
            self._replace(lane.worker)

        try:
            while pending or lanes:
                while pending:
                    try:  # block for a free worker only when this call holds none
                        worker = self._idle.get(block=not lanes)
                    except queue.Empty:
                        break
                    lane = _Lane(worker)
                    feed(lane)
                    if not lane.inflight:  # it died while idle
                        self._replace(worker)
                        continue
                    lanes[worker.fd] = lane
                if not lanes:
                    continue
                first_deadline = min(lane.deadline for lane in lanes.values())
                wait = max(0.0, first_deadline - time.monotonic())
                for fd in select.select(list(lanes), [], [], wait)[0]:
                    lane = lanes[fd]
                    try:
                        lines = lane.worker.read_lines()
                    except EOFError:  # crashed (out of memory, a segfault in a C extension, ...)
                        retire(fd, "error: verifier worker died")
                        continue
                    for line in lines:
                        message = json.loads(line)
                        if isinstance(message, dict):  # a fresh worker that could not start
                            retire(fd, f"error: verifier worker: {message.get('error')}")
                            break
                        if message == "ready":
                            lane.worker.ready = True
                        else:
                            results[lane.inflight.popleft()] = message
                        lane.start_clock(timeout)  # the worker starts on the next request now
                    if fd in lanes:
                        feed(lane)
                        if not lane.inflight:
                            del lanes[fd]
                            self._idle.put(lane.worker)
                now = time.monotonic()
                for fd in [fd for fd, lane in lanes.items() if now >= lane.deadline]:
                    retire(fd, "timeout (worker killed)")
        except BaseException:
            # Interrupted (Ctrl-C), or no worker could be started: the workers this call holds
            # may be busy with its requests, so they go, and the next call starts a new pool.
            self.broken = True
            for lane in lanes.values():
                lane.worker.kill()
            raise
        return results

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child must not kill its parent's workers
            return
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.close()


_pool: VerifierPool | None = None
_pool_lock = threading.Lock()


def default_num_workers() -> int:
    """`TRL_GRPO_EXT_VERIFY_WORKERS` if set (0 scores in-process), else min(4, CPU count)."""
    configured = os.environ.get("TRL_GRPO_EXT_VERIFY_WORKERS")
    if configured is not None:
        return max(0, int(configured))
    return 0 if os.name != "posix" else max(1, min(4, os.cpu_count() or 1))


def get_pool() -> VerifierPool | None:
    """The pool of this process, started on first use; None when workers are disabled."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool.pid != os.getpid():
            _pool = None  # inherited through fork: the workers belong to the parent
        if _pool is not None and _pool.broken:
            _pool.close()
            _pool = None
        if _pool is None:
            num_workers = default_num_workers()
            if num_workers == 0:
                return None
            _pool = VerifierPool(num_workers)
        return _pool


def shutdown_pool() -> None:
    """Stop this process's verifier workers (they restart on the next call)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_pool)
