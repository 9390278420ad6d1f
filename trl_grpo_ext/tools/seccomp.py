"""The seccomp filter of `run_python`'s programs: kernel surface a math tool has no use for.

Built once per process with libseccomp (through its ctypes bindings, PyPI's `pyseccomp`, the
`sandbox` extra; libseccomp itself is the system's `libseccomp2`) and handed to the sandbox as
compiled BPF, which the program's launcher loads with `prctl` before it runs the program (the
launcher runs `python -I -S`, without site-packages, so it cannot import the bindings itself).

What the filter refuses (everything else is allowed):
- socket families other than unix, inet and inet6 (`EAFNOSUPPORT`): no vsock, netlink, packet,
  bluetooth... sockets (the network namespace already leaves inet with nowhere to go);
- new namespaces (`unshare`, `setns`, `clone` with a `CLONE_NEW*` flag: `EPERM`; `clone3`, whose
  flags a filter cannot read: `ENOSYS`, so that the C library falls back to `clone`);
- keyrings (`add_key`, `keyctl`, `request_key`), `io_uring`, `ptrace`, `pidfd_open` and
  `pidfd_getfd` (another process's descriptors), inotify and fanotify, `bpf`,
  `perf_event_open`, `userfaultfd`, mounts, and the administration calls below (`EPERM`).
`flock` fails with `ENOLCK` (POSIX record locks through `fcntl` stay: SQLite uses them).
System calls of another architecture than the interpreter's (e.g. 32-bit calls from a 64-bit
program) kill the program: libseccomp's default for a foreign architecture.
"""

from __future__ import annotations

import errno
import functools
import tempfile

# Refused with EPERM: what a program of the standard library has no use for, and kernel surface
# that containers commonly close.
REFUSED = (
    *("add_key", "keyctl", "request_key"),
    *("io_uring_setup", "io_uring_enter", "io_uring_register"),
    *("ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd"),
    # a process's descriptors taken from it (its launcher's status pipe)
    *("pidfd_open", "pidfd_getfd"),
    # watching the host's files for activity (`/usr` is a bind of the host's)
    *("inotify_init", "inotify_init1", "fanotify_init"),
    *("unshare", "setns"),
    *("mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "mount_setattr"),
    *("fsopen", "fsconfig", "fsmount", "fspick"),
    *("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load"),
    *("swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "settimeofday", "clock_settime"),
    *("open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "personality"),
)
# socket families a program may open: unix, inet, inet6
SOCKET_FAMILIES = (1, 2, 10)
_HIGHEST_FAMILY = 64  # AF_MAX is 46 on Linux 6.x; families above this are refused as well
_CLONE_NAMESPACES = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


class Unavailable(RuntimeError):
    """No filter can be built here; the message says why and what to install."""


@functools.lru_cache(maxsize=1)
def compiled_filter() -> bytes:
    """The filter as BPF instructions (`struct sock_filter[]`), built once per process.

    Raises:
        Unavailable: `pyseccomp` or the system's libseccomp is missing.
    """
    try:
        import pyseccomp as seccomp
    except ImportError as error:
        raise Unavailable(
            "the libseccomp bindings are not installed: `pip install 'trl_grpo_ext[sandbox]'` "
            "(PyPI's pyseccomp)"
        ) from error
    except (OSError, AttributeError, TypeError) as error:  # the bindings load libseccomp.so.2
        raise Unavailable(
            f"libseccomp cannot be loaded ({error}): install the system's libseccomp2 "
            "(`apt install libseccomp2`)"
        ) from error
    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in REFUSED:
        _add(rules, refuse, name)
    _add(rules, seccomp.ERRNO(errno.ENOSYS), "clone3")
    # `flock` on a host file it can read (the interpreter, ld.so.cache) would block the host's
    # processes that lock it; POSIX record locks (`fcntl`), which SQLite uses in /work, stay
    _add(rules, seccomp.ERRNO(errno.ENOLCK), "flock")
    for flag in _CLONE_NAMESPACES:
        _add(rules, refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    no_family = seccomp.ERRNO(errno.EAFNOSUPPORT)
    for family in range(_HIGHEST_FAMILY + 1):
        if family not in SOCKET_FAMILIES:
            for call in ("socket", "socketpair"):
                _add(rules, no_family, call, seccomp.Arg(0, seccomp.EQ, family))
    for call in ("socket", "socketpair"):
        _add(rules, no_family, call, seccomp.Arg(0, seccomp.GT, _HIGHEST_FAMILY))
    with tempfile.TemporaryFile() as file:
        rules.export_bpf(file)
        file.seek(0)
        return file.read()


def _add(rules, action, name: str, *arguments) -> None:
    import pyseccomp as seccomp

    # a call this architecture or this libseccomp does not know: nothing to refuse
    if seccomp.resolve_syscall(seccomp.system_arch(), name) >= 0:
        rules.add_rule(action, name, *arguments)


def syscall_number(name: str) -> int:
    """The number of system call `name` on this architecture, or -1 where unknown."""
    try:
        import pyseccomp as seccomp

        return seccomp.resolve_syscall(seccomp.system_arch(), name)
    except Exception:  # no bindings or no libseccomp: the table of common architectures
        import platform

        return _KEYCTL.get(platform.machine(), -1) if name == "keyctl" else -1


_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280}
