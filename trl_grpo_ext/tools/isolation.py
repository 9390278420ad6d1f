"""How `PythonSandbox` isolates a program: Linux namespaces set up by util-linux or by bubblewrap,
or, where neither can make them, a bare process with resource limits.

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

**Bubblewrap** (`bwrap`, 0.8 or later): the same namespaces, file system, environment and
capabilities, built by `bwrap` instead of util-linux. It is for machines that refuse `unshare
--user` to an unprivileged user but let `bwrap` make user namespaces: Ubuntu 23.10 and later
restrict unprivileged user namespaces with AppArmor and ship `bwrap` with a profile that allows
them; some distributions install `bwrap` setuid root. Differences: `bwrap` stays PID 1 of the
namespace (the program's parent, which counts toward its `RLIMIT_NPROC` in a user namespace), it
brings the namespace's loopback interface up (with nothing listening on it, a connection is
refused rather than unreachable), and `/` is remounted read-only after the setup.

- Run by an unprivileged user, `bwrap` makes a user namespace in which the program keeps the
  user's uid, without capabilities.
- Run by root, `bwrap` would make a user namespace that maps only uid 0 (`--uid` maps another uid
  inside to root outside), which `RLIMIT_NPROC` exempts. So root's `bwrap` makes no user
  namespace: it mounts as root, keeps only `CAP_SETUID`, `CAP_SETGID` and `CAP_SETPCAP` for the
  program's command, which is `setpriv` switching to an unused uid from `SANDBOX_UIDS` and
  dropping them, as with util-linux.
- With a setuid `bwrap` and no user namespaces, `RLIMIT_NPROC` counts all of the user's
  processes, as in the process fallback.

**Process** (the fallback, when namespaces cannot be made, e.g. in a Docker container with the
default seccomp profile, or under Ubuntu's AppArmor restriction of unprivileged user namespaces
without `bwrap`): a separate process in a session of its own, with the same resource limits, an
empty environment and a temporary working directory, but the host's file system and network as the
user running the trainer sees them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys

NAMESPACES = "namespaces"
BUBBLEWRAP = "bubblewrap"
PROCESS = "process"
MECHANISMS = (NAMESPACES, BUBBLEWRAP, PROCESS)

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
    uid = str(_sandbox_uid()) if as_root else ""
    setup = ["sh", "-c", SETUP_SCRIPT, "sandbox-setup", root, program, str(work_mb), uid]
    return [*unshare, "--", *setup, *_visible_paths(), "--", *command]


def bubblewrap() -> str | None:
    """The `bwrap` executable, on this process's `PATH` or the system's, or None."""
    path = os.pathsep.join(filter(None, (os.environ.get("PATH"), _PATH)))
    return shutil.which("bwrap", path=path)


def bubblewrap_command(
    program_fd: int, work_mb: int, command: list[str], as_root: bool | None = None
) -> list[str]:
    """The command that runs `command` (an interpreter and its arguments) in new namespaces made
    by `bwrap`, with the file open as `program_fd` (passed to it) copied to `/work/main.py`.
    `as_root`: whether to run as root (no user namespace, the program as a sandbox uid) or let
    `bwrap` make a user namespace; by default, whether this process is root."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    executable = bubblewrap()
    if executable is None:
        raise FileNotFoundError(
            "bubblewrap (`bwrap`) is not installed: install it (`apt install bubblewrap`) or "
            "choose another `isolation`."
        )
    arguments = [executable, "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if as_root:
        # bwrap's user namespace would keep root's uid on the host, which RLIMIT_NPROC exempts
        arguments += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        arguments += ["--unshare-cgroup-try"]
        for capability in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):  # setpriv's, below
            arguments += ["--cap-add", capability]
    else:
        arguments += ["--unshare-all"]
    arguments += ["--clearenv"]
    for name, value in environment().items():
        arguments += ["--setenv", name, value]
    paths = _visible_paths()
    # bwrap gives the directories it creates the modes of the host's (/root: 0700), which the
    # sandbox uid could not enter
    for directory in dict.fromkeys(["/dev", *(d for p in paths for d in _new_parents(p, paths))]):
        arguments += ["--perms", "0755", "--dir", directory]
    for path in paths:
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        else:
            arguments += ["--ro-bind", path, path]
    for device in ("null", "zero", "random", "urandom"):
        arguments += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    arguments += ["--symlink", "/proc/self/fd", "/dev/fd", "--proc", "/proc"]
    # mode 0777: as root, the program's uid does not own the tmpfs
    arguments += ["--perms", "0777", "--size", str(work_mb * 1024**2), "--tmpfs", "/work"]
    arguments += ["--perms", "0666", "--file", str(program_fd), "/work/main.py"]
    arguments += ["--symlink", "work", "/tmp", "--remount-ro", "/", "--chdir", "/work"]
    if as_root:
        uid = _sandbox_uid()
        command = [
            *("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"),
            *("--inh-caps=-all", "--bounding-set=-all", "--", *command),
        ]
    return [*arguments, "--", *command]


def _sandbox_uid() -> int:
    return SANDBOX_UIDS[next(_next_uid) % len(SANDBOX_UIDS)]


def _visible_paths() -> list[str]:
    """The host's paths the program sees, read-only: those of `SYSTEM_PATHS` that exist here, and
    the interpreter's prefix."""
    paths = [*SYSTEM_PATHS, os.path.realpath(sys.base_prefix)]
    return [path for path in dict.fromkeys(paths) if os.path.lexists(path)]


def _new_parents(path: str, paths: list[str]) -> list[str]:
    """The directories above `path` that are not in, or below, one of `paths`: those the new root
    must create for it, from the top."""
    parents = []
    parent = os.path.dirname(path)
    while parent != "/":
        parents.append(parent)
        parent = os.path.dirname(parent)
    covered = [p for p in paths if not os.path.islink(p)]
    return [
        d for d in reversed(parents) if not any(d == p or d.startswith(p + "/") for p in covered)
    ]


def environment() -> dict[str, str]:
    """The program's whole environment: none of the parent's variables."""
    return {"PATH": _PATH, "HOME": "/work", "LANG": "C.UTF-8"}
