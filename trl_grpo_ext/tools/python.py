"""`run_python`: a tool that runs model-written Python in a sandbox and returns what it printed.

Each call runs the program in a new, isolated interpreter (`python -I -S`: the standard library
only, no site-packages, no `PYTHON*` variables), isolated by Linux namespaces (made by util-linux
or by bubblewrap) where they can be made and limited by `setrlimit` in every case (see
`isolation` for exactly what each mechanism hides). What comes back is a string for the model,
never an exception: the program's stdout and stderr together (cut at `max_output_bytes`), its
traceback when it fails, or a short error when it runs past a limit. When the call returns, every
process of the program has been killed and its temporary files removed.

Calling `run_python(code)` (or a `PythonSandbox`) runs the program and waits for it; the trainer
awaits `run_python.async_call(code)` instead (the same work, a subprocess driven by asyncio), so the
programs of different rollouts run at once on the tool runner's event loop while sync tools keep
TRL's order on the training thread.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings

from . import isolation
from .isolation import BUBBLEWRAP, MECHANISMS, NAMESPACES, PROCESS

# Runs in the sandboxed interpreter: sets the limits (inside the namespaces, where RLIMIT_NPROC
# counts the program's processes only), then runs /work/main.py as `__main__`. A traceback shows
# the program's frames, not this one.
_LAUNCHER = """\
import resource, sys, traceback
cpu, memory, processes, file_size, files = map(int, sys.argv[1:6])
for limit, soft, hard in (
    (resource.RLIMIT_CPU, cpu, cpu + 1),
    (resource.RLIMIT_AS, memory, memory),
    (resource.RLIMIT_NPROC, processes, processes),
    (resource.RLIMIT_FSIZE, file_size, file_size),
    (resource.RLIMIT_NOFILE, files, files),
    (resource.RLIMIT_CORE, 0, 0),
):
    resource.setrlimit(limit, (soft, hard))
sys.argv = ["main.py"]
del resource
with open("main.py", "rb") as file:
    source = file.read()
try:
    code = compile(source, "main.py", "exec")
except (SyntaxError, ValueError) as error:
    sys.stderr.write("".join(traceback.format_exception_only(error)))
    sys.exit(1)
try:
    exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as error:
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    sys.exit(1)
"""

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
            CPU time of the program (`RLIMIT_CPU`); past it the kernel kills it.
        wall_seconds (`float`, *optional*, defaults to `10.0`):
            Wall-clock time of a call, from start to finish; past it every process of the program
            is killed. Keep it below the trainer's `tool_call_timeout`.
        memory_mb (`int`, *optional*, defaults to `1024`):
            Address space of each process (`RLIMIT_AS`), in MiB; an allocation past it raises
            `MemoryError`.
        max_processes (`int`, *optional*, defaults to `16`):
            Processes and threads the program may have at once, its own included
            (`RLIMIT_NPROC`); a fork past it fails.
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

    def __call__(self, code: str) -> str:
        mechanism = self.mechanism
        scratch = tempfile.mkdtemp(prefix="run_python-")
        try:
            return self._run(mechanism, scratch, _write_program(scratch, code))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def async_call(self, code: str) -> str:
        """`self(code)` without blocking the event loop: the program is a subprocess driven by
        asyncio. What the trainer awaits, so that the calls of different rollouts run at once.
        Cancelled (by a tool timeout), it kills the program and removes its files first."""
        mechanism = self.mechanism  # found out once, by running a probe (blocking)
        scratch = tempfile.mkdtemp(prefix="run_python-")
        try:
            return await self._run_async(mechanism, scratch, _write_program(scratch, code))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _popen_arguments(self, mechanism: str, scratch: str, program: str, source) -> dict:
        """The keyword arguments of the program's process (besides its command)."""
        return {
            "stdin": subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.STDOUT,
            "cwd": scratch,
            "env": (
                _process_environment(scratch) if mechanism == PROCESS else isolation.environment()
            ),
            "pass_fds": (source.fileno(),) if mechanism == BUBBLEWRAP else (),
            "start_new_session": True,  # its own process group, killed as a whole
        }

    async def _run_async(self, mechanism: str, scratch: str, program: str) -> str:
        with open(program, "rb") as source:  # bwrap copies the program from this descriptor
            process = await asyncio.create_subprocess_exec(
                *self._command(mechanism, scratch, program, source.fileno()),
                **self._popen_arguments(mechanism, scratch, program, source),
            )
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
        return self._report(output, process.returncode, timed_out)

    def _command(self, mechanism: str, scratch: str, program: str, program_fd: int) -> list[str]:
        """The command of one call, run in `scratch`; `program_fd` is `program` open to read."""
        # processes of the sandbox that count toward the program's RLIMIT_NPROC in a user
        # namespace: unshare and sh; bwrap's PID 1
        helpers = {NAMESPACES: 2, BUBBLEWRAP: 1, PROCESS: 0}[mechanism]
        processes = self.max_processes + (0 if os.geteuid() == 0 else helpers)
        limits = [self.cpu_seconds, self.memory_mb * 1024**2, processes, _FILE_SIZE, _OPEN_FILES]
        python = [isolation.interpreter(), "-I", "-S", "-c", _LAUNCHER, *map(str, limits)]
        if mechanism == PROCESS:
            return python
        if mechanism == BUBBLEWRAP:
            return isolation.bubblewrap_command(program_fd, self.work_mb, python)
        root = os.path.join(scratch, "root")
        os.mkdir(root)
        return isolation.namespace_command(root, program, self.work_mb, python)

    def _run(self, mechanism: str, scratch: str, program: str) -> str:
        with open(program, "rb") as source:  # bwrap copies the program from this descriptor
            process = subprocess.Popen(
                self._command(mechanism, scratch, program, source.fileno()),
                **self._popen_arguments(mechanism, scratch, program, source),
            )
        output = _Output(self.max_output_bytes)
        reader = threading.Thread(target=output.read, args=(process.stdout,), daemon=True)
        reader.start()
        timed_out = False
        try:
            process.wait(timeout=self.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(process.pid)
            process.wait()
            # The pipe ends when the last process holding it dies: at once with namespaces (the
            # PID namespace dies with its first process); without them, a program that left its
            # process group keeps it open, and its reader thread is left to end with it.
            reader.join(timeout=1.0)
            if not reader.is_alive():
                process.stdout.close()
        return self._report(output, process.returncode, timed_out)

    def _report(self, output: _Output, returncode: int, timed_out: bool) -> str:
        text = output.text()
        if timed_out:
            note = (
                f"Error: the program ran past the time limit of {self.wall_seconds:g} s and was "
                "stopped."
            )
        elif returncode < 0 or returncode > 128:
            number = -returncode if returncode < 0 else returncode - 128
            note = f"Error: the program was killed by {_signal_name(number)}{self._cause(number)}."
        elif returncode not in (0, 1):  # 1: an uncaught exception, whose traceback is the text
            note = f"Exit status {returncode}."
        else:
            note = ""
        if output.dropped:
            text += (
                f"\n[output truncated: {output.total} bytes, the first {self.max_output_bytes} "
                "shown]"
            )
        return "\n".join(part for part in (text, note) if part) or "(no output)"

    def _cause(self, number: int) -> str:
        if number == signal.SIGXCPU:
            return f" (CPU time limit of {self.cpu_seconds} s)"
        if number == signal.SIGXFSZ:
            return f" (file size limit of {_FILE_SIZE // 1024**2} MiB)"
        return ""

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
        message = fallback_warning("; ".join(reasons))
        with _default_lock:
            if message not in _warned:  # once per process, whatever the number of sandboxes
                _warned.add(message)
                warnings.warn(message, RuntimeWarning, stacklevel=4)
        return PROCESS

    def _probe(self, mechanism: str) -> str:
        """What `print(6 * 7)` gives back under `mechanism`."""
        scratch = tempfile.mkdtemp(prefix="run_python-")
        try:
            return self._run(mechanism, scratch, _write_program(scratch, "print(6 * 7)"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def fallback_warning(reason: str) -> str:
    """What the process fallback isolates, and what it does not."""
    processes = (
        "the number of processes is NOT limited (this process runs as root, which RLIMIT_NPROC "
        "exempts)"
        if os.geteuid() == 0
        else "no new process can be started (RLIMIT_NPROC counts all of this user's processes)"
    )
    return (
        f"run_python cannot isolate programs with Linux namespaces: {reason}. Programs run in a "
        "separate process with CPU, memory, file-size and open-file limits, an empty environment "
        "and a temporary working directory, killed after the wall-clock limit; "
        f"{processes}. They can read and write whatever this user can, reach the network, and "
        "signal this user's processes. For isolation, run the trainer where unprivileged user "
        "namespaces are allowed (`unshare --user --map-root-user true` succeeds), or install "
        "bubblewrap (`apt install bubblewrap`; on Ubuntu 23.10 and later its AppArmor profile lets "
        "`bwrap` make them where `unshare` may not)."
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
        return bytes(self.kept).decode("utf-8", errors="replace").rstrip("\n")


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


_default: PythonSandbox | None = None
_warned: set[str] = set()
_default_lock = threading.Lock()


def _default_sandbox() -> PythonSandbox:
    global _default
    with _default_lock:
        if _default is None:
            _default = PythonSandbox()
        return _default
