"""`run_python`: model-written programs run in a sandbox, within their limits, and come back as a
string; hostile programs affect neither the host's files, environment, network nor this process.

The `sandbox` fixture runs each test under each mechanism: namespaces made by util-linux, by
bubblewrap, and the process fallback; a mechanism this machine cannot run is skipped with the
reason. The hostile cases run only under the namespaces (`needs_namespaces`): without them a
program could really delete or kill. The fallback is tested on harmless programs, and on the hostile cases that it bounds (the seccomp
filter, the per-call cgroup, the exit status, the parent-death signal)."""

import asyncio
import ctypes
import os
import re
import signal
import socket
import sys
import tempfile
import time
import warnings

import pytest
from deadline import deadline

from trl_grpo_ext.tools import (
    PythonSandbox,
    ToolRunner,
    ToolSet,
    bounds,
    cgroups,
    isolation,
    run_python,
)
from trl_grpo_ext.tools import python as python_module
from trl_grpo_ext.tools import seccomp as seccomp_module
from trl_grpo_ext.tools.functions import async_function
from trl_grpo_ext.tools.results import is_failure, tool_message

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_CFG = os.path.join(PROJECT, "setup.cfg")
# Small limits: every hostile case is over in seconds.
LIMITS = dict(cpu_seconds=2, wall_seconds=5.0, memory_mb=512, max_processes=8)


@pytest.fixture(autouse=True)
def fails_when_hung(request):
    """A hang is a failure: every test but the slow ones fails past 180 s."""
    if request.node.get_closest_marker("slow"):
        yield
        return

    with deadline(180):
        yield


@pytest.fixture(scope="module", params=isolation.MECHANISMS)
def sandbox(request):
    mechanism = request.param
    # the reasons start with conftest's UNTESTED_MECHANISM, which the run's summary repeats
    untested = f"run_python mechanism untested: {mechanism}"
    if mechanism == isolation.NAMESPACES and isolation.missing_tools():
        pytest.skip(
            f"{untested}: util-linux's {', '.join(isolation.missing_tools())} not installed"
        )
    if mechanism == isolation.BUBBLEWRAP and isolation.bubblewrap() is None:
        pytest.skip(f"{untested}: bubblewrap (`bwrap`) is not installed (`apt install bubblewrap`)")
    sandbox = PythonSandbox(**LIMITS, isolation=mechanism)
    output = sandbox("print(6 * 7)")
    if output != "42":
        pytest.skip(f"{untested}: this machine cannot run it: {output[-300:]}")
    return sandbox


@pytest.fixture
def needs_namespaces(sandbox):
    if sandbox.mechanism == isolation.PROCESS:
        pytest.skip("hostile programs run only in namespaces")


@pytest.fixture
def needs_containment(sandbox):
    """Namespaces, or the process fallback run by root in a cgroup per call, which bounds and
    kills every process of a call (as root, `RLIMIT_NPROC` does not apply; the cgroup does)."""
    if sandbox.mechanism == isolation.PROCESS:
        if os.geteuid() != 0:
            pytest.skip("the fallback's RLIMIT_NPROC counts all of this user's processes")
        if python_module._call_cgroups()[0] is None:
            pytest.skip("the fallback contains processes only with a cgroup per call")


def like(sandbox, **limits):
    """A sandbox of the same mechanism as `sandbox`, with other limits."""
    return PythonSandbox(**limits, isolation=sandbox.mechanism)


def sandbox_leftovers() -> tuple[list[str], list[str]]:
    """Processes of a sandbox (the setup shell or the launcher) and its temporary directories."""
    processes = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                cmdline = file.read()
        except OSError:
            continue
        if b"sandbox-setup" in cmdline or b"RLIMIT_NPROC" in cmdline or b"sleep\x004321" in cmdline:
            processes.append(pid)
    temporary = [
        name for name in os.listdir(tempfile.gettempdir()) if name.startswith("run_python-")
    ]
    return processes, temporary + cgroup_leftovers()


def cgroup_leftovers() -> list[str]:
    """The per-call cgroups of this process (and of dead ones) still on the host."""
    hierarchy, _ = python_module._call_cgroups()
    if hierarchy is None:
        return []
    left = []
    for parent in hierarchy.parents.values():
        for name in os.listdir(parent):
            if name.startswith(cgroups.PREFIX + cgroups.owner() + "-") or (
                name.startswith(cgroups.PREFIX) and cgroups.is_dead(name)
            ):
                left.append(os.path.join(parent, name))
    return left


def needs_filter():
    try:
        seccomp_module.compiled_filter()
    except seccomp_module.Unavailable as error:
        pytest.skip(f"no seccomp filter here: {error}")


def needs_cgroup():
    hierarchy, reason = python_module._call_cgroups()
    if hierarchy is None:
        pytest.skip(f"no cgroup per call here: {reason}")


# --- what a program gets back ---------------------------------------------------------------


def test_a_program_prints_its_result(sandbox):
    assert sandbox("print(2**10)") == "1024"
    assert sandbox("import math\nprint(math.comb(10, 3))\nprint(sum(range(5)))") == "120\n10"


def test_a_syntax_error_is_a_short_error(sandbox):
    output = sandbox("print(2**10")
    assert output.endswith("SyntaxError: '(' was never closed")
    assert len(output) < 200 and "<string>" not in output  # the launcher's frames are hidden


def test_an_exception_is_its_traceback_from_the_program(sandbox):
    output = sandbox("def f():\n    return 1 / 0\nf()")
    assert output.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert output.endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in output
    assert sandbox("import sys\nprint('bye')\nsys.exit(3)") == "bye\n[run_python] Exit status 3."


def test_output_past_the_limit_is_cut_with_a_note(sandbox):
    output = like(sandbox, max_output_bytes=100)("print('a' * 1000)")
    assert output == "a" * 100 + "\n[run_python] output truncated: 1001 bytes, the first 100 shown"


def test_the_limits_are_checked():
    with pytest.raises(ValueError, match="wall_seconds"):
        PythonSandbox(wall_seconds=0)
    choices = '`isolation` must be "auto", "namespaces", "bubblewrap" or "process", got \'docker\''
    with pytest.raises(ValueError, match=re.escape(choices)):
        PythonSandbox(isolation="docker")


# --- programs that go past their limits ---------------------------------------------------


def test_an_infinite_loop_is_killed_at_its_cpu_limit(sandbox):
    start = time.monotonic()
    # 2 CPU-s take more than LIMITS' 5 s of wall time on a machine whose two cores carry a load
    # of 9: the wall-clock limit must not come first
    output = like(sandbox, **{**LIMITS, "wall_seconds": 25.0})("while True:\n    pass")
    # RLIMIT_CPU's SIGXCPU, or the call's cgroup, which counts the launcher's start-up too
    assert output.limit == "cpu_seconds" and "CPU time limit of 2 s" in output, output
    assert time.monotonic() - start < 30


def test_a_program_that_waits_is_stopped_at_the_wall_clock_limit(sandbox):
    start = time.monotonic()
    output = like(sandbox, wall_seconds=1.0)(
        "import time\nprint('started', flush=True)\ntime.sleep(60)"
    )
    assert output == (
        "started\n[run_python] Error: the program ran past the time limit of 1 s and was stopped."
    )
    assert time.monotonic() - start < 30


def test_allocating_8_gb_is_a_memory_error(sandbox):
    output = sandbox("x = bytearray(8 * 1024**3)\nprint('allocated')")
    assert output.endswith("MemoryError") and "allocated" not in output


def test_printing_100_mb_comes_back_truncated(sandbox):
    # Writing 100 MB through the pipe ran past LIMITS' 2 CPU-s on a busy machine (2 cores, load 5); the
    # limits are not what this test is about.
    sandbox = PythonSandbox(**{**LIMITS, "cpu_seconds": 10}, isolation=sandbox.mechanism)
    output = sandbox("import sys\nsys.stdout.write('x' * (100 * 1024**2))")
    assert (
        output
        == "x" * 4096
        + f"\n[run_python] output truncated: {100 * 1024**2} bytes, the first 4096 shown"
    )


def test_a_fork_bomb_is_held_to_max_processes(sandbox, needs_containment):
    count = "import os, time\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as error:\n    print(type(error).__name__, n)"
    # the program and its children: at most max_processes = 8, so 7 forks succeed
    assert sandbox(count) == "BlockingIOError 7"
    output = sandbox("import os\nwhile True: os.fork()")
    assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in output
    assert sandbox("print(1)") == "1" and os.system("true") == 0  # this process forks as usual
    assert sandbox_leftovers()[0] == []


# --- programs that try to reach the host ---------------------------------------------------


def test_etc_passwd_and_the_project_files_do_not_exist_in_the_sandbox(sandbox, needs_namespaces):
    output = sandbox("print(open('/etc/passwd').read())")
    assert output.endswith("FileNotFoundError: [Errno 2] No such file or directory: '/etc/passwd'")
    assert "root:" not in output
    output = sandbox(f"print(open({SETUP_CFG!r}).read())")
    assert output.endswith(f"No such file or directory: {SETUP_CFG!r}")
    assert "[metadata]" not in output
    # what exists: the system directories, the interpreter, /dev, /proc and /work
    listing = sandbox("import os\nprint(sorted(os.listdir('/')))")
    interpreter_top = os.path.realpath(sys.base_prefix).split("/")[1]  # /root here (pyenv)
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp"}
    assert set(eval(listing)) <= allowed | {"usr", "work", interpreter_top}
    assert "home" not in listing
    assert sandbox("import os\nprint(sorted(os.listdir('/etc')))") == "['ld.so.cache']"
    assert sandbox("import os\nprint(os.getcwd(), os.listdir('.'))") == "/work ['main.py']"


def test_the_parents_environment_is_not_visible(sandbox, needs_namespaces, monkeypatch):
    monkeypatch.setenv("RUN_PYTHON_TEST_SECRET", "s3cr3t-4f1e9")
    program = (
        "import os\nprint(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except (OSError, ValueError) as error:\n"
        "        pass\n"
    )
    output = sandbox(program)
    assert "'HOME': '/work'" in output  # it ran
    assert "s3cr3t-4f1e9" not in output and "RUN_PYTHON_TEST_SECRET" not in output


def test_files_written_outside_work_do_not_reach_the_host(sandbox, needs_namespaces, tmp_path):
    targets = [tmp_path / "written", os.path.join(PROJECT, f"written-{os.getpid()}")]
    program = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print(type(e).__name__)"
        for t in targets
    )
    program += "\nopen('/tmp/scratch', 'w').write('y')\nprint(open('/work/scratch').read())"
    output = sandbox(program)
    assert output == "FileNotFoundError\nFileNotFoundError\ny"  # /tmp is /work, its own
    assert not any(os.path.exists(t) for t in targets)
    assert "read-only" in sandbox("open('/usr/written', 'w')").lower()


def test_deleting_the_projects_files_deletes_nothing(sandbox, needs_namespaces):
    # a directory of the project (not the checkout itself: were the sandbox broken, the test
    # must not destroy the repository)
    directory = tempfile.mkdtemp(prefix="rmtree-target-", dir=PROJECT)
    try:
        with open(os.path.join(directory, "keep.txt"), "w") as file:
            file.write("kept")
        output = sandbox(f"import shutil\nshutil.rmtree({directory!r})\nshutil.rmtree({PROJECT!r})")
        assert "FileNotFoundError" in output
        with open(os.path.join(directory, "keep.txt")) as file:
            assert file.read() == "kept"
        assert os.path.exists(SETUP_CFG)
    finally:
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)


def test_a_connection_to_a_local_port_fails(sandbox, needs_namespaces):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        output = sandbox(program)
        # util-linux leaves the namespace's loopback down; bwrap brings it up, and nothing of the
        # sandbox listens on it
        expected = {
            isolation.NAMESPACES: "Network is unreachable",
            isolation.BUBBLEWRAP: "Connection refused",
        }
        assert expected[sandbox.mechanism] in output and "connected" not in output
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected


def test_signals_reach_no_process_outside(sandbox, needs_namespaces):
    sandbox("import os\nos.kill(os.getppid(), 9)")
    sandbox("import os\nos.kill(-1, 9)")
    output = sandbox("import ctypes\nctypes.CDLL(None).kill(0, 9)\nprint('survived')")
    # its process group, its launcher with it: the call fails without the program's status
    assert "survived" not in output and output.failed and output.exit_status is None
    assert sandbox("print('still here')") == "still here"  # and so is this process


def test_a_segfault_is_an_error(sandbox):
    output = sandbox("import ctypes\nctypes.string_at(0)")
    assert output.endswith("[run_python] Error: the program was killed by SIGSEGV.")


# --- nothing is left behind ----------------------------------------------------------------


def run_and_check_leftovers(sandbox, count):
    before = sandbox_leftovers()
    background = "import subprocess\nsubprocess.Popen(['sleep', '4321'])\nprint('ok')"
    for i in range(count):
        assert sandbox(background if i % 2 else "print(1)") == ("ok" if i % 2 else "1")
    assert sandbox_leftovers() == before == ([], [])


def test_calls_leave_no_process_and_no_temporary_file(sandbox, needs_containment):
    run_and_check_leftovers(sandbox, 20)
    like(sandbox, wall_seconds=0.5)("import time\ntime.sleep(10)")  # killed mid-run
    assert sandbox_leftovers() == ([], [])


@pytest.mark.slow
def test_1000_calls_leave_no_process_and_no_temporary_file(sandbox, needs_containment):
    run_and_check_leftovers(sandbox, 1000)


# --- what got through before: keyrings, memory, a killed trainer, kernel surface -------------

KEYCTL, ADD_KEY = seccomp_module.syscall_number("keyctl"), seccomp_module.syscall_number("add_key")
SESSION_KEYRING, USER_KEYRING = -3, -4  # KEY_SPEC_*
CANARY = b"canary-7d41c0ffee"


def keyring_program(serial: int) -> str:
    """Reads the canary by its serial number, searches the session and user keyrings for it, and
    plants a key in its own user keyring; prints what each gave."""
    return (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "L = ctypes.c_long\n"
        "buffer = ctypes.create_string_buffer(256)\n"
        "for name, arguments in (\n"
        f"    ('read', (L(11), L({serial}), buffer, L(256))),\n"
        f"    ('search session', (L(10), L({SESSION_KEYRING}), b'user', b'run_python_canary', L(0))),\n"
        f"    ('search user', (L(10), L({USER_KEYRING}), b'user', b'run_python_canary', L(0))),\n"
        "):\n"
        f"    result = libc.syscall(L({KEYCTL}), *arguments)\n"
        "    print(name, result, os.strerror(ctypes.get_errno()) if result < 0 else buffer.value)\n"
        f"result = libc.syscall(L({ADD_KEY}), b'user', b'planted', b'x', L(1), L({USER_KEYRING}))\n"
        "print('add', result, os.strerror(ctypes.get_errno()) if result < 0 else 'added')\n"
    )


@pytest.fixture
def canary_key():
    """A user key in this process's session keyring (a new one, which links root's user keyring,
    as pam_keyinit sets up); its serial number. Revoked afterwards."""
    if KEYCTL < 0 or ADD_KEY < 0:
        pytest.skip("keyctl and add_key are unknown on this architecture")
    libc = ctypes.CDLL(None, use_errno=True)
    L = ctypes.c_long
    if libc.syscall(L(KEYCTL), L(1), None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING: a new one
        pytest.skip(f"no keyrings here: {os.strerror(ctypes.get_errno())}")
    libc.syscall(L(KEYCTL), L(8), L(USER_KEYRING), L(SESSION_KEYRING))  # KEYCTL_LINK
    serial = libc.syscall(
        L(ADD_KEY), b"user", b"run_python_canary", CANARY, L(len(CANARY)), L(SESSION_KEYRING)
    )
    assert serial > 0, os.strerror(ctypes.get_errno())
    try:
        yield serial
    finally:
        libc.syscall(L(KEYCTL), L(3), L(serial))  # KEYCTL_REVOKE


def test_a_canary_key_in_the_trainers_session_keyring_is_out_of_reach(sandbox, canary_key):
    needs_filter()
    output = sandbox(keyring_program(canary_key))
    assert CANARY.decode() not in output
    # the filter refuses every keyring call, adding a key to its own user keyring included
    assert output.count("Operation not permitted") == 4, output


def test_without_the_filter_the_session_keyring_is_still_a_new_one(
    sandbox, canary_key, monkeypatch
):
    monkeypatch.setattr(python_module, "_seccomp_filter", lambda: b"")
    output = sandbox(keyring_program(canary_key))
    assert "search session -1 Required key not available" in output, output
    if sandbox.mechanism != isolation.PROCESS or os.geteuid() != 0:
        # a uid of its own: the trainer's key is not its to read, by number or in a keyring
        assert CANARY.decode() not in output


def test_memory_held_across_processes_and_memfds_is_bounded_per_call(sandbox):
    needs_cgroup()
    # three processes, each within its own address space limit, holding 400 MiB of memfds
    program = (
        "import os\n"
        "def hold():\n"
        "    for i in range(25):\n"
        "        fd = os.memfd_create(f'm{i}')\n"
        "        for _ in range(16):\n"
        "            os.write(fd, b'x' * 2**20)\n"
        "    os._exit(0)\n"
        "children = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        hold()\n"
        "    children.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]\n"
        "print('children', codes)\n"
        "if codes == [0, 0, 0]:\n"
        "    print('all held 1200 MiB')\n"
    )
    output = like(sandbox, memory_mb=512, wall_seconds=30.0, cpu_seconds=20)(program)
    assert "all held" not in output
    assert "memory limit of 512 MiB for the whole call" in output, output
    assert sandbox("print(1)") == "1" and cgroup_leftovers() == []


def marked_processes(mark: str) -> list[int]:
    """The processes running `sleep <mark>`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if file.read() == b"sleep\0" + mark.encode() + b"\0":
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_trainer_killed_mid_call_leaves_no_process_and_no_folder(sandbox, tmp_path):
    """A trainer (a fork of this process) killed with SIGKILL while its program and a background
    process of the program run: they die with it; its scratch folder and cgroup are removed at the
    next start."""
    mark = f"4321.{os.getpid()}{time.monotonic_ns() % 10**6}"  # this test's processes only
    code = (
        f"import os, subprocess\nsubprocess.Popen(['sleep', '{mark}'])\n"
        f"os.execv('/bin/sleep', ['sleep', '{mark}'])"
    )
    trainer = os.fork()
    if trainer == 0:  # the trainer: one call with its scratch folder in tmp_path
        try:
            tempfile.tempdir = str(tmp_path)
            like(sandbox, wall_seconds=60.0)(code)
        finally:
            os._exit(0)
    try:
        end = time.monotonic() + 30
        while len(marked_processes(mark)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(marked_processes(mark)) == 2, "the program never started"
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)
        end = time.monotonic() + 10
        while marked_processes(mark) and time.monotonic() < end:
            time.sleep(0.05)
        if sandbox.mechanism != isolation.PROCESS:
            assert marked_processes(mark) == []  # the namespaces die with the trainer
        folders = os.listdir(tmp_path)
        assert [name.startswith(f"run_python-{trainer}.") for name in folders] == [True]
        bounds.remove_stale(str(tmp_path))  # what the next trainer does first
        assert os.listdir(tmp_path) == []
        # the process fallback: the program's own child dies with the call's cgroup
        assert marked_processes(mark) == [] or python_module._call_cgroups()[0] is None
        assert cgroup_leftovers() == []
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)


def test_a_million_files_stop_at_the_inode_cap(sandbox, needs_namespaces):
    program = (
        "import os\nn = 0\ntry:\n    while True:\n        open(f'/work/f{n}', 'w').close()\n"
        "        n += 1\nexcept OSError as error:\n    print(n, error.strerror)"
    )
    count, reason = sandbox(program).split(" ", 1)
    assert int(count) < isolation.WORK_INODES and reason == "No space left on device"


def test_vsock_and_other_socket_families_are_refused(sandbox):
    needs_filter()
    program = (
        "import socket\n"
        "for family in ('AF_VSOCK', 'AF_NETLINK', 'AF_PACKET', 'AF_UNIX', 'AF_INET', 'AF_INET6'):\n"
        "    try:\n"
        "        socket.socket(getattr(socket, family), socket.SOCK_DGRAM).close()\n"
        "        print(family, 'opened')\n"
        "    except OSError as error:\n"
        "        print(family, error.strerror)\n"
        "socket.socketpair()\n"
    )
    refused = "Address family not supported by protocol"
    assert sandbox(program).splitlines() == [
        f"AF_VSOCK {refused}",
        f"AF_NETLINK {refused}",
        f"AF_PACKET {refused}",
        "AF_UNIX opened",
        "AF_INET opened",
        "AF_INET6 opened",
    ]


def test_nested_namespaces_io_uring_ptrace_bpf_and_mounts_are_refused(sandbox):
    needs_filter()
    calls = {
        "unshare(CLONE_NEWUSER)": ("unshare", "0x10000000"),
        "clone(CLONE_NEWUSER)": ("clone", "0x10000000 | 17, 0, 0, 0, 0"),
        "io_uring_setup": ("io_uring_setup", "8, ctypes.create_string_buffer(120)"),
        "ptrace(PTRACE_TRACEME)": ("ptrace", "0, 0, 0, 0"),
        "bpf": ("bpf", "0, 0, 0"),
        "perf_event_open": ("perf_event_open", "ctypes.create_string_buffer(128), 0, -1, -1, 0"),
        "mount": ("mount", "b'none', b'/work', b'tmpfs', 0, 0"),
    }
    lines = ["import ctypes, os, threading", "libc = ctypes.CDLL(None, use_errno=True)"]
    for label, (name, arguments) in calls.items():
        number = seccomp_module.syscall_number(name)
        lines.append(
            f"result = libc.syscall({number}, {arguments})\n"
            f"print({label!r}, result, os.strerror(ctypes.get_errno()) if result < 0 else '')"
        )
    # what stays allowed: threads (clone3 refused, the C library falls back to clone), fork
    lines.append("thread = threading.Thread(target=print, args=('thread',))\nthread.start()")
    lines.append("thread.join()\npid = os.fork()\nif pid == 0:\n    os._exit(7)")
    lines.append("print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    output = sandbox("\n".join(lines)).splitlines()
    assert output == [f"{label} -1 Operation not permitted" for label in calls] + [
        "thread",
        "fork 7",
    ]


@pytest.mark.parametrize("code", ["print('\ud800')", b"print(1)", None, 42])
def test_code_that_is_not_text_is_an_error(sandbox, code):
    output = sandbox(code)
    assert output.startswith("[run_python] Error: the code")
    assert asyncio.run(sandbox.async_call(code)) == output
    if isinstance(code, str):
        assert output == (
            "[run_python] Error: the code is not valid text: surrogates not allowed at position 7 ('\\ud800'); "
            "send the program as plain UTF-8 text."
        )


def test_exit_statuses_are_reported_as_what_they_are(sandbox):
    assert sandbox("import sys\nsys.exit(137)") == "[run_python] Exit status 137."
    assert sandbox("import os\nos._exit(200)") == "[run_python] Exit status 200."
    assert sandbox("import os\nos.kill(os.getpid(), 9)") == (
        "[run_python] Error: the program was killed by SIGKILL."
    )
    assert sandbox("import os\nos.kill(os.getpid(), 15)") == (
        "[run_python] Error: the program was killed by SIGTERM."
    )
    assert sandbox("raise SystemExit('bye')") == "bye"


def test_dev_shm_is_present_and_small(sandbox, needs_namespaces):
    program = (
        "import multiprocessing, os\n"
        "from multiprocessing import shared_memory\n"
        "memory = shared_memory.SharedMemory(create=True, size=4096)\n"
        "memory.close()\nmemory.unlink()\n"
        "with multiprocessing.Pool(2) as pool:\n"
        "    print(pool.map(abs, [-1, -2, -3]))\n"
        "try:\n"
        "    with open('/dev/shm/big', 'wb') as file:\n"
        "        file.write(b'x' * (64 * 1024**2))\n"
        "except OSError as error:\n"
        "    print(error.strerror, os.path.getsize('/dev/shm/big'))\n"
    )
    pool, full = sandbox(program).splitlines()
    assert pool == "[1, 2, 3]" and full.startswith("No space left on device ")
    assert 0 < int(full.rsplit(" ", 1)[1]) <= isolation.SHM_MB * 1024**2


def test_the_program_is_what_the_oom_killer_picks(sandbox):
    assert sandbox("print(open('/proc/self/oom_score_adj').read().strip())") == "1000"


def test_sandbox_uids_are_random_reserved_and_unique(sandbox, needs_namespaces, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("an unprivileged trainer's programs run in a user namespace of their own")
    uids = {int(sandbox("import os\nprint(os.getuid())")) for _ in range(3)}
    assert len(uids) == 3 and all(uid in isolation.SANDBOX_UIDS for uid in uids)
    held = isolation.UidReservation()
    try:
        draws = iter([held.uid, held.uid, held.uid + 1])
        monkeypatch.setattr(isolation, "_random_uid", lambda: next(draws))
        second = isolation.UidReservation()  # the held uid is skipped
        assert second.uid == held.uid + 1
        second.release()
    finally:
        held.release()


# --- which mechanism "auto" picks ---------------------------------------------------------

# What `unshare` prints where unprivileged user namespaces are refused (Ubuntu 24.04's AppArmor)
REFUSAL = "unshare: write failed /proc/self/uid_map: Operation not permitted"
UNSHARE_REFUSED = ["sh", "-c", f"echo '{REFUSAL}' >&2; exit 1"]


def refuse_util_linux(monkeypatch) -> list[str]:
    """Makes every util-linux sandbox fail as `unshare` does where it is refused; returns a list
    that gets one entry per attempt."""
    tried = []

    def namespace_command(*args, **kwargs):
        tried.append(isolation.NAMESPACES)
        return UNSHARE_REFUSED

    monkeypatch.setattr(isolation, "namespace_command", namespace_command)
    return tried


def fake_bubblewrap(tmp_path, message: str) -> str:
    """A `bwrap` that fails with `message`, as it does where it cannot make namespaces."""
    path = tmp_path / "bwrap"
    path.write_text(f"#!/bin/sh\necho {message!r} >&2\nexit 1\n")
    path.chmod(0o755)
    return str(path)


# --- awaited by the trainer ----------------------------------------------------------------


ASYNC_CASES = [
    "print(2**10)",
    "def f(:\n    pass",
    "raise ValueError('bad input')",
    "print('x' * 100_000)",
    "import time\nprint('started', flush=True)\ntime.sleep(60)",
]


@pytest.mark.parametrize("code", ASYNC_CASES, ids=range(len(ASYNC_CASES)))
def test_the_awaited_call_gives_what_the_call_gives(sandbox, code):
    limited = like(sandbox, wall_seconds=1.0)
    assert asyncio.run(limited.async_call(code)) == limited(code)


def test_run_python_is_awaited_by_the_trainer_and_still_callable():
    assert async_function(run_python) is run_python.async_call
    assert ToolSet([run_python]).is_async("run_python")
    assert ToolSet([PythonSandbox()]).is_async("run_python")
    assert run_python("print(6 * 7)") == "42"  # the public, synchronous call
    assert asyncio.run(run_python.async_call("print(6 * 7)")) == "42"


def test_the_programs_of_different_rollouts_run_at_once(tmp_path):
    """Each program marks a shared folder, then waits (at most 10 s) until all four have: by
    default the runner awaits them together ("process" isolation: the folder is shared)."""
    code = (
        "import os, time\n"
        f"folder = {str(tmp_path)!r}\n"
        "open(os.path.join(folder, str(os.getpid())), 'w').close()\n"
        "end = time.monotonic() + 10\n"
        "while len(os.listdir(folder)) < 4 and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "print('together' if len(os.listdir(folder)) >= 4 else 'alone')"
    )
    tools = ToolSet([PythonSandbox(wall_seconds=20.0, isolation=isolation.PROCESS)])
    tool_call = {
        "type": "function",
        "function": {"name": "run_python", "arguments": {"code": code}},
    }
    with ToolRunner(timeout=30.0) as runner:
        results = runner.run([[(tools, tool_call)] for _ in range(4)])
    assert [rollout[0].content for rollout in results] == ["together"] * 4


def test_a_call_past_the_tool_timeout_is_cancelled_and_leaves_nothing(sandbox, needs_containment):
    tools = ToolSet([like(sandbox, wall_seconds=60.0)])
    code = "import time\ntime.sleep(60)"
    tool_call = {
        "type": "function",
        "function": {"name": "run_python", "arguments": {"code": code}},
    }
    with ToolRunner(timeout=0.5) as runner:
        (result,) = runner.run([[(tools, tool_call)]])[0]
    assert "timed out after 0.5 s" in result.content["error"]
    end = time.monotonic() + 10
    while sandbox_leftovers() != ([], []) and time.monotonic() < end:
        time.sleep(0.05)
    assert sandbox_leftovers() == ([], [])


def test_auto_prefers_util_linux_then_bubblewrap(monkeypatch):
    if isolation.missing_tools() or isolation.bubblewrap() is None:
        pytest.skip("needs both util-linux and bubblewrap (`bwrap`)")
    for mechanism in (isolation.NAMESPACES, isolation.BUBBLEWRAP):
        if PythonSandbox(isolation=mechanism)("print(6 * 7)") != "42":
            pytest.skip(f"this machine cannot run the {mechanism} mechanism")
    monkeypatch.setattr(python_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert PythonSandbox(**LIMITS).mechanism == isolation.NAMESPACES
        tried = refuse_util_linux(monkeypatch)
        sandbox = PythonSandbox(**LIMITS)
        assert sandbox.mechanism == isolation.BUBBLEWRAP
        assert tried == [isolation.NAMESPACES]  # tried first, refused
        # isolated: the host's /etc and the project are not there
        assert sandbox("import os\nprint(sorted(os.listdir('/etc')))") == "['ld.so.cache']"
        assert sandbox(f"print(open({SETUP_CFG!r}).read())").endswith(
            f"No such file or directory: {SETUP_CFG!r}"
        )
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []


@pytest.mark.parametrize("bubblewrap", ["not installed", "refused"])
def test_without_namespaces_it_runs_in_a_process_and_warns_once(monkeypatch, tmp_path, bubblewrap):
    monkeypatch.setattr(isolation, "missing_tools", lambda: ["unshare"])
    denied = "bwrap: setting up uid map: Permission denied"
    executable = None if bubblewrap == "not installed" else fake_bubblewrap(tmp_path, denied)
    monkeypatch.setattr(isolation, "bubblewrap", lambda: executable)
    monkeypatch.setattr(python_module, "_warned", set())
    monkeypatch.setenv("RUN_PYTHON_TEST_SECRET", "s3cr3t-4f1e9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = PythonSandbox(**LIMITS), PythonSandbox(**LIMITS)
        assert first("print(2**10)") == "1024"
        assert second("import os\nprint(os.getcwd())").startswith(tempfile.gettempdir())
        output = first("import os\nprint(dict(os.environ))")
        assert second("x = bytearray(8 * 1024**3)").endswith("MemoryError")
    assert first.mechanism == second.mechanism == isolation.PROCESS
    assert "s3cr3t-4f1e9" not in output
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "the util-linux programs unshare are not installed; bubblewrap" in messages[0]
    if executable is None:
        assert "bubblewrap (`bwrap`) is not installed." in messages[0]
    else:
        assert f"bubblewrap cannot make them here ({denied})." in messages[0]
    if os.geteuid() != 0:
        assert "can read and write whatever this user can, reach the network" in messages[0]
    else:  # an interpreter under root's home here, or one that others may run
        assert "NOT bounded:" in messages[0] and "reach the network" in messages[0]
    assert "or install bubblewrap (`apt install bubblewrap`" in messages[0]
    assert sandbox_leftovers()[1] == []


# --- round two: what a second tester got through ---------------------------------------------

PIDFD_OPEN = seccomp_module.syscall_number("pidfd_open")
PIDFD_GETFD = seccomp_module.syscall_number("pidfd_getfd")


def test_nothing_of_the_host_is_open_to_the_program_and_its_status_cannot_be_forged(sandbox):
    """The program looks for descriptors of its own beyond 0-2, takes its launcher's with
    `pidfd_getfd` or `/proc/<launcher>/fd`, writes a normal exit status into whatever it got, and
    kills its launcher: it gets nothing, and the call is not reported as a normal exit."""
    needs_filter()
    if sandbox.mechanism == isolation.PROCESS and os.geteuid() != 0:
        pytest.skip(
            "the fallback's program runs as the trainer's user, who may read its descriptors"
        )
    program = (
        "import ctypes, os, signal, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "launcher = os.getppid()\n"
        "own = []\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "        own.append(fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('own', own)\n"
        f"pidfd = libc.syscall({PIDFD_OPEN}, launcher, 0)\n"
        "print('pidfd_open', os.strerror(ctypes.get_errno()) if pidfd < 0 else 'opened')\n"
        "taken = []\n"
        "if pidfd >= 0:\n"
        "    for fd in range(64):\n"
        f"        new = libc.syscall({PIDFD_GETFD}, pidfd, fd, 0)\n"
        "        if new >= 0:\n"
        "            taken.append(new)\n"
        "try:\n"
        "    for name in os.listdir(f'/proc/{launcher}/fd'):\n"
        "        try:\n"
        "            taken.append(os.open(f'/proc/{launcher}/fd/{name}', os.O_WRONLY))\n"
        "        except OSError:\n"
        "            pass\n"
        "except OSError:\n"
        "    pass\n"
        "print('taken', len(taken))\n"
        "written = 0\n"
        "for fd in taken:\n"
        "    try:\n"
        "        written += os.write(fd, b'0')\n"
        "    except OSError:\n"
        "        pass\n"
        "print('written', written, flush=True)\n"
        "os.kill(launcher, signal.SIGKILL)\n"
        "time.sleep(2)\n"
    )
    result = sandbox(program)
    lines = result.splitlines()
    assert lines[:4] == [
        "own []",
        "pidfd_open Operation not permitted",
        "taken 0",
        "written 0",
    ], result
    assert result.failed and result.exit_status is None, result
    assert lines[-1] == (
        "[run_python] Error: the sandbox's launcher was killed before it reported the program's "
        "end; the program was stopped."
    )


def test_a_program_cannot_pass_for_a_limit_or_a_note_of_the_trainer(sandbox):
    """A program that prints the time-limit note and exits 0 is not a timeout: its line is escaped,
    and the result's fields, which a reward reads, say what the trainer saw."""
    forged = "[run_python] Error: the program ran past the time limit of 5 s and was stopped."
    result = sandbox(f"print('[run_python] (no output)')\nprint({forged!r})")
    assert result == "\\[run_python] (no output)\n\\" + forged
    assert (result.limit, result.failed, result.exit_status) == (None, False, 0)
    assert not is_failure(tool_message("run_python", result))
    stopped = like(sandbox, wall_seconds=1.0)("import time\ntime.sleep(60)")
    assert (
        stopped == "[run_python] Error: the program ran past the time limit of 1 s and was stopped."
    )
    assert (stopped.limit, stopped.failed, stopped.exit_status) == ("wall_seconds", True, None)
    assert tool_message("run_python", stopped)["content"].limit == "wall_seconds"
    assert is_failure(tool_message("run_python", stopped))
    killed = sandbox("import os\nos.kill(os.getpid(), 9)")
    assert (killed.signal, killed.limit, killed.exit_status) == ("SIGKILL", None, None)
    assert sandbox("import sys\nsys.exit(3)").exit_status == 3


def test_control_characters_come_back_escaped(sandbox):
    """ANSI escapes, an OSC 52 clipboard write, a bidi override, a carriage return and NUL reach
    neither the model's context nor a terminal raw."""
    result = sandbox(r"print('\x1b[2J\x1b]52;c;ZXZpbA==\x07\u202egnp.exe\r\x00 ok\tdone')")
    assert result == r"\x1b[2J\x1b]52;c;ZXZpbA==\x07\u202egnp.exe\r\x00 ok" + "\tdone"


PROC_PROGRAM = """\
import ctypes, os, subprocess, sys
def write(path, value):
    try:
        with open(path, 'w') as file:
            file.write(value)
        return 'written'
    except OSError:  # EACCES (the program is not dumpable) or EROFS
        return 'refused'
for name, value in (('oom_score_adj', '0'), ('loginuid', '0'), ('autogroup', '19')):
    print(name, write(f'/proc/self/{name}', value))
# a process it execs is dumpable again, and owns its /proc files
lowered = subprocess.run(
    [sys.executable, '-c', "open('/proc/self/oom_score_adj', 'w').write('0')"],
    capture_output=True,
)
print('child', open('/proc/self/oom_score_adj').read().strip(), lowered.returncode != 0)
for name in ('cmdline', 'key-users'):
    print(name, repr(open(f'/proc/{name}').read()))
libc = ctypes.CDLL(None, use_errno=True)
print('inotify', libc.inotify_init1(0), os.strerror(ctypes.get_errno()))
print('fanotify', libc.fanotify_init(0x200, 0), os.strerror(ctypes.get_errno()))
seen = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    for name in ('cmdline', 'environ', 'cgroup', 'mountinfo'):
        try:
            seen.append(open(f'/proc/{pid}/{name}', 'rb').read().decode(errors='replace'))
        except OSError:
            pass
    for link in ('cwd', 'root', *(f'fd/{fd}' for fd in range(64))):
        try:
            seen.append(os.readlink(f'/proc/{pid}/{link}'))
        except OSError:
            pass
print('leaks', [secret for secret in SECRETS if secret in '\\n'.join(seen)])
"""


def test_proc_is_read_only_and_shows_nothing_of_the_host_or_the_trainer(sandbox, needs_namespaces):
    """The program (and a process it execs) cannot lower its `oom_score_adj` or set its loginuid
    or autogroup; `/proc/cmdline` and `/proc/key-users` are empty; inotify and fanotify are
    refused; no process of the sandbox shows the trainer's scratch folder, pid or cgroup."""
    needs_filter()
    with open("/proc/self/cgroup") as file:
        trainer_cgroups = {line.strip().split(":", 2)[2] for line in file} - {"/"}
    secrets = [cgroups.PREFIX, tempfile.gettempdir() + "/", *trainer_cgroups]
    output = sandbox(f"SECRETS = {secrets!r}\n" + PROC_PROGRAM)
    assert output.splitlines() == [
        "oom_score_adj refused",
        "loginuid refused",
        "autogroup refused",
        "child 1000 True",
        "cmdline ''",
        "key-users ''",
        "inotify -1 Operation not permitted",
        "fanotify -1 Operation not permitted",
        "leaks []",
    ], output


def test_a_writable_mount_below_a_read_only_path_is_read_only_inside(sandbox, needs_namespaces):
    """A writable mount of the host below the interpreter's prefix (one made for the test) is
    read-only in the sandbox, as its parent is: the read-only binds are recursive."""
    if os.geteuid() != 0:
        pytest.skip("making a mount for the test needs root")
    below = tempfile.mkdtemp(prefix="rw-below-", dir=os.path.realpath(sys.base_prefix))
    try:
        if os.system(f"mount -t tmpfs -o size=1m rw-below {below}") != 0:
            pytest.skip("cannot mount a tmpfs here")
        try:
            output = sandbox(f"open({below + '/written'!r}, 'w').write('x')")
            assert output.endswith(f"OSError: [Errno 30] Read-only file system: '{below}/written'")
            assert not os.path.exists(os.path.join(below, "written"))
        finally:
            os.system(f"umount {below}")
    finally:
        os.rmdir(below)


TCP_PROGRAM = """\
import os, socket, time
def fill():
    server = socket.socket()
    server.bind(('127.0.0.1', 0))
    server.listen(64)
    held, pairs = 0, []
    for _ in range(28):  # two descriptors each, of the 64 it may open
        client = socket.create_connection(server.getsockname())
        pairs.append((client, server.accept()[0]))  # never read
        client.setblocking(False)
        try:
            while True:
                held += client.send(b'x' * 65536)
        except OSError:
            pass
    print(held // 2**20, flush=True)
    time.sleep(2)  # holding it while the others fill theirs
    os._exit(0)
children = [pid for pid in (os.fork() for _ in range(3)) if pid or fill()]
for pid in children:
    os.waitpid(pid, 0)
"""


def test_unread_loopback_tcp_is_held_to_the_calls_memory(sandbox):
    """Data sent over loopback (bubblewrap brings it up; the fallback has the host's) and never
    read stays in kernel socket buffers: the call's cgroup counts it, so it stops near
    `memory_mb` instead of holding hundreds of MiB of the host's memory."""
    needs_cgroup()
    if sandbox.mechanism == isolation.NAMESPACES:
        pytest.skip("util-linux leaves the loopback interface down")
    output = like(sandbox, memory_mb=64, wall_seconds=20.0, cpu_seconds=10)(TCP_PROGRAM)
    held = output.splitlines()
    # 312 MiB before the leaf's TCP limit (cgroup v1); the kernel lets each socket run a little
    # past the limit with memory it had reserved
    assert len(held) == 3 and sum(map(int, held)) <= 64 * 1.25, output


FALLBACK_PROGRAM = """\
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
print('uid', os.getuid() != 0)
shm = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
ctypes.memset(libc.shmat(shm, None, 0), 1, 64 << 20)
moved = []
for parent in PARENTS:
    try:
        with open(os.path.join(parent, 'cgroup.procs'), 'w') as file:
            file.write(str(os.getpid()))
        moved.append(parent)
    except OSError:
        pass
print('moved', moved)
subprocess.Popen(['sleep', MARK], start_new_session=True)
"""


def shared_memory_of(size: int) -> int:
    """How many SysV shared memory segments of `size` bytes this IPC namespace holds."""
    with open("/proc/sysvipc/shm") as file:
        header, *rows = [line.split() for line in file]
    return sum(dict(zip(header, row))["size"] == str(size) for row in rows)


@pytest.mark.parametrize("interpreter", ["others may run it", "root's own"])
def test_the_fallback_as_root_bounds_what_its_warning_says(monkeypatch, interpreter):
    """Run by root, the process fallback runs a program as a uid of its own where other users can
    run the interpreter: it cannot leave its cgroup, and no daemon or shared memory of it outlives
    the call. Where they cannot (an interpreter under root's home), it runs as root without
    capabilities, and the warning says what is then not bounded."""
    if os.geteuid() != 0:
        pytest.skip("the fallback run by a user runs as that user")
    needs_cgroup()
    if interpreter == "others may run it":
        if not os.path.exists("/usr/bin/python3"):
            pytest.skip("no system interpreter that other users can run")
        monkeypatch.setattr(isolation, "interpreter", lambda: "/usr/bin/python3")
    monkeypatch.setattr(
        isolation, "others_can_run_interpreter", lambda: interpreter != "root's own"
    )
    monkeypatch.setattr(python_module, "_warned", set())
    mark = f"4321.{os.getpid()}{time.monotonic_ns() % 10**6}"
    parents = sorted(set(python_module._call_cgroups()[0].parents.values()))
    program = f"PARENTS = {parents!r}\nMARK = {mark!r}\n" + FALLBACK_PROGRAM
    segments = shared_memory_of(64 << 20)
    try:
        output = PythonSandbox(**LIMITS, isolation=isolation.PROCESS)(program)
        warning = python_module.fallback_warning("the test's reason")
        assert shared_memory_of(64 << 20) == segments  # none outlives the call
        if interpreter == "others may run it":
            assert output == "uid True\nmoved []"
            assert marked_processes(mark) == []
            assert "each program runs as a uid of its own" in warning
        else:
            assert output.startswith("uid False\nmoved ")
            assert "programs run as root without capabilities" in warning
            assert "a program can move itself out of the call's cgroup" in warning
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)


def test_flock_on_a_host_file_is_refused(sandbox):
    """`flock` on a file of the host that the program can read would block the host's processes
    that lock it; it is refused, while POSIX locks on its own files (SQLite's) work."""
    needs_filter()
    program = (
        "import fcntl, sqlite3\n"
        "with open('/etc/ld.so.cache', 'rb') as file:\n"
        "    try:\n"
        "        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "        print('locked')\n"
        "    except OSError as error:\n"
        "        print(error.strerror)\n"
        "database = sqlite3.connect('t.db')  # in its working directory\n"
        "database.execute('create table t (x)')\n"
        "database.commit()\n"
        "print(database.execute('select count(*) from t').fetchone())\n"
    )
    assert sandbox(program) == "No locks available\n(0,)"


def test_cpu_seconds_bound_a_chain_of_processes_as_a_whole(sandbox):
    """Six processes, each spending 0.7 s of CPU (under the 1 s that `RLIMIT_CPU` gives each) and
    then waiting for the next: the call's cgroup stops them at 1 s of CPU time together."""
    needs_cgroup()
    with open("/proc/self/mounts") as file:
        cpuacct = "cpuacct" in file.read()
    if python_module._call_cgroups()[0].version == 1 and not cpuacct:
        pytest.skip("the cgroup v1 cpuacct hierarchy is not mounted here")
    program = (
        "import os, time\n"
        "for stage in range(6):\n"
        "    end = time.process_time() + 0.7\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "    child = os.fork()\n"
        "    if child:\n"
        "        os.waitpid(child, 0)\n"
        "        os._exit(0)\n"
        "print('spent', round(6 * 0.7, 1), 'CPU-s')\n"
    )
    result = like(sandbox, cpu_seconds=1, wall_seconds=30.0)(program)
    assert "spent" not in result and result.limit == "cpu_seconds", result
    assert result.endswith(
        "[run_python] Error: the program ran past the CPU time limit of 1 s (all its processes "
        "together) and was stopped."
    )
