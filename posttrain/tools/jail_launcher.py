"""The inside of the python tool's kernel sandbox, run by `posttrain.tools.jail`.

Standard library only (it runs without site-packages). Its source and its spec (JSON, the snippet's code included)
come on stdin, not on the command line: `python -I -S -B -c BOOT` (`jail.BOOT`) reads `SOURCE\0SPEC` and runs
this source with `SPEC` set, so `/proc/1/cmdline` inside shows no host path. Three processes, one job each:

- the launcher (this script's process): joins a fresh anonymous session keyring (a child keeps its parent's
  session keyring through new namespaces and uids, and possessing a keyring grants access to its keys), enters
  new user, mount, PID, network, IPC, UTS and cgroup namespaces (`unshare(2)`), tells the parent, which writes
  its uid/gid maps, then forks the namespace's init and exits with its status;
- init (PID 1 of the new PID namespace): builds the sandbox's root on a tmpfs (read-only, nosuid binds of the
  system and Python folders, a minimal /dev, its own /proc, a size-limited tmpfs /work: the only writable
  place, named `/work` unless a bound folder lies there), `pivot_root`s into it and detaches the host's tree, forbids new user namespaces, then forks the
  snippet and waits for it. When init exits, the kernel kills every process left in the namespace;
- the snippet: drops to the unprivileged uid (capabilities go with it), sets `no_new_privs` and its rlimits,
  reads from /dev/null, closes every other file, installs the seccomp filter (`spec["seccomp"]`: a BPF program
  libseccomp compiled in the parent, `posttrain.tools.seccomp`; loaded last, so set-up may still mount and
  unshare) and execs `python -I -B WORK/snippet.py`.

Errors before the snippet runs are written as one line `E<text>` to the status pipe; exit status 70.
"""

import ctypes
import errno
import json
import os
import platform
import resource
import signal

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 4, 38, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
HIDDEN = ("/proc/keys", "/proc/key-users", "/proc/kallsyms", "/proc/sysrq-trigger")  # /dev/null bound over them
DEVICES = ("null", "zero", "full", "random", "urandom")
FAILED = 70

libc = ctypes.CDLL(None, use_errno=True)


def _c(text):
    return None if text is None else os.fsencode(text)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src, target, fstype, flags, data=None):
    _check(libc.mount(_c(src), _c(target), _c(fstype), ctypes.c_ulong(flags), _c(data)), f"mount {target}")


def prctl(option, arg):
    _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def join_fresh_keyring():
    """A new anonymous session keyring for this process and all it starts (the trainer's is no longer possessed).
    Where the kernel refuses keyctl to this process (ENOSYS: no keys; EPERM: an outer seccomp filter) the snippet
    cannot reach any keyring either, and that is fine."""
    ret = libc.syscall(SYS_KEYCTL[platform.machine()], KEYCTL_JOIN_SESSION_KEYRING, None)
    if ret < 0 and ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
        raise OSError(ctypes.get_errno(), f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(ctypes.get_errno())}")


def install_seccomp(bpf_hex):
    """Load the BPF program libseccomp compiled in the parent (needs `no_new_privs`, set before)."""
    program = bytes.fromhex(bpf_hex)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")


def fail(status_fd, text):
    os.write(status_fd, ("E" + " ".join(str(text).split()) + "\n").encode())
    os._exit(FAILED)


def bind_ro(new_root, path):
    """`path` of the host at the same place under `new_root`, read-only, nosuid, nodev."""
    target = new_root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(path, target, None, MS_BIND)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(spec):
    """The sandbox's file tree under spec["root"]; then pivot into it and drop the host's."""
    new = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in spec["binds"]:
        bind_ro(new, path)
    os.makedirs(new + "/dev", exist_ok=True)
    for name in DEVICES:
        open(f"{new}/dev/{name}", "a").close()
        mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    uid, work = spec["uid"], spec["work"]
    for place, size in ((work, spec["work_bytes"]), ("/dev/shm", spec["shm_bytes"])):
        os.makedirs(new + place, exist_ok=True)
        mount("tmpfs", new + place, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=700,uid={uid},gid={uid}")
    if not os.path.lexists(new + "/tmp"):  # (a Python installed under /tmp is bound there: then TMPDIR only)
        os.symlink(work, new + "/tmp")
    os.makedirs(new + "/proc")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in HIDDEN:  # global files a new /proc still shows (keys by description, kernel symbols)
        if os.path.exists(new + path):
            mount(new + "/dev/null", new + path, None, MS_BIND)
    with open(new + work + "/snippet.py", "w", encoding="utf-8") as dst:
        dst.write(spec["code"])
    os.chown(new + work + "/snippet.py", uid, uid)
    os.chdir(new)
    os.mkdir(".old")
    _check(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b".old"), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount the host's tree")
    os.rmdir("/.old")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    try:  # no user namespaces below this one (a large part of the kernel's attack surface)
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError:
        pass


def run_snippet(spec):
    """The snippet's process: unprivileged, limited, alone with its three standard files; never returns."""
    uid, lim = spec["uid"], spec["limits"]
    os.chdir(spec["work"])
    try:
        os.setgroups([])
    except OSError:  # refused where the parent had to deny setgroups (a non-root run): already none
        pass
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    for what, value in ((resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                        (resource.RLIMIT_AS, (lim["memory_bytes"],) * 2),
                        (resource.RLIMIT_FSIZE, (lim["file_bytes"],) * 2),
                        (resource.RLIMIT_NPROC, (lim["max_processes"],) * 2),
                        (resource.RLIMIT_NOFILE, (256, 256)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(what, value)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # (stdin was the pipe the spec came on)
    os.closerange(3, 1 << 16)
    install_seccomp(spec["seccomp"])  # last: from here keyctl, mount, unshare, io_uring, ... are refused
    os.execve(spec["python"], [spec["python"], "-I", "-B", spec["work"] + "/snippet.py"], spec["env"])


def init(spec, status_fd):
    """PID 1 of the sandbox's PID namespace: build the root, run the snippet, exit with its status."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # (its parent is outside the namespace: getppid() says 0 here;
    # had the launcher died before this line, the parent's kill of the whole process group still reaches us)
    prctl(PR_SET_DUMPABLE, 0)  # the snippet (same uid in a non-root run) cannot ptrace init
    try:
        _check(libc.sethostname(b"sandbox", 7), "sethostname")
        build_root(spec)
        pid = os.fork()
    except Exception as e:  # noqa: BLE001 - any set-up failure is one line for the parent
        fail(status_fd, f"sandbox set-up failed: {e}")
    if pid == 0:
        try:
            run_snippet(spec)
        except Exception as e:  # noqa: BLE001
            fail(status_fd, f"sandbox could not start the snippet: {e}")
    os.close(status_fd)
    _, status = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main(spec):
    status_fd, go_fd = spec["status_fd"], spec["go_fd"]
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent_pid"]:
        os._exit(FAILED)
    if platform.machine() not in SYS_PIVOT_ROOT:
        fail(status_fd, f"no pivot_root syscall number known for {platform.machine()}")
    try:
        join_fresh_keyring()
    except OSError as e:
        fail(status_fd, f"sandbox set-up failed: {e}")
    flags = (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
             | CLONE_NEWCGROUP)
    if libc.unshare(flags) != 0:
        fail(status_fd, f"unshare: {os.strerror(ctypes.get_errno())}")
    os.write(status_fd, b"R\n")
    if os.read(go_fd, 1) != b"G":  # the parent writes our uid/gid maps, then says go
        os._exit(FAILED)
    os.close(go_fd)
    pid = os.fork()
    if pid == 0:
        init(spec, status_fd)
    os.close(status_fd)
    _, status = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "jail_launcher":  # run by jail.BOOT, which sets SPEC
    main(json.loads(SPEC))  # noqa: F821
