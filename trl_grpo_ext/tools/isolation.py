"""How `PythonSandbox` isolates a program: Linux namespaces set up by util-linux, or, where they
are not available, a bare process with resource limits.

**Namespaces** (`unshare`, `mount`, `pivot_root` and `setpriv` of util-linux, on nearly every
Linux): the program runs in new network, PID, mount, IPC and UTS namespaces. Its file system is a
fresh tmpfs holding read-only bind mounts of the system directories (`/usr` and the `/bin`,
`/lib`... links to it, `/etc/ld.so.cache`), the interpreter's own prefix (`sys.base_prefix`),
`/dev/{null,zero,random,urandom}`, a new `/proc`, and a writable tmpfs `/work` (its working
directory, `/tmp` points to it); the host's root is unmounted after `pivot_root`, so nothing else
of the host (home directories, `/etc`, `/tmp`, the project) exists for it. The network namespace
has only a loopback interface, down. When all of it dies (the program exits, or is killed), the
kernel kills every process left in its PID namespace.

- Run by an unprivileged user, the namespaces are made in a new user namespace whose root is the
  user; the program runs with every capability dropped (`setpriv --bounding-set=-all`), so it
  cannot undo the read-only mounts, and `RLIMIT_NPROC` counts only its own processes (the kernel
  counts processes per user namespace).
- Run by root, no user namespace is needed: the mounts are made as root, then the program runs as
  an unused uid (one per call, from `SANDBOX_UIDS`) with no capabilities. This matters: the kernel
  exempts uid 0 from `RLIMIT_NPROC`, even inside a user namespace, so a fork bomb of root's would
  be unbounded.

**Process** (the fallback, when namespaces cannot be made, e.g. in a Docker container with the
default seccomp profile, or under Ubuntu's AppArmor restriction of unprivileged user namespaces):
a separate process in a session of its own, with the same resource limits, an empty environment
and a temporary working directory, but the host's file system and network as the user running
the trainer sees them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys

NAMESPACES = "namespaces"
PROCESS = "process"

# uids for the programs of a root process, one per call: `RLIMIT_NPROC` counts per uid, so calls
# running at once do not share a count. High and unnamed, so no file on the host belongs to them.
SANDBOX_UIDS = range(1_900_000_000, 2_000_000_000)
_next_uid = itertools.count(os.getpid() * 1000)

# What the program sees of the host, read-only: the system directories (or, with a merged /usr,
# the links to it) and the dynamic linker's cache. Paths missing on a host are skipped.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")

# Runs as root of the new mount namespace: builds the program's root, moves into it, drops the
# host's root and privileges, and runs the rest of its arguments (the interpreter).
# $1: mount point of the new root; $2: the program's file; $3: size of /work in MiB; $4: uid to
# run as ("" in a user namespace: stay its root without capabilities); then read-only paths; "--".
SETUP_SCRIPT = r"""
set -eu
root=$1 program=$2 size=$3 uid=$4
shift 4
mount -t tmpfs -o mode=0755,size=1m sandbox "$root"
while [ "$1" != "--" ]; do
  path=$1
  shift
  mkdir -p "$root$(dirname "$path")"
  if [ -L "$path" ]; then
    ln -s "$(readlink "$path")" "$root$path"
  elif [ -d "$path" ]; then
    mkdir -p "$root$path"
    mount --rbind "$path" "$root$path"
    mount -o remount,bind,ro "$root$path"
  elif [ -e "$path" ]; then
    touch "$root$path"
    mount --bind "$path" "$root$path"
    mount -o remount,bind,ro "$root$path"
  fi
done
shift
mkdir -p "$root/dev" "$root/proc" "$root/work" "$root/old"
for device in null zero random urandom; do
  touch "$root/dev/$device"
  mount --bind "/dev/$device" "$root/dev/$device"
done
ln -s /proc/self/fd "$root/dev/fd"
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t tmpfs -o "mode=0755,size=${size}m,nosuid,nodev" work "$root/work"
cp "$program" "$root/work/main.py"
ln -s work "$root/tmp"
if [ -n "$uid" ]; then
  chown -R "$uid:$uid" "$root/work"
fi
cd "$root"
pivot_root . old
umount -l /old
rmdir /old
mount -o remount,bind,ro /
cd /work
unset OLDPWD
# Not `exec`: this shell stays PID 1 of the namespace, so the program's signals act as usual
# (PID 1 ignores the ones it has no handler for), and the namespace ends when the program does.
if [ -n "$uid" ]; then
  setpriv --reuid="$uid" --regid="$uid" --clear-groups --no-new-privs \
    --inh-caps=-all --bounding-set=-all -- "$@"
else
  setpriv --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@"
fi
"""

_TOOLS = ("unshare", "mount", "umount", "pivot_root", "setpriv")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_tools() -> list[str]:
    """The util-linux programs the namespaces need that are not installed."""
    return [tool for tool in _TOOLS if shutil.which(tool, path=_PATH) is None]


def interpreter() -> str:
    """The Python executable programs run with: this interpreter's real file (not a virtual
    environment's link to it), which finds its standard library under `sys.base_prefix`."""
    return os.path.realpath(sys.executable)


def namespace_command(
    root: str, program: str, work_mb: int, command: list[str], as_root: bool | None = None
) -> list[str]:
    """The command that runs `command` (an interpreter and its arguments) in new namespaces, with
    `program` as `/work/main.py` and `root` (an empty directory) as the mount point of its root.
    `as_root`: whether to run as root (mounts as root, the program as a sandbox uid) or in a user
    namespace; by default, whether this process is root."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    unshare = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    if not as_root:
        unshare += ["--user", "--map-root-user"]
    uid = str(SANDBOX_UIDS[next(_next_uid) % len(SANDBOX_UIDS)]) if as_root else ""
    paths = [*SYSTEM_PATHS, os.path.realpath(sys.base_prefix)]
    paths = [path for path in dict.fromkeys(paths) if os.path.lexists(path)]
    setup = ["sh", "-c", SETUP_SCRIPT, "sandbox-setup", root, program, str(work_mb), uid]
    return [*unshare, "--", *setup, *paths, "--", *command]


def environment() -> dict[str, str]:
    """The program's whole environment: none of the parent's variables."""
    return {"PATH": _PATH, "HOME": "/work", "LANG": "C.UTF-8"}
