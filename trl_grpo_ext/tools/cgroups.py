"""A cgroup per `run_python` call: memory and processes bounded for the call as a whole.

`RLIMIT_AS` bounds each process's address space, not what a program holds across processes,
memfds, shared memory or its tmpfs; `RLIMIT_NPROC` does not apply to root. A cgroup leaf per call
bounds all of it: `memory_mb` (swap included) and `max_processes` for every process of the call,
and on a memory overrun the kernel's OOM killer acts inside the leaf only.

Where the leaf is made, below the trainer's own cgroup:
- **cgroup v2** (`cgroup2` mounted at `/sys/fs/cgroup`, or at `/sys/fs/cgroup/unified` on a
  hybrid host): when the trainer's cgroup hands the `memory` and `pids` controllers to its children
  (both listed in its `cgroup.subtree_control`), as root or in a delegated cgroup. The leaf has
  `memory.max`, `memory.swap.max` 0, `memory.oom.group` 1 (an overrun kills the whole call) and
  `pids.max`.
- **cgroup v1** (hosts that still mount the `memory` and `pids` hierarchies, whose v2 has no
  controllers): one leaf in each, with `memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`
  where swap is accounted, `memory.kmem.tcp.limit_in_bytes` (v1 charges socket buffers to a
  leaf only with it; v2 always does) and `pids.max`; and one in `cpuacct` where it is mounted,
  for the CPU time of the whole call (v2's `cpu.stat` has it in any leaf).
- Otherwise no leaf: `CgroupsUnavailable` says why, and the sandbox states the bounds that hold.

A leaf is named `run_python-<owner>-<n>`, the owner being the trainer's pid and start time, so a
later trainer can tell a dead one's leaves from a live one's: `remove_stale` kills what is left in
the first and removes them.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time

PREFIX = "run_python-"
_MOUNTS = "/proc/self/mountinfo"
_numbers = itertools.count()


class CgroupsUnavailable(RuntimeError):
    """No per-call cgroup can be made here; the message says why and what would allow it."""


def owner() -> str:
    """This process's pid and start time (in clock ticks since boot): unique across restarts."""
    return f"{os.getpid()}.{_start_time(os.getpid())}"


def is_dead(name: str) -> bool:
    """Whether the owner named in `run_python-<pid>.<start>-...` no longer runs."""
    try:
        pid, start = name[len(PREFIX) :].split("-", 1)[0].split(".")
        return _start_time(int(pid)) != int(start)
    except (ValueError, IndexError):
        return False  # not a name of ours: leave it


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Hierarchy:
    """Where leaves are made: one directory (v2) or one per controller (v1)."""

    def __init__(self, version: int, parents: dict[str, str]) -> None:
        self.version, self.parents = version, parents  # controller ("" for v2) -> directory

    def describe(self) -> str:
        where = ", ".join(sorted(set(self.parents.values())))
        return f"a cgroup v{self.version} leaf per call under {where}"

    def create(self, memory_bytes: int, processes: int) -> Leaf:
        name = f"{PREFIX}{owner()}-{next(_numbers)}"
        leaf = Leaf(self.version, {c: os.path.join(p, name) for c, p in self.parents.items()})
        try:
            for directory in leaf.directories.values():
                os.mkdir(directory)
            if self.version == 2:
                _write(leaf.directories[""], "memory.max", memory_bytes)
                _write_if_present(leaf.directories[""], "memory.swap.max", 0)
                _write_if_present(leaf.directories[""], "memory.oom.group", 1)
                _write(leaf.directories[""], "pids.max", processes)
            else:
                _write(leaf.directories["memory"], "memory.limit_in_bytes", memory_bytes)
                _write_if_present(
                    leaf.directories["memory"], "memory.memsw.limit_in_bytes", memory_bytes
                )
                # v1 counts socket buffers (unread TCP data) only for a leaf with a TCP limit
                _write_if_present(
                    leaf.directories["memory"], "memory.kmem.tcp.limit_in_bytes", memory_bytes
                )
                _write(leaf.directories["pids"], "pids.max", processes)
        except OSError:
            leaf.remove()
            raise
        return leaf

    def remove_stale(self) -> int:
        """Kills what is left in the leaves of dead trainers and removes them; how many."""
        removed = 0
        names = set()
        for parent in self.parents.values():
            try:
                names.update(n for n in os.listdir(parent) if n.startswith(PREFIX))
            except OSError:
                continue
        for name in names:
            if is_dead(name):
                Leaf(
                    self.version, {c: os.path.join(p, name) for c, p in self.parents.items()}
                ).remove()
                removed += 1
        return removed


class Leaf:
    """The cgroup of one call."""

    def __init__(self, version: int, directories: dict[str, str]) -> None:
        self.version, self.directories = version, directories

    @property
    def procs_files(self) -> list[str]:
        """The `cgroup.procs` files the call's first process writes itself into."""
        return [os.path.join(d, "cgroup.procs") for d in self.directories.values()]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for its memory limit."""
        if self.version == 2:
            path, key = os.path.join(self.directories[""], "memory.events"), "oom_kill"
        else:
            path, key = os.path.join(self.directories["memory"], "memory.oom_control"), "oom_kill"
        try:
            with open(path) as file:
                counts = dict(line.split() for line in file if line.strip())
            return int(counts.get(key, 0)) > 0
        except (OSError, ValueError):
            return False

    def cpu_seconds(self) -> float | None:
        """The CPU time that every process of the call has used so far, in seconds (v2's
        `cpu.stat`, v1's `cpuacct.usage`), or None where the leaf does not account for it."""
        try:
            if self.version == 2:
                with open(os.path.join(self.directories[""], "cpu.stat")) as file:
                    fields = dict(line.split() for line in file if line.strip())
                return int(fields["usage_usec"]) / 1e6
            if "cpuacct" in self.directories:
                with open(os.path.join(self.directories["cpuacct"], "cpuacct.usage")) as file:
                    return int(file.read()) / 1e9
        except (OSError, ValueError, KeyError):
            pass
        return None

    def kill(self) -> None:
        """Kills every process in the leaf (those that left the call's process group included)."""
        for directory in self.directories.values():
            self._kill(directory)

    def remove(self, timeout: float = 2.0) -> None:
        """Kills every process left in the leaf and removes it."""
        end = time.monotonic() + timeout
        for directory in self.directories.values():
            while os.path.isdir(directory):
                self._kill(directory)
                try:
                    os.rmdir(directory)
                except FileNotFoundError:
                    break
                except OSError as error:  # EBUSY: processes still exiting
                    if error.errno != errno.EBUSY or time.monotonic() > end:
                        break
                    time.sleep(0.005)

    def _kill(self, directory: str) -> None:
        if self.version == 2 and _write_if_present(directory, "cgroup.kill", 1):
            return
        try:
            with open(os.path.join(directory, "cgroup.procs")) as file:
                pids = [int(line) for line in file if line.strip()]
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class CpuWatch:
    """Kills every process of `leaf` once they have used more than `seconds` of CPU time
    together, checked every `interval` seconds by a thread of its own until `stop()`."""

    def __init__(self, leaf: Leaf, seconds: float, interval: float = 0.1) -> None:
        self.exceeded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(leaf, seconds, interval), name="run_python-cpu", daemon=True
        )
        self._thread.start()

    def _watch(self, leaf: Leaf, seconds: float, interval: float) -> None:
        while not self._stop.wait(interval):
            used = leaf.cpu_seconds()
            if used is None:
                return
            if used > seconds:
                self.exceeded = True
                leaf.kill()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def find() -> Hierarchy:
    """Where this process can make a leaf per call, checked by making and removing one.

    Raises:
        CgroupsUnavailable: with the reasons, for v2 and for v1.
    """
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    reasons = []
    if "" in mounts["v2"] and "" in own:
        parent = os.path.normpath(mounts["v2"][""] + own[""])
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as file:
                enabled = file.read().split()
        except OSError as error:
            enabled, reasons = [], [f"cgroup v2: {parent} cannot be read ({error.strerror})"]
        missing = [c for c in ("memory", "pids") if c not in enabled]
        if missing:
            reasons = reasons or [
                f"cgroup v2: the trainer's cgroup {parent} does not enable "
                f"{' and '.join(missing)} for its children (its cgroup.subtree_control: "
                f"{' '.join(enabled) or 'empty'}); run the trainer in a delegated cgroup whose "
                "subtree_control lists memory and pids"
            ]
        else:
            hierarchy = Hierarchy(2, {"": parent})
            reason = _try(hierarchy)
            if reason is None:
                return hierarchy
            reasons.append(f"cgroup v2: {reason}")
    else:
        reasons.append("cgroup v2 is not mounted")
    if all(c in mounts["v1"] and c in own for c in ("memory", "pids")):
        # and the CPU time of the whole call, where the cpuacct hierarchy is mounted
        controllers = [c for c in ("memory", "pids", "cpuacct") if c in mounts["v1"] and c in own]
        hierarchy = Hierarchy(
            1, {c: os.path.normpath(mounts["v1"][c] + own[c]) for c in controllers}
        )
        reason = _try(hierarchy)
        if reason is None:
            return hierarchy
        reasons.append(f"cgroup v1: {reason}")
    else:
        reasons.append("the cgroup v1 memory and pids hierarchies are not mounted")
    raise CgroupsUnavailable("; ".join(reasons))


def _try(hierarchy: Hierarchy) -> str | None:
    try:
        hierarchy.create(64 * 1024**2, 8).remove()
    except OSError as error:
        return (
            f"a leaf cannot be made under {', '.join(sorted(set(hierarchy.parents.values())))} "
            f"({error.strerror or error}); run as root or in a cgroup delegated to this user"
        )
    return None


def _cgroup_mounts() -> dict[str, dict[str, str]]:
    """Mount points: {"v2": {"": path}, "v1": {controller: path}}."""
    mounts: dict[str, dict[str, str]] = {"v2": {}, "v1": {}}
    try:
        with open(_MOUNTS) as file:
            lines = file.readlines()
    except OSError:
        return mounts
    for line in lines:
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        if fstype == "cgroup2":
            mounts["v2"].setdefault("", fields[4])
        elif fstype == "cgroup":
            for controller in ("memory", "pids", "cpuacct"):
                if controller in options:
                    mounts["v1"].setdefault(controller, fields[4])
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup paths: {"": v2 path, controller: v1 path}."""
    own = {}
    try:
        with open("/proc/self/cgroup") as file:
            for line in file:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    own[controller] = path
    except OSError:
        pass
    return own


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w") as file:
        file.write(str(value))


def _write_if_present(directory: str, name: str, value: int) -> bool:
    try:
        _write(directory, name, value)
        return True
    except FileNotFoundError:
        return False
