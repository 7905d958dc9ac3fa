"""The python tool's kernel boundary: each snippet in fresh Linux namespaces, as an unprivileged uid, with limits.

`run_jailed(code, limits)` -> `JailResult(returncode, timed_out, stdout, stderr)` runs `code` through
`posttrain.tools.jail_launcher` (see its docstring for what happens inside): new user, PID, mount, network, IPC,
UTS and cgroup namespaces; a fresh session keyring; a root of read-only binds of the system and Python folders,
a private tmpfs `/work` (the only writable place, also `/tmp`), no view of the run's files, processes or
environment; no network, not even loopback; `no_new_privs`; a seccomp filter (`posttrain.tools.seccomp`); an
unprivileged uid (outside the namespace: `nobody` when the run is root, the run's own uid otherwise); rlimits on
CPU, address space, file size, processes and open files, and a cgroup memory, process and CPU limit where this
machine offers cgroups (`posttrain.tools.cgroups`). The launcher's source and its spec (the code included) go to
it on a pipe, never on its command line. When the snippet ends, or its time is up, the namespace's init dies and
the kernel kills every process left in it; the tmpfs goes with the namespace and the host folder holding
stdout/stderr (`posttrain.tools.scratch`, named by its owner so that a worker killed mid-call leaves one that the
next worker's start sweeps away) is removed here.

Time: the launcher must answer within `START_TIMEOUT_S`, the snippet gets `wall_s` after that, and clean-up
takes well under `CLEANUP_S`: a caller's own limit must be at least `wall_s + START_SLACK_S` (what
`SandboxConfig.call_limit_s` gives the tool pool), or it may kill a call before its clean-up runs.

`jail_support()` runs one empty snippet (once per process) and returns None when the boundary works here, or the
reason it does not (user namespaces disabled, no libseccomp, say): callers refuse to run model code then
(`posttrain.tools.python_sandbox`). Costs one extra interpreter start per call (the launcher), a few tens of
milliseconds.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

from posttrain.tools.cgroups import CallGroup
from posttrain.tools.limits import PythonLimits
from posttrain.tools.scratch import owned_tempdir
from posttrain.tools.seccomp import SeccompUnavailable, filter_program

__all__ = ["START_SLACK_S", "JailResult", "jail_support", "run_jailed"]

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail_launcher.py")
#: The launcher's command line: it reads `SOURCE\0SPEC` from stdin (no host path on any command line inside).
BOOT = ("import os\n"
        "d = b''.join(iter(lambda: os.read(0, 1 << 16), b''))\n"
        "c, s = d.split(b'\\0', 1)\n"
        "exec(compile(c, 'jail_launcher', 'exec'), {'__name__': 'jail_launcher', 'SPEC': s.decode()})\n")
INSIDE_UID = 1000  # the snippet's uid inside its user namespace
NOBODY = 65534  # ... and outside it, when the run is root
SYSTEM_FOLDERS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/etc/ld.so.cache",
                  "/etc/alternatives", "/etc/localtime")
SNIPPET_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WORK_NAMES = ("/work", "/sandbox", "/sandbox-work")
START_TIMEOUT_S = 10.0  # for the launcher's first answer (an interpreter start; slow only on a loaded machine)
CLEANUP_S = 2.0  # killing the tree, reading the output, removing the cgroup and the folder: well under this
START_SLACK_S = START_TIMEOUT_S + CLEANUP_S  # a call's most time beyond its wall limit


@dataclass(frozen=True)
class JailResult:
    returncode: int  # the snippet's exit status, or 128 + the signal that ended it
    timed_out: bool
    stdout: bytes
    stderr: bytes


class JailError(RuntimeError):
    """The sandbox could not be set up (not the snippet's fault)."""


@lru_cache(maxsize=1)
def _launcher_source() -> bytes:
    with open(LAUNCHER, "rb") as f:
        return f.read()


def _python_folders() -> list[str]:
    paths = sysconfig.get_paths()
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
               os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    folders |= {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return [os.path.realpath(p) for p in folders]


@lru_cache(maxsize=1)
def _binds() -> tuple[str, ...]:
    """Host paths shown read-only inside, parents first, none under another (a bind shows all below it)."""
    wanted = sorted({p for p in SYSTEM_FOLDERS if os.path.lexists(p)} | set(_python_folders()))
    out: list[str] = []
    for path in wanted:
        if not any(path.startswith(p.rstrip("/") + "/") for p in out if not os.path.islink(p)):
            out.append(path)
    return tuple(out)


@lru_cache(maxsize=1)
def _work_folder() -> str:
    """The writable folder's path inside: `/work`, unless a bound folder lies there (a venv in /work/...)."""
    binds = _binds()
    return next(w for w in WORK_NAMES if not any(b == w or b.startswith(w + "/") for b in binds))


def _maps(pid: int) -> None:
    """The child's uid/gid maps: the snippet's uid 1000 is `nobody` outside when we are root (and uid 0 inside
    is root, for setting up the mounts only), our own uid otherwise (the only map an unprivileged user may write)."""
    if os.geteuid() == 0:
        uid_map, gid_map = f"0 0 1\n{INSIDE_UID} {NOBODY} 1\n", f"0 0 1\n{INSIDE_UID} {NOBODY} 1\n"
    else:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        uid_map, gid_map = f"{INSIDE_UID} {os.geteuid()} 1\n", f"{INSIDE_UID} {os.getegid()} 1\n"
    for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def _read_line(fd: int, timeout_s: float) -> str:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if not ready:
        return "Eno answer from the sandbox launcher"
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _read_cut(path: str, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    return data


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _spec(code: str, limits: PythonLimits, root: str, status_w: int, go_r: int) -> dict:
    work = _work_folder()
    try:
        program = filter_program()
    except SeccompUnavailable as e:
        raise JailError(str(e)) from None
    return {"status_fd": status_w, "go_fd": go_r, "parent_pid": os.getpid(), "root": os.path.join(root, "jail"),
            "binds": list(_binds()), "code": code, "uid": INSIDE_UID, "python": sys.executable, "work": work,
            "env": {**SNIPPET_ENV, "HOME": work, "TMPDIR": work}, "work_bytes": limits.work_bytes,
            "shm_bytes": 16 << 20, "seccomp": program.hex(),
            "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                       "file_bytes": limits.file_bytes, "max_processes": limits.max_processes}}


def _send(proc: subprocess.Popen, spec: dict) -> None:
    """The launcher's source and spec on its stdin (then closed: it reads to the end)."""
    try:
        proc.stdin.write(_launcher_source() + b"\0" + json.dumps(spec).encode())
        proc.stdin.close()
    except OSError as e:  # it died before reading (BrokenPipeError)
        raise JailError(f"the sandbox launcher did not take its spec: {e}") from None


def _start(proc: subprocess.Popen, spec: dict, limits: PythonLimits, status_r: int, go_w: int) -> CallGroup | None:
    """Hand the launcher its spec, wait for its namespaces, write its uid/gid maps, put it in the call's cgroup
    and say go; the call's `CallGroup` (None where cgroups cannot be written)."""
    _send(proc, spec)
    line = _read_line(status_r, START_TIMEOUT_S)
    if line != "R":
        raise JailError(line[1:] if line.startswith("E") else f"unexpected launcher answer {line!r}")
    _maps(proc.pid)
    group = CallGroup.create(limits.memory_bytes, limits.max_processes, limits.cpus)
    if group is not None:
        group.add(proc.pid)
    os.write(go_w, b"G")
    return group


def run_jailed(code: str, limits: PythonLimits, max_output_bytes: int) -> JailResult:
    """Run `code` in the sandbox (see the module docstring); raises `JailError` if the sandbox fails to start."""
    root = owned_tempdir()
    group = None
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        os.mkdir(os.path.join(root, "jail"))
        spec = _spec(code, limits, root, status_w, go_r)
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", BOOT], stdin=subprocess.PIPE,
                                    stdout=out, stderr=err, cwd="/", env={"LANG": "C.UTF-8"},
                                    pass_fds=(status_w, go_r), start_new_session=True)
        os.close(status_w)
        os.close(go_r)
        status_w = go_r = -1
        try:
            group = _start(proc, spec, limits, status_r, go_w)
        except BaseException:
            _kill(proc)
            raise
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
        line = _read_line(status_r, 0.0) if not timed_out else ""
        if line.startswith("E"):
            raise JailError(line[1:])
        return JailResult(proc.returncode, timed_out, _read_cut(out_path, max_output_bytes),
                          _read_cut(err_path, max_output_bytes))
    finally:
        for fd in (status_r, status_w, go_r, go_w):
            if fd >= 0:
                os.close(fd)
        if group is not None:
            group.remove()
        shutil.rmtree(root, ignore_errors=True)


@lru_cache(maxsize=1)
def jail_support() -> str | None:
    """None when the kernel sandbox works on this machine, else why not (one line); checked once per process."""
    if sys.platform != "linux":
        return f"the kernel sandbox needs Linux, this is {sys.platform}"
    limits = PythonLimits(wall_s=20.0, cpu_s=10, memory_mb=1024, file_mb=1, max_processes=16, work_mb=1)
    try:
        result = run_jailed("print('ok')", limits, 4096)
    except (JailError, OSError) as e:
        return str(e)
    if result.returncode != 0 or result.stdout.strip() != b"ok":
        return f"a test snippet failed in the sandbox: {result.stderr.decode(errors='replace').strip()[-300:]}"
    return None
