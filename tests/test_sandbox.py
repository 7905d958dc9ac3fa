"""The python tool's sandbox, attacked as a policy under RL would: each snippet is called exactly as a rollout calls
the tool (through `ToolPool`), and the test checks from outside that nothing was read, written, connected, left
running or killed, and that the next call still answers. Also: no silent downgrade where the kernel sandbox cannot
run, the opt-in weak backend's warning, the SandboxFusion-style remote backend against a server on 127.0.0.1, and
a worker that exits mid-call (tools and rewards) reported as a crash at once.

These tests need Linux user namespaces (`posttrain.tools.jail.jail_support()`); where the kernel refuses them the
attack tests are skipped with the kernel's reason.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import pytest

from posttrain.config import ConfigError
from posttrain.rewards.pool import RewardPool
from posttrain.tools import ToolCall, ToolPool, load_tools, run_tool_call
from posttrain.tools import python_sandbox
from posttrain.tools.cgroups import cgroup_support
from posttrain.tools.jail import jail_support
from posttrain.tools.python_sandbox import SandboxConfig, SandboxUnavailable, check_sandbox, run_python

WHY_NOT = jail_support()
needs_jail = pytest.mark.skipif(WHY_NOT is not None, reason=f"the kernel sandbox cannot run here: {WHY_NOT}")
MARK = "posttrain-sandbox-attack-marker"


@pytest.fixture(scope="module")
def host_tmp(tmp_path_factory):
    """The temporary folder of this module's tool workers (where the sandbox keeps a call's output files): its
    own, so that calls of other test processes running at the same time are not counted as left behind."""
    return tmp_path_factory.mktemp("sandbox_host_tmp")


@pytest.fixture(scope="module")
def pool(host_tmp):
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(host_tmp)  # read by the spawned workers when they start (lazily, on first call)
    p = ToolPool(num_workers=2, mp_context="spawn")
    try:
        yield p
    finally:
        p.close()
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old


@pytest.fixture(scope="module")
def tools():
    return load_tools(["python"])


def call(pool, tools, code: str, timeout: float = 60.0) -> str:
    msg, rec = run_tool_call(tools, ToolCall("python", {"code": code}), timeout=timeout, max_output_chars=4000,
                             pool=pool)
    assert rec.error is None, msg  # the sandbox's problems come back as the tool's text, never as a tool failure
    return msg["content"]


def marked_processes() -> list[str]:
    """Host pids whose command line carries the attack marker (processes a snippet tried to leave behind)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARK.encode() in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def tool_folders(folder) -> set[str]:
    return {n for n in os.listdir(folder) if n.startswith("posttrain-python-tool-")}


@pytest.fixture
def trainer_files(tmp_path, monkeypatch):
    """A stand-in for the run's folder (checkpoint, config) and a secret in the trainer's environment."""
    (tmp_path / "checkpoint.txt").write_text("SECRET-WEIGHTS")
    monkeypatch.setenv("POSTTRAIN_TEST_TOKEN", "SECRET-ENV")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def after_attack(pool, tools, trainer_files, host_tmp):
    """Checks, after the attack, that the run's files are as they were and nothing was left running."""
    before = tool_folders(host_tmp)
    yield trainer_files
    assert sorted(p.name for p in trainer_files.iterdir()) == ["checkpoint.txt"]
    assert (trainer_files / "checkpoint.txt").read_text() == "SECRET-WEIGHTS"
    for _ in range(50):
        if not marked_processes():
            break
        time.sleep(0.1)
    assert marked_processes() == []
    assert tool_folders(host_tmp) - before == set()
    assert call(pool, tools, "print(6 * 7)") == "42"  # the next call answers


READS = {
    "audit hook tables cleared through __main__": (
        "import __main__\n"
        "for name in ('DENY', 'NO_IMPORT', 'READ_EVENTS', 'PATH_EVENTS'):\n"
        "    v = vars(__main__).get(name)\n"
        "    if hasattr(v, 'clear'): v.clear()\n"
        "__main__.inside = lambda path, roots: True\n"
        "print(open({secret!r}).read())"),
    "audit hook replaced through gc": (
        "import gc\n"
        "for f in gc.get_objects():\n"
        "    if getattr(f, '__name__', '') == 'hook' and hasattr(f, '__code__'):\n"
        "        f.__code__ = (lambda event, args: None).__code__\n"
        "print(open({secret!r}).read())"),
    "dir_fd relative open": (
        "import os\n"
        "fd = os.open('/', os.O_RDONLY)\n"
        "print(os.read(os.open({secret!r}.lstrip('/'), os.O_RDONLY, dir_fd=fd), 100))"),
    "parent's cwd, environ and memory through /proc": (
        "import os\n"
        "for pid in [{trainer}, os.getppid(), 1] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    for what in ('cwd/checkpoint.txt', 'environ', 'root{secret}'):\n"
        "        try: print(open(f'/proc/{{pid}}/{{what}}', 'rb').read())\n"
        "        except OSError as e: print(pid, what, type(e).__name__)\n"
        "    try:\n"
        "        with open(f'/proc/{{pid}}/mem', 'rb') as m: print(m.read(64))\n"
        "    except OSError as e: print('mem', type(e).__name__)"),
    "shell and subprocess": (
        "import os, subprocess\n"
        "os.system('cat {secret} /proc/{trainer}/environ')\n"
        "print(subprocess.run(['cat', {secret!r}], capture_output=True))"),
    "listing the run's folder": "import os; print(os.listdir({folder!r})); print(os.listdir('/'))",
}


@needs_jail
@pytest.mark.parametrize("name", list(READS))
def test_nothing_outside_can_be_read(name, pool, tools, after_attack):
    secret = after_attack / "checkpoint.txt"
    out = call(pool, tools, READS[name].format(secret=str(secret), folder=str(after_attack), trainer=os.getpid()))
    assert "SECRET-WEIGHTS" not in out and "SECRET-ENV" not in out and "['checkpoint.txt']" not in out, out


def test_attack_sees_no_trainer_environment(pool, tools, trainer_files):
    if WHY_NOT is not None:
        pytest.skip(f"the kernel sandbox cannot run here: {WHY_NOT}")
    out = call(pool, tools, "import os; print(dict(os.environ)); print(open('/proc/self/environ').read())")
    assert "SECRET-ENV" not in out and "POSTTRAIN_TEST_TOKEN" not in out


@needs_jail
def test_nothing_outside_can_be_written(pool, tools, after_attack):
    site = sysconfig.get_paths()["purelib"]
    outside = [str(after_attack / "new.txt"), os.path.join(site, "zz_posttrain_attack.pth"),
               os.path.join(os.path.dirname(os.__file__), "zz_posttrain_attack.py"), "/usr/zz_attack", "/etc/zz_attack",
               "/root/zz_attack"]
    tmp = os.path.join(tempfile.gettempdir(), "zz_posttrain_attack")
    code = ("import json, os\n"
            "def attempt(p):\n"
            "    out = []\n"
            "    try:\n"
            "        with open(p, 'w') as f: f.write('import os; os.system(\"touch /tmp/pwned\")')\n"
            "        out.append('wrote')\n"
            "    except OSError: out.append('refused')\n"
            "    try:\n"
            "        fd = os.open(os.path.dirname(p) or '.', os.O_RDONLY)\n"
            "        os.close(os.open(os.path.basename(p) + '2', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n"
            "        out.append('wrote')\n"
            "    except OSError: out.append('refused')\n"
            "    return out\n"
            f"print(json.dumps({{p: attempt(p) for p in {outside + [tmp, 'zz_own_folder']!r}}}))\n")
    out = json.loads(call(pool, tools, code))
    assert out.pop("zz_own_folder") == ["wrote", "wrote"], out  # the snippet's own folder: the attempts can succeed
    # /tmp inside is the sandbox's own tmpfs, or (a virtual environment under /tmp is bound there) read-only: never
    # the host's
    assert out.pop(tmp) in (["wrote", "wrote"], ["refused", "refused"]), out
    assert out == {p: ["refused", "refused"] for p in outside}, out
    for p in outside + [tmp]:
        assert not os.path.exists(p) and not os.path.exists(p + "2"), p


@needs_jail
def test_no_connection_even_to_loopback(pool, tools, after_attack):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = ("import socket\n"
            f"for host in ('127.0.0.1', 'localhost', '::1'):\n"
            "    try:\n"
            f"        socket.create_connection((host, {port}), timeout=2).sendall(b'hi'); print('connected')\n"
            "    except OSError as e: print('refused', type(e).__name__)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try: s.connect('\\0posttrain-abstract'); print('connected')\n"
            "except OSError as e: print('refused', type(e).__name__)\n")
    try:
        out = call(pool, tools, code)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert "connected" not in out and out.count("refused") == 4, out


@needs_jail
def test_processes_outside_cannot_be_signalled(pool, tools, after_attack):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        code = ("import os, signal\n"
                f"for pid in ({os.getpid()}, {victim.pid}, os.getppid()):\n"
                "    try: signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL); print('killed', pid)\n"
                "    except OSError as e: print('pidfd refused', pid, type(e).__name__)\n"
                "    try: os.kill(pid, signal.SIGKILL); print('killed', pid)\n"
                "    except OSError as e: print('kill refused', pid, type(e).__name__)\n"
                "try: os.kill(-1, signal.SIGKILL)\n"
                "except OSError as e: print('kill -1 refused')\n")
        out = call(pool, tools, code)
        assert victim.poll() is None
        assert f"killed {os.getpid()}" not in out and f"killed {victim.pid}" not in out, out
    finally:
        victim.kill()
        victim.wait()


@needs_jail
def test_no_process_outlives_its_call(pool, tools, after_attack):
    code = ("import os, subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{MARK}'], start_new_session=True)\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)', '{MARK}'])\n"
            "    os._exit(0)\n"
            "print('started')\n")
    assert call(pool, tools, code) == "started"
    # after_attack checks that no marked process is left


@needs_jail
def test_fork_bomb(pool, tools, after_attack):
    t = time.monotonic()
    out = call(pool, tools, f"import os\n# {MARK}\nwhile True:\n    os.fork()", timeout=60)
    assert time.monotonic() - t < 30
    assert out.startswith("Error:"), out


@needs_jail
def test_memory_bomb(pool, tools, after_attack):
    one = call(pool, tools, "a = bytearray(8 << 30)")
    assert "MemoryError" in one
    # several processes, each under its own address-space limit, together past the call's limit (a cgroup, where
    # the machine has one, stops them; a 1 GiB limit and 6 x 600 MB stays harmless on a machine without)
    code = ("import os\n"
            "pids = []\n"
            "for _ in range(6):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        b = bytearray(600 << 20)\n"
            "        for i in range(0, len(b), 4096): b[i] = 1\n"
            "        os._exit(0)\n"
            "    pids.append(pid)\n"
            "print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])\n")
    out = call(pool, tools, code)
    statuses = json.loads(out)  # answered; the trainer is alive (this test runs in it)
    if cgroup_support() is not None:  # the call's memory limit held for its processes together
        assert -9 in statuses, statuses  # (without it each 600 MB process fits its own 1 GiB)


@needs_jail
def test_disk_fill(pool, tools, after_attack):
    free = shutil.disk_usage(tempfile.gettempdir()).free
    code = ("import os\n"
            "n = 0\n"
            "try:\n"
            "    for i in range(100000):\n"
            "        with open(f'/work/f{i}', 'wb') as f: f.write(b'x' * 900_000)\n"
            "        n += 1\n"
            "except OSError as e: print('stopped', type(e).__name__)\n"
            "for d in ('/dev/shm', '/tmp', '/'):\n"
            "    try:\n"
            "        with open(d + '/big', 'wb') as f: f.write(b'x' * (64 << 20))\n"
            "    except OSError as e: print('refused', d, type(e).__name__)\n"
            "print('files', n)\n")
    out = call(pool, tools, code)
    assert "stopped" in out and out.count("refused") == 3, out
    assert int(out.rsplit("files", 1)[1]) <= 80  # /work holds 64 MB
    assert shutil.disk_usage(tempfile.gettempdir()).free > free - (32 << 20)


@needs_jail
def test_privileges_inside(pool, tools, after_attack):
    code = ("import os, ctypes\n"
            "status = open('/proc/self/status').read()\n"
            "print([l for l in status.splitlines() if l.split(':')[0] in ('Uid', 'NoNewPrivs', 'CapEff', 'CapPrm')])\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('unshare', libc.unshare(0x10000000), 'mount', libc.mount(b'none', b'/work', b'tmpfs', 0, None))\n"
            "print('umount', libc.umount2(b'/usr', 2), 'remount', libc.mount(None, b'/usr', None, 32 | 4096, None))\n")
    out = call(pool, tools, code)
    assert "'Uid:\\t1000\\t1000\\t1000\\t1000'" in out and "'NoNewPrivs:\\t1'" in out, out
    assert "'CapEff:\\t0000000000000000'" in out and "'CapPrm:\\t0000000000000000'" in out, out
    assert "unshare -1 mount -1" in out and "umount -1 remount -1" in out, out


@needs_jail
def test_ordinary_code_still_works(pool, tools):
    code = ("import numpy as np, subprocess, tempfile, os\n"
            "open('a.txt', 'w').write('hi'); print(open('a.txt').read())\n"
            "print(int(np.arange(10).sum()))\n"
            "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
            "with tempfile.NamedTemporaryFile() as f: print(f.name.startswith('/work'))\n")
    assert call(pool, tools, code) == "hi\n45\nchild\nTrue"


# ---------------------------------------------------------------------- the boundary's settings, seen from inside
@needs_jail
def test_system_and_python_folders_are_read_only_mounts(pool, tools):
    """Read-only by the mount (statvfs's ST_RDONLY), not only by permissions: the snippet's uid could not write
    a root run's /usr anyway, which would hide a bind left writable (and a non-root run's own venv is its uid's)."""
    paths = sysconfig.get_paths()
    python = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, paths["stdlib"], paths["purelib"],
                                            paths["platlib"], os.path.dirname(os.path.realpath(sys.executable)))}
    bound = sorted(python | {"/", "/usr", "/usr/bin", "/etc"})
    code = ("import json, os\n"
            "flag = lambda p: bool(os.statvfs(p).f_flag & os.ST_RDONLY)\n"
            f"print(json.dumps([{{p: flag(p) for p in {bound!r}}}, [flag(os.getcwd()), flag('/dev/shm')]]))\n")
    read_only, writable = json.loads(call(pool, tools, code))
    assert read_only == {p: True for p in bound}, read_only
    assert writable == [False, False]  # its own folder and /dev/shm: the check tells them apart


LIMIT = 8  # max_processes of the process-limit tests (the default is 32)


def _fork_code(n: int) -> str:
    """A snippet that tries to have `n` processes at once (itself and n - 1 children waiting on a pipe) and prints
    [the processes it had, the error name of the refused fork or None]."""
    return ("import errno, json, os\n"
            "r, w = os.pipe()\n"
            "children, refused = 0, None\n"
            f"while children < {n - 1}:\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError as e:\n"
            "        refused = errno.errorcode.get(e.errno, str(e.errno))\n"
            "        break\n"
            "    if pid == 0:\n"
            "        os.close(w)\n"
            "        os.read(r, 1)\n"
            "        os._exit(0)\n"
            "    children += 1\n"
            "os.close(w)\n"
            "for _ in range(children):\n"
            "    os.wait()\n"
            "print(json.dumps([children + 1, refused]))\n")


def _check_process_limit(out: str) -> None:
    """One process more than `LIMIT` was refused, and the snippet got the configured number: LIMIT, or up to 2
    fewer where the sandbox's launcher and init count too (in the call's cgroup; under a non-root run's uid)."""
    assert not out.startswith("Error"), out  # (the sandbox did not start, say)
    processes, refused = json.loads(out)
    assert refused == "EAGAIN" and LIMIT - 2 <= processes <= LIMIT, out


@needs_jail
def test_process_limit_is_the_configured_one(tools, host_tmp):
    """`rollout.sandbox.max_processes` as a rollout's tool workers get it (cgroups too, where this machine has them)."""
    limited = ToolPool(num_workers=1, mp_context="spawn", sandbox=SandboxConfig(max_processes=LIMIT))
    try:
        out = call(limited, tools, _fork_code(LIMIT + 1))
    finally:
        limited.close()
        python_sandbox.use_sandbox(SandboxConfig())  # (a pool sets its sandbox in this process too)
    _check_process_limit(out)


@needs_jail
def test_process_limit_holds_without_cgroups(monkeypatch, tmp_path):
    """Where no cgroup can be written (a default container, a non-root run without delegation) the rlimit alone
    holds the configured number: forced here by a cgroup tree with nothing in it."""
    from posttrain.tools import cgroups

    monkeypatch.setattr(cgroups, "ROOT", str(tmp_path))
    assert cgroup_support() is None
    _check_process_limit(run_python(_fork_code(LIMIT + 1), config=SandboxConfig(max_processes=LIMIT)))


NOBODY = 65534

# Runs as root: a private mount namespace where the interpreter's folders are reachable for `nobody` (a root-only
# folder above them, such as /root holding pyenv, is covered by a tmpfs that shows only them), then drops to nobody
# (no groups, no capabilities) and calls the python tool once as a tool worker does (the run's sandbox setting, then
# the tool). Run as a non-root user: the same call without the first part. Prints {"uid", "content"} or
# {"skip": why}.
AS_NOBODY = r'''
import ctypes, json, os, sys, sysconfig, tempfile

code, limit, nobody = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)


def mount(src, target, fstype, flags, data=None):
    enc = lambda x: None if x is None else os.fsencode(x)
    if libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def closed_above(path):
    parts = path.split(os.sep)
    return next((f for f in (os.sep.join(parts[:i]) for i in range(2, len(parts))) if not os.stat(f).st_mode & 1),
                None)


def reachable_for_nobody(paths):
    paths = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})
    tops = [p for p in paths if not any(p.startswith(q + "/") for q in paths)]
    covers = {}
    for p in tops:
        if closed_above(p):
            covers.setdefault(closed_above(p), []).append(p)
    if not covers:
        return
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        print(json.dumps({"skip": f"no mount namespace for the test: {os.strerror(ctypes.get_errno())}"}))
        sys.exit(0)
    mount(None, "/", None, 16384 | (1 << 18))  # MS_REC | MS_PRIVATE: nothing below reaches the host
    stage = tempfile.mkdtemp()
    for n, (closed, inner) in enumerate(covers.items()):
        staged = [(os.path.join(stage, f"{n}-{k}"), p) for k, p in enumerate(inner)]
        for s, p in staged:
            os.mkdir(s)
            mount(p, s, None, 4096 | 16384)  # MS_BIND | MS_REC
        mount("tmpfs", closed, "tmpfs", 0, "mode=755")
        for s, p in staged:
            os.makedirs(p)
            mount(s, p, None, 4096 | 16384)


if os.geteuid() == 0:
    reachable_for_nobody([sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values(),
                          os.path.dirname(os.path.realpath(sys.executable)), *sys.path])
    os.setgroups([])
    os.setresgid(nobody, nobody, nobody)
    os.setresuid(nobody, nobody, nobody)

from posttrain.tools.python_sandbox import SandboxConfig, python, use_sandbox

use_sandbox(SandboxConfig(max_processes=limit))  # what a tool worker does with the run's setting
print(json.dumps({"uid": os.geteuid(), "content": python(code)}))
'''


@needs_jail
def test_sandbox_starts_for_an_unprivileged_user():
    """The tool as a non-root run gets it (these tests run as root, whose sandbox skips the steps an unprivileged
    user namespace needs: `setgroups` denied before the gid map, only its own uid mapped): a call answers, and
    the process limit holds there too (an unprivileged run has no cgroup of its own to write)."""
    home = tempfile.mkdtemp(prefix="posttrain-unprivileged-", dir="/tmp")  # where nobody may write
    try:
        if os.geteuid() == 0:
            os.chown(home, NOBODY, NOBODY)
        proc = subprocess.run([sys.executable, "-c", AS_NOBODY, _fork_code(LIMIT + 1), str(LIMIT), str(NOBODY)],
                              env={**os.environ, "HOME": home, "TMPDIR": home}, capture_output=True, text=True,
                              timeout=120, check=False)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["uid"] != 0, result
    _check_process_limit(result["content"])


# ---------------------------------------------------------------------- no silent downgrade
def test_unavailable_namespaces_refuse_to_start(monkeypatch, caplog):
    monkeypatch.setattr(python_sandbox, "jail_support", lambda: "unshare: Operation not permitted")
    with pytest.raises(SandboxUnavailable) as e:
        check_sandbox(SandboxConfig())
    assert "\n" not in str(e.value) and "user namespaces" in str(e.value) and "backend=process" in str(e.value)
    assert run_python("print(1)").startswith("Error: the sandbox could not run the code")

    from posttrain.agent.setup import load_agent_parts
    from posttrain.rl.config import RolloutConfig

    with pytest.raises(ConfigError, match="rollout.sandbox.backend"):
        load_agent_parts(RolloutConfig(tools=["python"]))
    load_agent_parts(RolloutConfig(tools=["calculator"]))  # no python tool: nothing to refuse

    with caplog.at_level(logging.WARNING):
        check_sandbox(SandboxConfig(backend="process"))
    assert "not a sandbox" in caplog.text
    assert run_python("print(1)", config=SandboxConfig(backend="process")) == "1"


def test_sandbox_config_errors():
    with pytest.raises(ValueError, match="rollout.sandbox.url is required"):
        SandboxConfig(backend="remote")
    with pytest.raises(ValueError, match="rollout.sandbox.cpu_s"):
        SandboxConfig(cpu_s=0)


# ---------------------------------------------------------------------- remote backend
class _Fusion(http.server.BaseHTTPRequestHandler):
    """A SandboxFusion stand-in: answers /run_code from a script keyed by the code's first line."""
    state: dict = {}

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        st = self.state
        with st["lock"]:
            st["requests"].append(body)
            st["active"] += 1
            st["max_active"] = max(st["max_active"], st["active"])
        try:
            answer = self._run(body["code"])
        finally:  # no longer running before the client can see the answer (and send its next request)
            with st["lock"]:
                st["active"] -= 1
        try:
            if isinstance(answer, int):
                self.send_response(answer)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the time-out case)
            pass

    def _run(self, code: str) -> bytes | int:
        """The answer to `code` (an int: that HTTP error status), after the time its first line asks for."""
        st = self.state
        with st["lock"]:
            if code.startswith("#flaky") and st["flaky"] > 0:
                st["flaky"] -= 1
                return 503
        if code.startswith("#status "):  # "#status 400": always that answer
            return int(code.split()[1])
        if code.startswith("#slow"):
            time.sleep(0.3)
        if code.startswith("#hang"):
            time.sleep(1.5)
        run = {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "ran\n", "stderr": ""}
        if code.startswith("#fail"):
            run.update(return_code=1, stderr="Traceback: ValueError")
        if code.startswith("#timeout"):
            run.update(status="TimeLimitExceeded", return_code=None)
        return json.dumps({"status": "Success", "message": "", "compile_result": None, "run_result": run,
                           "files": {}}).encode()


@pytest.fixture
def fusion():
    _Fusion.state = {"lock": threading.Lock(), "requests": [], "active": 0, "max_active": 0, "flaky": 2}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fusion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Fusion.state
    server.shutdown()
    server.server_close()


def test_remote_backend(fusion):
    url, state = fusion
    cfg = SandboxConfig(backend="remote", url=url, request_timeout_s=0.5, retries=2, max_concurrency=2, wall_s=0.5)
    assert run_python("print(1)", config=cfg) == "ran"
    assert state["requests"][0] == {"code": "print(1)", "language": "python", "run_timeout": 0.5,
                                    "memory_limit_MB": 1024}
    assert run_python("#fail", config=cfg).startswith("Error: the code exited with status 1")
    assert "time limit" in run_python("#timeout", config=cfg)
    assert run_python("#flaky", config=cfg) == "ran"  # two 503s, then an answer: retried
    out = run_python("#hang", config=cfg)  # past wall_s + request_timeout_s, every attempt
    assert out.startswith("Error: the sandbox could not run the code") and "3 attempt(s)" in out
    threads = [threading.Thread(target=run_python, args=("#slow",), kwargs={"config": cfg}) for _ in range(6)]
    while state["active"]:  # the abandoned #hang requests finish on the server
        time.sleep(0.05)
    state["max_active"] = 0
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["max_active"] == 2


def test_remote_backend_retries_server_errors_only(fusion):
    """A 4xx answer (the request is wrong) is not sent again: one request; a 5xx is retried `retries` times."""
    url, state = fusion
    for status, retries in ((400, 2), (422, 1), (500, 1), (503, 0)):
        state["requests"].clear()
        out = run_python(f"#status {status}", config=SandboxConfig(backend="remote", url=url, retries=retries))
        assert out.startswith("Error: the sandbox could not run the code") and f"HTTP {status}" in out, out
        assert len(state["requests"]) == (1 if status < 500 else retries + 1), (status, retries)


def test_remote_backend_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = SandboxConfig(backend="remote", url=f"http://127.0.0.1:{port}", retries=1, request_timeout_s=1.0)
    out = run_python("print(1)", config=cfg)
    assert out.startswith("Error: the sandbox could not run the code") and "2 attempt(s)" in out


# ---------------------------------------------------------------------- workers that exit mid-call
EXITING = '''
import os

def leave(status: int) -> str:
    """Exit the process.

    Args:
        status: the exit status
    """
    os._exit(status)


def leave_reward(prompts, completions, **kw):
    os._exit(0)
'''


@pytest.mark.parametrize("status", [0, 3])
def test_tool_worker_exit_is_a_crash_at_once(status, tmp_path, pool):
    path = tmp_path / "leaving.py"
    path.write_text(EXITING)
    tools = load_tools([f"{path}:leave", "calculator"])
    t = time.monotonic()
    msg, rec = run_tool_call(tools, ToolCall("leave", {"status": status}), timeout=30, max_output_chars=200, pool=pool)
    assert rec.error == "crash" and f"exit code {status}" in msg["content"]
    assert time.monotonic() - t < 5
    assert run_tool_call(tools, ToolCall("calculator", {"expression": "6*7"}), timeout=30, max_output_chars=20,
                         pool=pool)[0]["content"] == "42"


@pytest.mark.slow
def test_reward_worker_exit_is_a_crash_at_once(tmp_path):
    path = tmp_path / "leaving.py"
    path.write_text(EXITING)
    rewards = RewardPool(num_workers=1, mp_context="forkserver", hard_timeout_s=30)
    try:
        t = time.monotonic()
        (status, values, message, _), = rewards.run([(f"{path}:leave_reward", {}, ["p"], ["c"], {}, 10.0)])
        assert status == "error" and "died" in message and time.monotonic() - t < 5
        (status, values, _, _), = rewards.run([("exact_answer", {}, ["p"], ["1"], {"answer": ["1"]}, 10.0)])
        assert status == "ok"
    finally:
        rewards.close()
