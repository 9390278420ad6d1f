"""How `PythonSandbox` isolates a program: Linux namespaces set up by util-linux or by bubblewrap,
or, where neither can make them, a bare process with resource limits.

**Namespaces** (`unshare`, `mount`, `pivot_root` and `setpriv` of util-linux, on nearly every
Linux): the program runs in new network, PID, mount, IPC and UTS namespaces. Its file system is a
fresh tmpfs holding read-only bind mounts of the system directories (`/usr` and the `/bin`,
`/lib`... links to it, `/etc/ld.so.cache`), the interpreter's own prefix (`sys.base_prefix`),
`/dev/{null,zero,random,urandom}`, a small `/dev/shm`, a new `/proc`, and a writable tmpfs `/work`
(its working directory, `/tmp` points to it; both tmpfs mounts have an inode cap); the host's root
is unmounted after `pivot_root`, so nothing else of the host (home directories, `/etc`, `/tmp`,
the project) exists for it. The read-only binds are read-only all the way down (a mount below them
too); `/proc` is read-only, with `/proc/cmdline` and `/proc/key-users` masked, and a cgroup
namespace shows the call's cgroup as `/`. The network namespace has only a loopback interface,
down. When all of it dies (the program exits, or is killed), the
kernel kills every process left in its PID namespace.

- Run by an unprivileged user, the namespaces are made in a new user namespace whose root is the
  user; the program runs with every capability dropped (`setpriv --bounding-set=-all`), so it
  cannot undo the read-only mounts, and `RLIMIT_NPROC` counts only its own processes (the kernel
  counts processes per user namespace).
- Run by root, no user namespace is needed: the mounts are made as root, then the program runs as
  an unused uid (one per call, drawn at random from `SANDBOX_UIDS` and reserved while it runs)
  with no capabilities. This matters: the kernel
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
empty environment and a temporary working directory, but the host's file system and network as its
uid sees them. Run by root, the launcher moves into an IPC namespace where it can make one and runs
the program as a uid of its own where other users can run the interpreter
(`others_can_run_interpreter`), else as root without capabilities.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import stat
import sys

NAMESPACES = "namespaces"
BUBBLEWRAP = "bubblewrap"
PROCESS = "process"
MECHANISMS = (NAMESPACES, BUBBLEWRAP, PROCESS)

# uids for the programs of a root process, one per call: `RLIMIT_NPROC` counts per uid, so calls
# running at once do not share a count. High and unnamed, so no file on the host belongs to them.
# Drawn at random and reserved while the call runs (`UidReservation`), so that no two calls of any
# processes share one, and an earlier run's uid is not predictable.
SANDBOX_UIDS = range(1_900_000_000, 2_000_000_000)
# Sizes of the program's /dev/shm (for `multiprocessing`'s semaphores and small shared arrays) and
# the inodes of its tmpfs mounts: a million empty files would otherwise hold about 1 GiB of kernel
# memory outside every limit.
SHM_MB = 16
WORK_INODES = 4096
SHM_INODES = 256

# What the program sees of the host, read-only: the system directories (or, with a merged /usr,
# the links to it) and the dynamic linker's cache. Paths missing on a host are skipped.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")

# Runs as root of the new mount namespace: builds the program's root, moves into it, drops the
# host's root and privileges, and runs the rest of its arguments (the interpreter).
# $1: mount point of the new root; $2: the program's file; $3: size of /work in MiB; $4: uid to
# run as ("" in a user namespace: stay its root without capabilities); $5: inodes of /work; $6:
# size of /dev/shm in MiB; $7: its inodes; then read-only paths; "--".
SETUP_SCRIPT = r"""
set -eu
root=$1 program=$2 size=$3 uid=$4 inodes=$5 shm=$6 shm_inodes=$7
shift 7
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
mkdir -p "$root/dev/shm" "$root/proc" "$root/work" "$root/old"
for device in null zero random urandom; do
  touch "$root/dev/$device"
  mount --bind "/dev/$device" "$root/dev/$device"
done
ln -s /proc/self/fd "$root/dev/fd"
# read-only: no process of the program can lower its oom_score_adj or set its loginuid
mount -t proc -o ro,nosuid,nodev,noexec proc "$root/proc"
for name in $MASKED_PROC; do
  mount --bind /dev/null "$root/proc/$name"
done
mount -t tmpfs -o "mode=0755,size=${size}m,nr_inodes=$inodes,nosuid,nodev" work "$root/work"
mount -t tmpfs -o "mode=1777,size=${shm}m,nr_inodes=$shm_inodes,nosuid,nodev" shm "$root/dev/shm"
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
# every mount below the read-only binds too (a writable mount of the host's below /usr): a bind
# remount acts on one mount only
targets=$(while read -r _ _ _ _ target _; do echo "$target"; done </proc/self/mountinfo)
for target in $targets; do
  case $target in
    / | /work | /dev/shm | /dev/* | /proc | /proc/*) ;;
    *) mount -o remount,bind,ro "$target" ;;
  esac
done
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

# Files of the program's `/proc` that tell of the host rather than of the sandbox: its boot
# arguments, and the uids (other calls') holding keys; they read as empty (`/dev/null` over them).
MASKED_PROC = ("cmdline", "key-users")
SETUP_SCRIPT = SETUP_SCRIPT.replace("$MASKED_PROC", " ".join(MASKED_PROC))

_TOOLS = ("unshare", "mount", "umount", "pivot_root", "setpriv")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_tools() -> list[str]:
    """The util-linux programs the namespaces need that are not installed."""
    return [tool for tool in _TOOLS if shutil.which(tool, path=_PATH) is None]


def interpreter() -> str:
    """The Python executable programs run with: this interpreter's real file (not a virtual
    environment's link to it), which finds its standard library under `sys.base_prefix`."""
    return os.path.realpath(sys.executable)


# The first process of every call, on the host: makes the OOM killer pick the sandbox before
# anything else (`oom_score_adj` 1000, inherited by all its processes), moves itself into the
# call's cgroup (its arguments up to "--": `cgroup.procs` files; 0 is the writer), then becomes the
# rest of its arguments. Run under `setpriv --pdeathsig KILL`, so it dies with the trainer.
JOIN_SCRIPT = r"""
echo 1000 >/proc/self/oom_score_adj
while [ "$1" != "--" ]; do
  echo 0 >"$1" || { echo "run_python: cannot join the call's cgroup ($1)" >&2; exit 125; }
  shift
done
shift
exec "$@"
"""


def first_process(command: list[str], procs_files: list[str] = ()) -> list[str]:
    """`command` run under a parent-death signal (SIGKILL when the trainer dies), with
    `oom_score_adj` 1000 and in the cgroup whose `cgroup.procs` files are `procs_files`."""
    join = ["sh", "-c", JOIN_SCRIPT, "run_python-join", *procs_files, "--", *command]
    if shutil.which("setpriv", path=_PATH) is None:  # util-linux missing: the process fallback
        return join
    return ["setpriv", "--pdeathsig", "KILL", "--", *join]


def namespace_command(
    root: str,
    program: str,
    work_mb: int,
    command: list[str],
    as_root: bool | None = None,
    uid: int | None = None,
) -> list[str]:
    """The command that runs `command` (an interpreter and its arguments) in new namespaces, with
    `program` as `/work/main.py` and `root` (an empty directory) as the mount point of its root.
    `as_root`: whether to run as root (mounts as root, the program as `uid`, by default a fresh
    one of `SANDBOX_UIDS`) or in a user namespace; by default, whether this process is root."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    unshare = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--fork"]
    unshare.append("--kill-child")
    if not as_root:
        # The user namespace first, in a process of its own: making it resets the parent-death
        # signal (the credentials change), which `setpriv` then sets again for the rest.
        unshare = [
            *("unshare", "--user", "--map-root-user", "--", "setpriv", "--pdeathsig", "KILL"),
            *("--", *unshare),
        ]
    uid_argument = str(uid if uid is not None else _random_uid()) if as_root else ""
    setup = [
        *("sh", "-c", SETUP_SCRIPT, "sandbox-setup", root, program, str(work_mb), uid_argument),
        *(str(WORK_INODES), str(SHM_MB), str(SHM_INODES)),
    ]
    return [*unshare, "--", *setup, *_visible_paths(), "--", *command]


def bubblewrap() -> str | None:
    """The `bwrap` executable, on this process's `PATH` or the system's, or None."""
    path = os.pathsep.join(filter(None, (os.environ.get("PATH"), _PATH)))
    return shutil.which("bwrap", path=path)


# Run as root in bwrap's namespaces, before the program: caps the inodes of the tmpfs mounts
# (which `bwrap --tmpfs` cannot), then runs the rest of its arguments.
_BUBBLEWRAP_INODES = r"""
mount -o "remount,nr_inodes=$1" /work && mount -o "remount,nr_inodes=$2" /dev/shm || exit 125
shift 2
exec "$@"
"""


def bubblewrap_command(
    program_fd: int,
    work_mb: int,
    command: list[str],
    as_root: bool | None = None,
    uid: int | None = None,
) -> list[str]:
    """The command that runs `command` (an interpreter and its arguments) in new namespaces made
    by `bwrap`, with the file open as `program_fd` (passed to it) copied to `/work/main.py`.
    `as_root`: whether to run as root (no user namespace, the program as `uid`, by default a fresh
    one of `SANDBOX_UIDS`) or let `bwrap` make a user namespace; by default, whether this process
    is root."""
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
        # setpriv's, below, and the remount of the tmpfs mounts with an inode cap
        for capability in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_SYS_ADMIN"):
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
    for name in MASKED_PROC:
        arguments += ["--dev-bind", "/dev/null", f"/proc/{name}"]  # --ro-bind: nodev
    arguments += ["--remount-ro", "/proc"]
    arguments += ["--perms", "1777", "--size", str(SHM_MB * 1024**2), "--tmpfs", "/dev/shm"]
    # mode 0777: as root, the program's uid does not own the tmpfs
    arguments += ["--perms", "0777", "--size", str(work_mb * 1024**2), "--tmpfs", "/work"]
    arguments += ["--perms", "0666", "--file", str(program_fd), "/work/main.py"]
    arguments += ["--symlink", "work", "/tmp", "--remount-ro", "/", "--chdir", "/work"]
    if as_root:
        uid = uid if uid is not None else _random_uid()
        command = [
            *("sh", "-c", _BUBBLEWRAP_INODES, "sandbox-inodes", str(WORK_INODES), str(SHM_INODES)),
            *("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"),
            *("--inh-caps=-all", "--bounding-set=-all", "--", *command),
        ]
    return [*arguments, "--", *command]


class UidReservation:
    """A uid of `SANDBOX_UIDS` that no other call, of this or any process on this host, uses while
    it is held: drawn at random, and held by binding an abstract unix socket named after it (the
    kernel refuses a second bind, and frees the name when the holder exits, even killed)."""

    def __init__(self) -> None:
        while True:
            uid = _random_uid()
            holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                holder.bind(f"\0trl_grpo_ext.run_python.uid.{uid}")
            except OSError:  # held by another call
                holder.close()
                continue
            self.uid, self._holder = uid, holder
            return

    def release(self) -> None:
        self._holder.close()


def others_can_run_interpreter() -> bool:
    """Whether a uid of no group (the process fallback's, run by root) can run `interpreter()`
    with its standard library: every folder above them searchable by others, the library's own
    folder readable (not so for an interpreter installed under root's home, mode 0700)."""
    library = os.path.dirname(os.path.realpath(os.__file__))
    for path in (os.path.dirname(interpreter()), library):
        while True:
            try:
                mode = os.stat(path).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH or (path == library and not mode & stat.S_IROTH):
                return False
            if path == "/":
                break
            path = os.path.dirname(path)
    return True


# IPC_RMID for each kind of SysV object: (its /proc/sysvipc file, its id column, how to remove it)
_SYSV = (("shm", "shmid", "shmctl"), ("sem", "semid", "semctl"), ("msg", "msqid", "msgctl"))


def remove_ipc(uid: int) -> None:
    """Removes the SysV shared memory segments, semaphores and message queues that `uid` owns in
    this IPC namespace (those of a program run without an IPC namespace of its own)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for kind, id_column, call in _SYSV:
        try:
            with open(f"/proc/sysvipc/{kind}") as file:
                header, *rows = [line.split() for line in file]
        except (OSError, ValueError):
            continue
        for row in rows:
            fields = dict(zip(header, row))
            if str(uid) in (fields.get("uid"), fields.get("cuid")):  # owner, or creator
                if call == "semctl":
                    libc.semctl(int(fields[id_column]), 0, 0, None)  # IPC_RMID
                else:
                    getattr(libc, call)(int(fields[id_column]), 0, None)


def _random_uid() -> int:
    return SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]


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
