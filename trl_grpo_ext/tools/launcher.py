"""The first Python code of every `run_python` call, run inside the sandbox (`python -I -S -c`).

In order, before the program's first line:
1. joins a new, empty session keyring, so no key of the trainer's session (or, through it, of its
   user's keyring) can be reached even where no seccomp filter is loaded; in the process fallback
   run by root, also an IPC namespace (where it can make one) and a uid of its own, with no
   capability;
2. sets the resource limits (inside the namespaces, where `RLIMIT_NPROC` counts the program's
   processes only);
3. loads the seccomp filter (`seccomp.compiled_filter`), after `PR_SET_NO_NEW_PRIVS`; if the
   kernel refuses it, the call ends with an error rather than running unfiltered;
4. makes itself not dumpable (`PR_SET_DUMPABLE` 0): a process of the same uid can then neither
   open its `/proc/<pid>/fd` nor trace it (and the filter refuses `pidfd_getfd`), so the
   program cannot take the status pipe's writing end;
5. forks: the child, killed if the launcher dies (a parent-death signal: the launcher dies with
   the trainer), closes every descriptor but 0-2 and runs `/work/main.py` as `__main__` (a
   traceback shows the program's frames only); the parent waits for it and writes its exit code,
   or minus the signal that killed it, to the status pipe, which the trainer reads. A shell or
   `bwrap` between the trainer and the program reports a death by signal N as the exit status
   128 + N, the same as `sys.exit(128 + N)`; the status tells them apart, and its absence says
   that the launcher itself was killed.
"""

from __future__ import annotations

import os

# Exit status of the launcher when the sandbox could not be set up (no program ran).
SETUP_FAILED = 125

SOURCE = """\
import ctypes, os, resource, sys
cpu, memory, processes, file_size, files, status, keyctl, uid = map(int, sys.argv[1:9])
bpf = bytes.fromhex(sys.argv[9])
libc = ctypes.CDLL(None, use_errno=True)
if keyctl >= 0:  # KEYCTL_JOIN_SESSION_KEYRING, no name: a new anonymous session keyring
    libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(1), ctypes.c_void_p(0))
if uid != -1:  # the process fallback run by root: an IPC namespace where it can make one,
    libc.unshare(0x08000000)  # CLONE_NEWIPC; where refused, the trainer removes its objects
    try:  # its loginuid, where unset, so that no process of it can set it
        with open("/proc/self/loginuid", "w") as file:
            file.write(str(max(uid, 0)))
    except OSError:
        pass
    if uid >= 0:  # a uid of its own
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:  # root, where others cannot run the interpreter: without capabilities, even by exec
        for capability in range(64):
            libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        libc.capset(header, (ctypes.c_uint32 * 6)())
for limit, soft, hard in (
    (resource.RLIMIT_CPU, cpu, cpu + 1),
    (resource.RLIMIT_AS, memory, memory),
    (resource.RLIMIT_NPROC, processes, processes),
    (resource.RLIMIT_FSIZE, file_size, file_size),
    (resource.RLIMIT_NOFILE, files, files),
    (resource.RLIMIT_CORE, 0, 0),
):
    resource.setrlimit(limit, (soft, hard))
if bpf:
    class FilterProgram(ctypes.Structure):
        _fields_ = [("length", ctypes.c_ushort), ("instructions", ctypes.c_char_p)]
    program = FilterProgram(len(bpf) // 8, bpf)
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(program), 0, 0):
        sys.stderr.write(
            "Error: the sandbox could not load its seccomp filter "
            f"({os.strerror(ctypes.get_errno())}); no program ran.\\n"
        )
        os._exit(SETUP_FAILED)
del resource, bpf
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: its descriptors are out of the program's reach
# SIGKILL when its parent dies: the trainer itself in the process fallback (also where no
# `setpriv` set it), else the sandbox's first process, which dies with the trainer
libc.prctl(1, 9, 0, 0, 0)
launcher = os.getpid()
os.write(status, b"+")  # the program starts: what comes next is its status, or nothing if killed
child = os.fork()
if child:
    while True:
        try:
            code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
            break
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            pass
    os.write(status, str(code).encode())
    os._exit(0)
os.closerange(3, 1 << 20)  # the status pipe, and whatever else was inherited
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the launcher dies
if os.getppid() != launcher:
    os._exit(0)
del ctypes, libc, launcher, child
sys.argv = ["main.py"]
with open("main.py", "rb") as file:
    source = file.read()
try:
    code = compile(source, "main.py", "exec")
except (SyntaxError, ValueError) as error:
    import traceback  # only when needed: it takes longer to import than the rest
    sys.stderr.write("".join(traceback.format_exception_only(error)))
    sys.exit(1)
try:
    exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as error:
    import traceback
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    sys.exit(1)
""".replace("SETUP_FAILED", str(SETUP_FAILED))


def read_status(pipe: int) -> tuple[bool, int | None]:
    """What the launcher wrote to the status pipe (read end `pipe`, read without blocking):
    whether the program started, and its exit code (minus the signal's number when a signal
    killed it), None when the launcher wrote none (it never started, or was killed)."""
    os.set_blocking(pipe, False)
    try:
        data = os.read(pipe, 64)
    except OSError:
        return False, None
    try:
        return data.startswith(b"+"), int(data[1:])
    except ValueError:
        return data.startswith(b"+"), None


def is_text(code) -> str | None:
    """None when `code` is a program text; else what is wrong with it, as an error message."""
    if not isinstance(code, str):
        return f"Error: the code must be text (a string), got {type(code).__name__}."
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"Error: the code is not valid text: {error.reason} at position {error.start} "
            f"({code[error.start]!r}); send the program as plain UTF-8 text."
        )
    return None
