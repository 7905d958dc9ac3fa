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
    targets = [str(after_attack / "new.txt"), os.path.join(site, "zz_posttrain_attack.pth"),
               os.path.join(os.path.dirname(os.__file__), "zz_posttrain_attack.py"), "/usr/zz_attack", "/etc/zz_attack",
               "/root/zz_attack", os.path.join(tempfile.gettempdir(), "zz_posttrain_attack")]
    code = ("import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        with open(p, 'w') as f: f.write('import os; os.system(\"touch /tmp/pwned\")')\n"
            "        print('wrote', p)\n"
            "    except OSError as e: print('refused', p, type(e).__name__)\n"
            "    try:\n"
            "        fd = os.open(os.path.dirname(p), os.O_RDONLY)\n"
            "        os.close(os.open(os.path.basename(p), os.O_WRONLY | os.O_CREAT, dir_fd=fd)); print('wrote', p)\n"
            "    except OSError as e: print('refused', p, type(e).__name__)\n")
    out = call(pool, tools, code)
    # /tmp inside is the sandbox's own tmpfs: written there, never on the host
    assert out.count("refused") == 2 * (len(targets) - 1) and out.count("wrote") == 2, out
    for p in targets:
        assert not os.path.exists(p), p


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
            if answer is None:
                self.send_response(503)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the time-out case)
            pass

    def _run(self, code: str) -> bytes | None:
        """The answer to `code` (None: a 503), after the time its first line asks for."""
        st = self.state
        with st["lock"]:
            if code.startswith("#flaky") and st["flaky"] > 0:
                st["flaky"] -= 1
                return None
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


def test_reward_worker_exit_is_a_crash_at_once(tmp_path):
    path = tmp_path / "leaving.py"
    path.write_text(EXITING)
    rewards = RewardPool(num_workers=1, mp_context="forkserver", hard_timeout_s=30)
    try:
        t = time.monotonic()
        (status, values, message), = rewards.run([(f"{path}:leave_reward", {}, ["p"], ["c"], {}, 10.0)])
        assert status == "error" and "died" in message and time.monotonic() - t < 5
        (status, values, _), = rewards.run([("exact_answer", {}, ["p"], ["1"], {"answer": ["1"]}, 10.0)])
        assert status == "ok"
    finally:
        rewards.close()
