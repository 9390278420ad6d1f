"""`run_python`: a tool that runs model-written Python in a sandbox and returns what it printed.

Each call runs the program in a new, isolated interpreter (`python -I -S`: the standard library
only, no site-packages, no `PYTHON*` variables), isolated by Linux namespaces (made by util-linux
or by bubblewrap) where they can be made and limited by `setrlimit` in every case (see
`isolation` for exactly what each mechanism hides). What comes back is a string for the model,
never an exception: the program's stdout and stderr together (cut at `max_output_bytes`), its
traceback when it fails, or a short error when it runs past a limit, as a `ProgramResult`: the
trainer's notes on lines starting with `[run_python]`, which no line of the program's output can
pass for, and fields (`exit_status`, `signal`, `limit`, `failed`...) that the program cannot
forge. When the call returns, every process of the program has been killed and its temporary
files removed. Memory and processes are
bounded for the call as a whole by a cgroup of its own where the trainer can make one (`cgroups`),
a seccomp filter closes kernel surface a math tool has no use for (`seccomp`), and the sandbox dies
with the trainer (a parent-death signal; what a killed trainer leaves is removed at the next start).

Calling `run_python(code)` (or a `PythonSandbox`) runs the program and waits for it; the trainer
awaits `run_python.async_call(code)` instead (the same work, a subprocess driven by asyncio), so the
programs of different rollouts run at once on the tool runner's event loop while sync tools keep
TRL's order on the training thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings

from . import bounds, cgroups, isolation, launcher, seccomp
from .isolation import BUBBLEWRAP, MECHANISMS, NAMESPACES, PROCESS
from .results import NOTE, ProgramResult, escape_output

_FILE_SIZE = 16 * 1024**2  # the largest file the program may write
_OPEN_FILES = 64
_READ_CHUNK = 65536


def run_python(code: str) -> str:
    """Runs a Python program in a sandbox and returns what it printed (stdout and stderr).

    The program runs in a fresh interpreter with the standard library only, no network and no
    access to the host's files; print the values you need. Its time and memory are limited.

    Args:
        code: The complete Python program to run, e.g. "print(sum(range(10)))".
    """
    return _default_sandbox()(code)


async def _run_python_async(code: str) -> str:
    return await _default_sandbox().async_call(code)


# What the trainer awaits instead of calling `run_python` (`tools.functions.async_function`).
run_python.async_call = _run_python_async


class PythonSandbox:
    """A sandbox with its own limits; the instance is a tool named `run_python` (pass it in
    `tools=[...]`), like the module's `run_python`, which uses the default limits.

    Args:
        cpu_seconds (`int`, *optional*, defaults to `10`):
            CPU time of each process of the program (`RLIMIT_CPU`, past which the kernel kills
            it) and, where the call's cgroup accounts for CPU time (v2, or v1's `cpuacct`), of
            all its processes together (checked every 0.1 s; past it the call is stopped).
            Without such a cgroup a call's CPU time is bounded by `wall_seconds` alone.
        wall_seconds (`float`, *optional*, defaults to `10.0`):
            Wall-clock time of a call, from start to finish; past it every process of the program
            is killed. Keep it below the trainer's `tool_call_timeout`.
        memory_mb (`int`, *optional*, defaults to `1024`):
            Memory of the whole call, in MiB: every process, memfd, `/dev/shm` and `/work`
            together, swap excluded (the call's cgroup, where one can be made: `bounds()` says),
            past which the kernel kills a process of the call; and the address space of each
            process (`RLIMIT_AS`), past which an allocation raises `MemoryError`.
        max_processes (`int`, *optional*, defaults to `16`):
            Processes and threads the program may have at once, its own included
            (`RLIMIT_NPROC`, and the call's cgroup's `pids.max`); a fork past it fails.
        max_output_bytes (`int`, *optional*, defaults to `4096`):
            Bytes of output given back; the rest is counted and dropped, with a note saying so.
        work_mb (`int`, *optional*, defaults to `64`):
            Size of the program's writable directory, `/work` (memory, with namespaces).
        isolation (`str`, *optional*, defaults to `"auto"`):
            `"namespaces"` (made by util-linux), `"bubblewrap"` (the same namespaces, made by
            `bwrap`), `"process"` (no isolation beyond a separate process with limits) or
            `"auto"`: the first of `"namespaces"` and `"bubblewrap"` that this machine can run,
            else `"process"` with a warning (once) that says what is not isolated.
    """

    def __init__(
        self,
        cpu_seconds: int = 10,
        wall_seconds: float = 10.0,
        memory_mb: int = 1024,
        max_processes: int = 16,
        max_output_bytes: int = 4096,
        work_mb: int = 64,
        isolation: str = "auto",
    ) -> None:
        if isolation not in ("auto", *MECHANISMS):
            raise ValueError(
                '`isolation` must be "auto", "namespaces", "bubblewrap" or "process", got '
                f"{isolation!r}."
            )
        for name, value in (
            ("cpu_seconds", cpu_seconds),
            ("wall_seconds", wall_seconds),
            ("memory_mb", memory_mb),
            ("max_processes", max_processes),
            ("max_output_bytes", max_output_bytes),
            ("work_mb", work_mb),
        ):
            if value <= 0:
                raise ValueError(f"`{name}` must be positive, got {value}.")
        self.cpu_seconds, self.wall_seconds = int(cpu_seconds), float(wall_seconds)
        self.memory_mb, self.max_processes = int(memory_mb), int(max_processes)
        self.max_output_bytes, self.work_mb = int(max_output_bytes), int(work_mb)
        self._requested = isolation
        self._mechanism: str | None = None if isolation == "auto" else isolation
        self._lock = threading.Lock()
        # The instance is the tool: what `get_json_schema` and the chat template read.
        self.__name__ = run_python.__name__
        self.__doc__ = run_python.__doc__
        self.__annotations__ = dict(run_python.__annotations__)

    @property
    def mechanism(self) -> str:
        """`"namespaces"`, `"bubblewrap"` or `"process"`: how calls are isolated (with `"auto"`,
        found out by the first call, or by reading this)."""
        with self._lock:
            if self._mechanism is None:
                self._mechanism = self._detect()
            return self._mechanism

    def bounds(self) -> str:
        """What bounds a call here beyond the per-process limits: its cgroup, or why there is
        none; and its seccomp filter, or why there is none."""
        hierarchy, reason = _call_cgroups()
        memory = hierarchy.describe() if hierarchy else f"no cgroup per call ({reason})"
        try:
            seccomp.compiled_filter()
            filtered = "a seccomp filter (libseccomp)"
        except seccomp.Unavailable as error:
            filtered = f"no seccomp filter ({error})"
        return f"{self.mechanism}: {memory}; {filtered}"

    def __call__(self, code: str) -> str:
        error = launcher.is_text(code)
        if error:
            return _failure(error)
        mechanism = self.mechanism
        with contextlib.ExitStack() as cleanup:
            try:
                call = self._prepare(mechanism, code, cleanup)
            except OSError as error:
                return _failure(
                    f"Error: the sandbox could not be set up ({error}); no program ran."
                )
            return self._run(call)

    async def async_call(self, code: str) -> str:
        """`self(code)` without blocking the event loop: the program is a subprocess driven by
        asyncio. What the trainer awaits, so that the calls of different rollouts run at once.
        Cancelled (by a tool timeout), it kills the program and removes its files first."""
        error = launcher.is_text(code)
        if error:
            return _failure(error)
        mechanism = self.mechanism  # found out once, by running a probe (blocking)
        with contextlib.ExitStack() as cleanup:
            try:
                call = self._prepare(mechanism, code, cleanup)
            except OSError as error:
                return _failure(
                    f"Error: the sandbox could not be set up ({error}); no program ran."
                )
            return await self._run_async(call)

    def _prepare(self, mechanism: str, code: str, cleanup: contextlib.ExitStack) -> _Call:
        """Everything a call needs before its program starts; `cleanup` undoes it, last first:
        the cgroup (killing whatever is left in it), the uid, the files, the scratch folder."""
        bounds.remove_stale_once()
        # named after this trainer, so that a later one can remove it if this one is killed
        scratch = tempfile.mkdtemp(prefix=f"{cgroups.PREFIX}{cgroups.owner()}-")
        cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
        program = _write_program(scratch, code)
        # the launcher's status comes back over a pipe: nothing of the host is open for writing
        # in the sandbox
        status = _StatusPipe()
        cleanup.callback(status.close)
        uid = None  # a uid of its own for a root trainer's program, which RLIMIT_NPROC counts
        if os.geteuid() == 0 and (mechanism != PROCESS or isolation.others_can_run_interpreter()):
            reservation = isolation.UidReservation()
            cleanup.callback(reservation.release)
            uid = reservation.uid
            if mechanism == PROCESS:  # the launcher switches to it, in the scratch folder
                os.chown(scratch, uid, uid)
                os.chown(program, uid, uid)
                # SysV objects of a program without an IPC namespace, which outlive it
                cleanup.callback(isolation.remove_ipc, uid)
        helpers = 0 if mechanism == PROCESS else 2  # unshare and its shell; bwrap's two
        hierarchy, _ = _call_cgroups()
        leaf = None
        if hierarchy is not None:
            leaf = hierarchy.create(self.memory_mb * 1024**2, self.max_processes + 1 + helpers)
            cleanup.callback(leaf.remove)
        # processes of the sandbox that count toward the program's RLIMIT_NPROC: the launcher
        # waiting for it; in a user namespace, unshare and sh, or bwrap's PID 1
        nproc = self.max_processes + 1
        if os.geteuid() != 0:
            nproc += {NAMESPACES: 2, BUBBLEWRAP: 1, PROCESS: 0}[mechanism]
        limits = [self.cpu_seconds, self.memory_mb * 1024**2, nproc, _FILE_SIZE, _OPEN_FILES]
        limits += [status.write, seccomp.syscall_number("keyctl")]
        # the process fallback run by root: the launcher switches to `uid`, or (-2) stays root
        # without capabilities
        fallback_uid = -1
        if mechanism == PROCESS and os.geteuid() == 0:
            fallback_uid = -2 if uid is None else uid
        limits.append(fallback_uid)
        python = [isolation.interpreter(), "-I", "-S", "-c", launcher.SOURCE, *map(str, limits)]
        python.append(_seccomp_filter().hex())
        passed = [status.write]
        if mechanism == PROCESS:
            command = python
        elif mechanism == BUBBLEWRAP:
            source = cleanup.enter_context(open(program, "rb"))  # bwrap copies it from here
            passed.append(source.fileno())
            command = isolation.bubblewrap_command(source.fileno(), self.work_mb, python, uid=uid)
        else:
            os.mkdir(os.path.join(scratch, "root"))
            # paths relative to the scratch folder (its working directory), which the program
            # would otherwise read in the setup's command line
            command = isolation.namespace_command("root", "main.py", self.work_mb, python, uid=uid)
        command = isolation.first_process(command, leaf.procs_files if leaf else [])
        environment = isolation.environment()
        if mechanism == PROCESS:
            environment = _process_environment(scratch)
        popen = {
            "stdin": subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.STDOUT,
            # bwrap reads the program from its descriptor: its own working directory, which its
            # PID 1 keeps and a program of the same user may read, need not be the scratch folder
            "cwd": "/" if mechanism == BUBBLEWRAP else scratch,
            "env": environment,
            "pass_fds": passed,
            "start_new_session": True,  # its own process group, killed as a whole
        }
        return _Call(command, popen, status, leaf)

    async def _run_async(self, call: _Call) -> str:
        process = await asyncio.create_subprocess_exec(*call.command, **call.popen)
        call.status.close_write()  # the launcher's copy is the only one left
        call.watch_cpu(self.cpu_seconds)
        output = _Output(self.max_output_bytes)
        reader = asyncio.ensure_future(output.read_async(process.stdout))
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.wall_seconds)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(process.pid)
            await asyncio.shield(process.wait())
            # as in `_run`: without namespaces, a program that left its process group may keep
            # the pipe open; its reader is then cancelled
            _, pending = await asyncio.wait({reader}, timeout=1.0)
            for task in pending:
                task.cancel()
            call.stop_watching()
        return self._report(output, timed_out, call)

    def _run(self, call: _Call) -> str:
        process = subprocess.Popen(call.command, **call.popen)
        call.status.close_write()  # the launcher's copy is the only one left
        call.watch_cpu(self.cpu_seconds)
        output = _Output(self.max_output_bytes)
        reader = threading.Thread(target=output.read, args=(process.stdout,), daemon=True)
        reader.start()
        # a timer kills it at the wall-clock limit: `wait(timeout)` would poll, adding up to 50 ms
        expired = threading.Event()
        timer = threading.Timer(
            self.wall_seconds, lambda: (expired.set(), _kill_group(process.pid))
        )
        timer.start()
        try:
            process.wait()
        finally:
            timer.cancel()
            timed_out = expired.is_set()
            _kill_group(process.pid)
            process.wait()
            # The pipe ends when the last process holding it dies: at once with namespaces (the
            # PID namespace dies with its first process) or a cgroup (killed as a whole below);
            # otherwise a program that left its process group keeps it open, and its reader
            # thread is left to end with it.
            if call.leaf is not None and reader.is_alive():
                call.leaf.kill()
            reader.join(timeout=1.0)
            if not reader.is_alive():
                process.stdout.close()
            call.stop_watching()
        return self._report(output, timed_out, call)

    def _report(self, output: _Output, timed_out: bool, call: _Call) -> ProgramResult:
        """The call's result, from what the trainer saw: the launcher's status pipe, the wall
        clock and the cgroup; nothing the program printed decides it."""
        started, status = launcher.read_status(call.status.read)
        memory = call.leaf is not None and call.leaf.oom_killed()
        facts = {}
        if timed_out:
            facts["limit"] = "wall_seconds"
            note = (
                f"Error: the program ran past the time limit of {self.wall_seconds:g} s and was "
                "stopped."
            )
        elif call.cpu_watch is not None and call.cpu_watch.exceeded:
            facts["limit"] = "cpu_seconds"
            note = (
                f"Error: the program ran past the CPU time limit of {self.cpu_seconds} s (all its "
                "processes together) and was stopped."
            )
        elif not started:
            note = "Error: the sandbox could not be set up; no program ran."
        elif status is None and not memory:
            note = (
                "Error: the sandbox's launcher was killed before it reported the program's end; "
                "the program was stopped."
            )
        elif status is not None and status < 0:
            facts["signal"] = _signal_name(-status)
            facts["limit"] = self._limit(-status, memory)
            note = f"Error: the program was killed by {facts['signal']}"
            note += f"{self._cause(facts['limit'])}."
        else:
            facts["exit_status"] = status
            # 1: an uncaught exception, whose traceback is the text
            note = "" if status in (0, 1, None) else f"Exit status {status}."
        if memory and "limit" not in facts:
            facts["limit"] = "memory_mb"
            note = (
                "Error: a process of the program was killed at the memory limit of "
                f"{self.memory_mb} MiB for the whole call."
            )
        text = output.text()
        notes = [note] if note else []
        if output.dropped:
            notes.insert(
                0,
                f"output truncated: {output.total} bytes, the first {self.max_output_bytes} shown",
            )
        if not text and not notes:
            notes = ["(no output)"]
        lines = [text] if text else []
        lines += [f"{NOTE} {line}" for line in notes]
        return ProgramResult("\n".join(lines), output=text, truncated=output.dropped, **facts)

    def _limit(self, number: int, memory: bool) -> str | None:
        if memory:
            return "memory_mb"
        return {signal.SIGXCPU: "cpu_seconds", signal.SIGXFSZ: "file_size"}.get(number)

    def _cause(self, limit: str | None) -> str:
        return {
            "memory_mb": f" (memory limit of {self.memory_mb} MiB for the whole call)",
            "cpu_seconds": f" (CPU time limit of {self.cpu_seconds} s)",
            "file_size": f" (file size limit of {_FILE_SIZE // 1024**2} MiB)",
            None: "",
        }[limit]

    def _detect(self) -> str:
        """The first mechanism of namespaces and bubblewrap in which a trivial program runs here,
        else the process fallback, with a warning naming the reasons and what is not isolated."""
        missing = isolation.missing_tools()
        if missing:
            reasons = [f"the util-linux programs {', '.join(missing)} are not installed"]
        else:
            result = self._probe(NAMESPACES)
            if result == "42":
                return NAMESPACES
            reasons = [f"util-linux cannot make them here ({result.strip()[-300:]})"]
        if isolation.bubblewrap() is None:
            reasons.append("bubblewrap (`bwrap`) is not installed")
        else:
            result = self._probe(BUBBLEWRAP)
            if result == "42":
                return BUBBLEWRAP
            reasons.append(f"bubblewrap cannot make them here ({result.strip()[-300:]})")
        with _default_lock:
            _warn(fallback_warning("; ".join(reasons)))
        return PROCESS

    def _probe(self, mechanism: str) -> str:
        """What `print(6 * 7)` gives back under `mechanism`: its output (the setup's errors when
        it fails), else the trainer's note."""
        with contextlib.ExitStack() as cleanup:
            try:
                result = self._run(self._prepare(mechanism, "print(6 * 7)", cleanup))
            except OSError as error:
                return str(error)
        return result.output or result


def fallback_warning(reason: str) -> str:
    """What the process fallback isolates, and what it does not."""
    if os.geteuid() == 0 and isolation.others_can_run_interpreter():
        who = (
            "As this process runs as root, each program runs as a uid of its own without "
            "capabilities (RLIMIT_NPROC and the call's cgroup hold its processes; it cannot leave "
            "the cgroup or signal this process), in an IPC namespace of its own where one can be "
            "made (else its SysV objects are removed after the call). NOT bounded: it can read "
            "whatever any user may read on this host, write in world-writable folders (/tmp, "
            "/dev/shm: such files outlive the call), reach the network and abstract unix sockets, "
            "lower the oom_score_adj of a process it starts, and see the host's /proc"
        )
    elif os.geteuid() == 0:
        who = (
            f"This process runs as root and other users cannot run its interpreter "
            f"({isolation.interpreter()}, e.g. under root's home), so programs run as root "
            "without capabilities, in an IPC namespace of their own where one can be made. NOT "
            "bounded: the number of processes (RLIMIT_NPROC exempts root); a program can move "
            "itself out of the call's cgroup, raise its pids.max, leave a process running after "
            "the call, read and write root's files, signal root's processes (this one included), "
            "reach the network, lower its oom_score_adj, and see the host's /proc. Use an "
            "interpreter that other users can run (e.g. the system's, or one under /opt)"
        )
    else:
        who = (
            "no new process can be started (RLIMIT_NPROC counts all of this user's processes). "
            "They can read and write whatever this user can, reach the network, and signal this "
            "user's processes"
        )
    return (
        f"run_python cannot isolate programs with Linux namespaces: {reason}. Programs run in a "
        "separate process with CPU, memory, file-size and open-file limits, an empty environment "
        f"and a temporary working directory, killed after the wall-clock limit. {who}. For "
        "isolation, run the trainer where unprivileged user namespaces are allowed (`unshare "
        "--user --map-root-user true` succeeds), or install bubblewrap (`apt install "
        "bubblewrap`; on Ubuntu 23.10 and later its AppArmor profile lets `bwrap` make them where "
        "`unshare` may not)."
    )


class _Output:
    """Reads a pipe to its end: keeps the first `limit` bytes, counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.kept, self.total = limit, bytearray(), 0

    def read(self, pipe) -> None:
        while chunk := pipe.read1(_READ_CHUNK):
            self._keep(chunk)

    async def read_async(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            self._keep(chunk)

    def _keep(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]

    @property
    def dropped(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        """What was kept, as text: control characters and lines that could pass for the
        trainer's notes escaped (`results.escape_output`)."""
        return escape_output(bytes(self.kept).decode("utf-8", errors="replace").rstrip("\n"))


def _failure(note: str) -> ProgramResult:
    """The result of a call that ran no program."""
    return ProgramResult(f"{NOTE} {note}")


def _write_program(scratch: str, code: str) -> str:
    """Writes `code` to `main.py` in `scratch`; its path."""
    program = os.path.join(scratch, "main.py")
    with open(program, "w", encoding="utf-8") as file:
        file.write(code)
    return program


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _process_environment(cwd: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"}


class _StatusPipe:
    """The pipe the launcher writes the program's status to; the trainer keeps the read end."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()

    def close_write(self) -> None:
        if self.write >= 0:
            os.close(self.write)
            self.write = -1

    def close(self) -> None:
        self.close_write()
        if self.read >= 0:
            os.close(self.read)
            self.read = -1


class _Call:
    """One call, prepared: its command and `Popen` arguments, the launcher's status pipe and the
    call's cgroup (None where there is none)."""

    def __init__(self, command, popen, status: _StatusPipe, leaf) -> None:
        self.command, self.popen, self.status, self.leaf = command, popen, status, leaf
        self.cpu_watch: cgroups.CpuWatch | None = None

    def watch_cpu(self, seconds: float) -> None:
        """Kills the call once all its processes have used `seconds` of CPU time, where its
        cgroup accounts for it (elsewhere `RLIMIT_CPU` bounds each process alone)."""
        if self.leaf is not None and self.leaf.cpu_seconds() is not None:
            self.cpu_watch = cgroups.CpuWatch(self.leaf, seconds)

    def stop_watching(self) -> None:
        if self.cpu_watch is not None:
            self.cpu_watch.stop()


def _call_cgroups() -> tuple[cgroups.Hierarchy | None, str]:
    """`bounds.call_cgroups()`, with a warning (once) that says which bounds hold without one."""
    hierarchy, reason = bounds.call_cgroups()
    if hierarchy is None:
        with _default_lock:
            _warn(bounds.without_cgroups(reason))
    return hierarchy, reason


def _seccomp_filter() -> bytes:
    """The compiled seccomp filter, or b"" with a warning (once) that says what is not refused."""
    try:
        return seccomp.compiled_filter()
    except seccomp.Unavailable as error:
        with _default_lock:
            _warn(bounds.without_filter(str(error)))
        return b""


def _warn(message: str) -> None:
    """Warns once per process, whatever the number of sandboxes (the caller holds the lock)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=5)


_default: PythonSandbox | None = None
_warned: set[str] = set()
_default_lock = threading.Lock()


def _default_sandbox() -> PythonSandbox:
    global _default
    with _default_lock:
        if _default is None:
            _default = PythonSandbox()
        return _default
