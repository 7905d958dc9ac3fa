"""The weak, opt-in backend of the python tool (`rollout.sandbox.backend: process`): NOT a security boundary.

`run_in_process(code, limits)` -> `(returncode, timed_out, stdout, stderr)` starts `python -I -B` in a fresh
temporary folder with a minimal environment, under RLIMIT_CPU, RLIMIT_AS and RLIMIT_FSIZE and a wall-clock limit
(the process group is killed past it), with a Python audit hook that refuses files outside its folder, processes,
sockets and ctypes. The hook lives inside the snippet's own interpreter, so a snippet can turn it off (by its
globals, `gc`, or `dir_fd` paths): this backend is for machines where the kernel sandbox
(`posttrain.tools.jail`) cannot run and the user has accepted that model-written code runs as the run's user.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig

from posttrain.tools.scratch import owned_tempdir

__all__ = ["run_in_process"]


# Runs as `python -I -B -c BOOTSTRAP LIMITS WORKDIR READ_ROOT...`: sets the limits (hard ones, which the
# snippet cannot raise again) and asks to die with its parent, reads the snippet, then installs the hook.
_BOOTSTRAP = r'''
import os, sys, resource, signal
CPU, MEM, FSIZE = (int(x) for x in sys.argv[1].split(","))
for what, soft, hard in ((resource.RLIMIT_CPU, CPU, CPU + 1), (resource.RLIMIT_AS, MEM, MEM),
                         (resource.RLIMIT_FSIZE, FSIZE, FSIZE), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(what, (soft, hard))
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
    del sys.modules[name]
ctypes = None
if os.getppid() == 1:
    sys.exit("the process that started this one is gone")
WORK = os.path.realpath(sys.argv[2])
READ = tuple(os.path.realpath(p) for p in sys.argv[3:])
with open(os.path.join(WORK, "snippet.py"), encoding="utf-8") as f:
    SOURCE = f.read()
os.remove(os.path.join(WORK, "snippet.py"))
DENY = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
        "subprocess.Popen", "socket.__new__", "socket.connect", "socket.bind", "socket.sendto",
        "socket.getaddrinfo", "socket.gethostbyname", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata",
        "ctypes.cdata/buffer", "ctypes.call_function", "ctypes.string_at", "ctypes.wstring_at", "ctypes.set_errno",
        "os.chroot", "sys._current_frames", "resource.setrlimit", "resource.prlimit"}
NO_IMPORT = {"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "multiprocessing", "pty"}
READ_EVENTS = {"os.listdir", "os.scandir", "glob.glob"}
PATH_EVENTS = {"os.chdir", "os.remove", "os.rename", "os.rmdir", "os.mkdir",
               "os.symlink", "os.link", "os.chmod", "os.chown", "os.truncate", "os.utime",
               "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move",
               "shutil.rmtree", "os.setxattr", "os.removexattr", "os.listxattr", "os.getxattr"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path, roots):
    return any(path == r or path.startswith(r + os.sep) for r in roots)

def resolve(p):
    return os.path.realpath(os.fsdecode(p)) if isinstance(p, (str, bytes, os.PathLike)) else None

def hook(event, args):
    if event in DENY or event.startswith("socket.") or (event == "ctypes.dlopen" and args[0] is not None):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in NO_IMPORT:
        raise ImportError(f"sandbox: import of {args[0]} is not allowed")
    if event == "open":
        path = resolve(args[0])
        if path is None:
            return
        mode, flags = args[1], args[2] or 0
        write = (mode is not None and any(c in mode for c in "wax+")) or bool(flags & WRITE_FLAGS)
        if inside(path, (WORK,)) or (not write and inside(path, READ + ("/dev/null", "/dev/urandom"))):
            return
        raise PermissionError(f"sandbox: opening {os.fsdecode(args[0])!r} is not allowed")
    if event in PATH_EVENTS or event in READ_EVENTS:
        roots = (WORK,) + (READ if event in READ_EVENTS else ())
        for a in args:
            path = resolve(a) if isinstance(a, (str, bytes)) else None
            if path is not None and not inside(path, roots):
                raise PermissionError(f"sandbox: {event} on {os.fsdecode(a)!r} is not allowed")

sys.addaudithook(hook)
del hook
sys.argv = ["snippet.py"]
__name__ = "__main__"
exec(compile(SOURCE, "snippet.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


def _read_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(roots)


def _read_cut(path: str, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(max_bytes + 1)


def run_in_process(code: str, limits, max_output_bytes: int) -> tuple[int, bool, bytes, bytes]:
    """`(returncode, timed_out, stdout, stderr)` of `code` under rlimits and the audit hook (see the docstring)."""
    root = owned_tempdir()
    work = os.path.join(root, "work")
    os.mkdir(work)
    try:
        with open(os.path.join(work, "snippet.py"), "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            numbers = f"{limits.cpu_s},{limits.memory_bytes},{limits.file_bytes}"
            proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOTSTRAP, numbers, work, *_read_roots()],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work, env=env,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        code_ = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return code_, timed_out, _read_cut(out_path, max_output_bytes), _read_cut(err_path, max_output_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
