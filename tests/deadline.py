"""A hang is a failure: `deadline(seconds)` fails the test in the main thread once `seconds` have
passed, having written every thread's stack to stderr, so the failure says where it hung."""

import contextlib
import faulthandler
import signal

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
