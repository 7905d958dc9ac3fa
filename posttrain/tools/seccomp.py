"""The python tool sandbox's seccomp filter: the system calls a snippet is refused, compiled by libseccomp.

`filter_program()` -> the BPF program (bytes) that `posttrain.tools.jail_launcher` loads in the snippet's process
just before `execve` (after the sandbox's set-up, which itself needs `mount` and `unshare`). It is built once per
process with `pyseccomp` (libseccomp's API through ctypes; needs the system's libseccomp2) and exported; the
launcher, which runs without site-packages, only hands it to `prctl(PR_SET_SECCOMP)`.

What it refuses, with EPERM (the snippet sees an ordinary error, its interpreter goes on):
- sockets of any family but AF_UNIX, AF_INET and AF_INET6 (AF_VSOCK reaches a VM's host whatever the network
  namespace; AF_NETLINK, AF_PACKET, AF_BLUETOOTH, ... are kernel attack surface);
- the kernel's key store (`keyctl`, `add_key`, `request_key`), `io_uring_*`, `userfaultfd`, `bpf`,
  `perf_event_open`, `ptrace`, `process_vm_readv/writev`, `kexec_*`, module loading, the `mount` family
  (`mount`, `umount2`, `pivot_root`, `move_mount`, `open_tree`, `fsopen`, ...), `unshare`, `setns`, `clone`
  with a namespace flag, and a few more that no snippet needs (`open_by_handle_at`, `kcmp`, `swapon`, `reboot`,
  clock setting, ...);
- `clone3` answers ENOSYS instead (its flags are in memory a filter cannot read; C libraries then fall back to
  `clone`, whose flags it can), and a system call of another ABI (i386 `int 0x80`, x32) answers EPERM.
Everything else is allowed: the other limits (namespaces, uid, rlimits, cgroups) do the rest.
"""

from __future__ import annotations

import errno
import tempfile
from functools import lru_cache

__all__ = ["ALLOWED_SOCKET_FAMILIES", "REFUSED", "SeccompUnavailable", "filter_program"]

#: System calls refused with EPERM (names unknown on this machine's architecture are skipped).
REFUSED = (
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "bpf", "perf_event_open",
    "ptrace", "process_vm_readv", "process_vm_writev", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "create_module",
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    "open_by_handle_at", "name_to_handle_at", "kcmp", "pidfd_getfd", "lookup_dcookie", "acct", "quotactl",
    "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "syslog",
    "iopl", "ioperm", "uselib", "vhangup", "nfsservctl", "fanotify_init",
)
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
ALLOWED_SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
#: clone(2) flags that make a namespace.
NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000)


class SeccompUnavailable(RuntimeError):
    """The filter cannot be built here (pyseccomp or the system's libseccomp missing); the message says which."""


def _socket_rules(sf, seccomp, name: str, deny: int) -> None:
    """`name`'s first argument (the family) must be one of ALLOWED_SOCKET_FAMILIES: one rule per refused value
    below the largest allowed one, one for all above it (libseccomp ORs rules; one rule cannot say "not in")."""
    top = max(ALLOWED_SOCKET_FAMILIES)
    for family in range(top):
        if family not in ALLOWED_SOCKET_FAMILIES:
            sf.add_rule(deny, name, seccomp.Arg(0, seccomp.EQ, family))
    sf.add_rule(deny, name, seccomp.Arg(0, seccomp.GT, top))


@lru_cache(maxsize=1)
def filter_program() -> bytes:
    """The filter as a BPF program for the native architecture (built once per process); raises
    `SeccompUnavailable`."""
    try:
        import pyseccomp as seccomp  # lazy: loads libseccomp through ctypes
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: "Unable to find libseccomp"
        raise SeccompUnavailable(f"seccomp filter: {e} (install libseccomp2 and the pyseccomp package)") from None
    deny = seccomp.ERRNO(errno.EPERM)
    try:
        sf = seccomp.SyscallFilter(seccomp.ALLOW)
        sf.set_attr(seccomp.Attr.ACT_BADARCH, deny)
        for name in REFUSED:
            if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) >= 0:
                sf.add_rule(deny, name)
        for name in ("socket", "socketpair"):
            _socket_rules(sf, seccomp, name, deny)
        for flag in NAMESPACE_FLAGS:
            sf.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, "clone3") >= 0:
            sf.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        with tempfile.TemporaryFile() as f:
            sf.export_bpf(f)
            f.seek(0)
            program = f.read()
    except OSError as e:
        raise SeccompUnavailable(f"seccomp filter: libseccomp refused it: {e}") from None
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"seccomp filter: libseccomp exported {len(program)} bytes, not a BPF program")
    return program
