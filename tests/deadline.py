"""A hang is a failure: `deadline(seconds)` fails the test in the main thread once `seconds` have
passed, having written every thread's stack to stderr, so the failure says where it hung;
`run_with_deadline` does the same for a command and every process it started."""

import contextlib
import faulthandler
import os
import signal
import subprocess

import pytest


@contextlib.contextmanager
def deadline(seconds: float, what: str = "the test"):
    def expire(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(f"{what} ran past its deadline of {seconds:g} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_with_deadline(command: list[str], seconds: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, **kwargs)` in a process group of
    its own: past `seconds`, every process of the group is killed (a launcher's workers too,
    which `subprocess.run`'s timeout would leave running) and the test fails with the end of
    what the command wrote to stderr."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        stdout, stderr = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(
            f"{' '.join(command[:4])} ... ran past its deadline of {seconds:g} s (a hang); its "
            f"processes were killed. Its stderr ended with:\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
