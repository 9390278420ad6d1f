"""What bounds a `run_python` call besides its namespaces, found once per process, and what a
trainer killed mid-call left behind, removed at the next start.

- `call_cgroups()`: where calls get a cgroup of their own (`cgroups.find`), or why they cannot;
- `without_cgroups` and `without_filter`: the warnings that say which bounds hold, and what stays
  open, where there is no cgroup or no seccomp filter;
- `remove_stale()`: the scratch folders and cgroups of dead trainers (named after their pid and
  start time), removed, and what still runs in those cgroups killed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

from . import cgroups
from .isolation import SHM_MB

_lock = threading.Lock()
_found: tuple[cgroups.Hierarchy | None, str] | None = None
_stale_removed = False


def call_cgroups() -> tuple[cgroups.Hierarchy | None, str]:
    """Where this process makes a cgroup per call, and "", found once; else None and why."""
    global _found
    with _lock:
        if _found is None:
            try:
                _found = (cgroups.find(), "")
            except cgroups.CgroupsUnavailable as error:
                _found = (None, str(error))
        return _found


def without_cgroups(reason: str) -> str:
    return (
        f"run_python cannot make a cgroup per call: {reason}. What bounds a call: `memory_mb` "
        "bounds each process's address space, not memory held across processes or in memfds, "
        f"/dev/shm ({SHM_MB} MiB) and /work (`work_mb`); `max_processes` bounds the program's "
        "processes only where it runs as a uid of its own (namespaces; not the process fallback "
        "as root); `cpu_seconds` each process's CPU time, `wall_seconds` the call's."
    )


def without_filter(reason: str) -> str:
    return (
        f"run_python runs programs without a seccomp filter: {reason}. Keyrings (beyond the new, "
        "empty session keyring each call joins), io_uring, nested user namespaces, ptrace, bpf, "
        "perf_event_open and every socket family (vsock included) stay open to them."
    )


def remove_stale_once() -> None:
    """`remove_stale()`, at this process's first call."""
    global _stale_removed
    with _lock:
        if _stale_removed:
            return
        _stale_removed = True
    remove_stale()


def remove_stale(folder: str | None = None) -> None:
    """Removes the scratch folders (in `folder`, by default the temp folder) and cgroups that
    trainers killed mid-call left behind, killing what still runs in those cgroups; those of
    live trainers are theirs, and left alone."""
    folder = folder or tempfile.gettempdir()
    for name in os.listdir(folder):
        if name.startswith(cgroups.PREFIX) and cgroups.is_dead(name):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    hierarchy, _ = call_cgroups()
    if hierarchy is not None:
        hierarchy.remove_stale()
