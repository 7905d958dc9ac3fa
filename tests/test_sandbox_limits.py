"""The python tool sandbox's hardening (issue 47), attacked through `ToolPool` as a rollout calls it: the trainer's
session keyring cannot be read, planted in or cleared; sockets other than AF_UNIX/AF_INET/AF_INET6 cannot be made
(created only, never connected), io_uring and userfaultfd are refused; the launcher's spec is not on any command
line inside; limits that always apply (the pool's limit for the python tool derived from the sandbox's, timed-out
calls leave no folder and no cgroup, leftovers of killed workers swept, a CPU quota where cgroups exist, a note
where they do not); the remote backend reads a bounded answer.

Needs Linux user namespaces and libseccomp (`jail_support()`), else skipped with the reason; what needs writable
cgroups is skipped without them, saying so.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from posttrain.tools import ToolCall, ToolPool, load_tools, run_tool_call
from posttrain.tools import python_sandbox
from posttrain.tools.cgroups import cgroup_controllers, cgroup_support
from posttrain.tools.jail import START_SLACK_S, jail_support
from posttrain.tools.python_sandbox import SandboxConfig, SandboxUnavailable, check_sandbox, run_python
from posttrain.tools.scratch import PREFIX

WHY_NOT = jail_support()
needs_jail = pytest.mark.skipif(WHY_NOT is not None, reason=f"the kernel sandbox cannot run here: {WHY_NOT}")
needs_cgroups = pytest.mark.skipif(cgroup_support() is None, reason="cgroups cannot be written on this machine "
                                   "(a call's memory, process and CPU limits are then per process only)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def host_tmp(tmp_path_factory):
    """This module's workers' temporary folder (so that other test processes' calls are not counted)."""
    return tmp_path_factory.mktemp("sandbox_limits_tmp")


@pytest.fixture(scope="module")
def pool(host_tmp):
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(host_tmp)  # read by the spawned workers when they start
    p = ToolPool(num_workers=1, mp_context="spawn", sandbox=SandboxConfig(wall_s=2.0))
    try:
        yield p
    finally:
        p.close()
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old


def call(pool, code: str) -> str:
    msg, rec = run_tool_call(load_tools(["python"]), ToolCall("python", {"code": code}), timeout=60,
                             max_output_chars=4000, pool=pool)
    assert rec.error is None, msg
    return msg["content"]


# ---------------------------------------------------------------------- the session keyring
KEYRING_ATTACK = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL, ADD_KEY, SESSION = {keyctl}, {add_key}, ctypes.c_long(-3)
buf = ctypes.create_string_buffer(4096)
n = libc.syscall(KEYCTL, 11, SESSION, buf, 4096)  # KEYCTL_READ: the keyring's key ids
print("read", n, os.strerror(ctypes.get_errno()) if n < 0 else buf.raw[:n].hex())
n = libc.syscall(KEYCTL, 11, ctypes.c_long({key}), buf, 4096)  # the trainer's key by its id
print("read key", n, os.strerror(ctypes.get_errno()) if n < 0 else buf.raw[:n])
n = libc.syscall(ADD_KEY, b"user", b"planted", b"evil", 4, SESSION)
print("plant", n, os.strerror(ctypes.get_errno()))
n = libc.syscall(KEYCTL, 7, SESSION)  # KEYCTL_CLEAR
print("clear", n, os.strerror(ctypes.get_errno()))
print("proc keys", repr(open("/proc/keys").read()))
'''

KEYRING_DRIVER = r'''
import ctypes, json, os, sys
from posttrain.tools import ToolCall, ToolPool, load_tools, run_tool_call

def main():
    libc = ctypes.CDLL(None, use_errno=True)
    KEYCTL, ADD_KEY, SESSION = {keyctl}, {add_key}, ctypes.c_long(-3)
    assert libc.syscall(KEYCTL, 1, b"posttrain-test-session") > 0, os.strerror(ctypes.get_errno())  # JOIN
    key = libc.syscall(ADD_KEY, b"user", b"trainer-token", b"SECRET-TOKEN", 12, SESSION)
    assert key > 0, os.strerror(ctypes.get_errno())
    pool = ToolPool(num_workers=1)  # its fork server and workers start now: they inherit this keyring
    try:
        code = sys.stdin.read().replace("{{key}}", str(key))
        msg, rec = run_tool_call(load_tools(["python"]), ToolCall("python", {{"code": code}}), timeout=60,
                                 max_output_chars=8000, pool=pool)
    finally:
        pool.close()
    buf = ctypes.create_string_buffer(4096)
    n = libc.syscall(KEYCTL, 11, SESSION, buf, 4096)
    ids = [int.from_bytes(buf.raw[i:i + 4], "little") for i in range(0, max(n, 0), 4)]
    n = libc.syscall(KEYCTL, 11, ctypes.c_long(key), buf, 4096)
    print(json.dumps({{"tool": msg["content"], "error": rec.error, "key": key, "ids": ids,
                      "payload": buf.raw[:max(n, 0)].decode(errors="replace")}}))

if __name__ == "__main__":
    main()
'''

SYSCALLS = {"x86_64": {"keyctl": 250, "add_key": 248, "io_uring_setup": 425, "userfaultfd": 323},
            "aarch64": {"keyctl": 219, "add_key": 217, "io_uring_setup": 425, "userfaultfd": 282}}


def _numbers() -> dict:
    import platform

    if platform.machine() not in SYSCALLS:
        pytest.skip(f"no system call numbers known here for {platform.machine()}")
    return SYSCALLS[platform.machine()]


def _keyrings_work() -> str | None:
    nr = _numbers()
    probe = subprocess.run([sys.executable, "-c", f"import ctypes; print(ctypes.CDLL(None).syscall({nr['keyctl']}, "
                            "1, None))"], capture_output=True, text=True, check=False)
    return None if probe.stdout.strip().lstrip("-").isdigit() and int(probe.stdout) > 0 else \
        f"this kernel or an outer seccomp filter refuses keyrings ({probe.stdout.strip()} {probe.stderr.strip()})"


@needs_jail
def test_the_trainers_session_keyring_is_out_of_reach(tmp_path):
    """A process with a session keyring holding a token (as under systemd, in a pod, after a RHEL login) runs the
    python tool through its `ToolPool`: the snippet can neither read the keyring or the token, nor plant a key, nor
    clear it, nor see the key's name in /proc/keys; afterwards the keyring holds the token alone."""
    why = _keyrings_work()
    if why:
        pytest.skip(why)
    nr = _numbers()
    driver = tmp_path / "driver.py"
    driver.write_text(KEYRING_DRIVER.format(**nr))
    attack = KEYRING_ATTACK.format(keyctl=nr["keyctl"], add_key=nr["add_key"], key="{key}")
    proc = subprocess.run([sys.executable, str(driver)], input=attack, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    out = got["tool"]
    assert got["error"] is None, out
    assert "read -1 Operation not permitted" in out and "read key -1 Operation not permitted" in out, out
    assert "plant -1 Operation not permitted" in out and "clear -1 Operation not permitted" in out, out
    assert "trainer-token" not in out and "SECRET-TOKEN" not in out and "proc keys ''" in out, out
    assert got["ids"] == [got["key"]] and got["payload"] == "SECRET-TOKEN"  # unchanged, nothing planted


# ---------------------------------------------------------------------- seccomp
@needs_jail
def test_sockets_of_other_families_and_risky_calls_are_refused(pool):
    """AF_VSOCK (a VM's host, whatever the network namespace), AF_NETLINK, AF_PACKET and unknown families cannot
    even be created (nothing is connected anywhere); io_uring and userfaultfd answer EPERM; AF_UNIX, AF_INET and
    AF_INET6 sockets, threads, subprocesses and multiprocessing still work."""
    nr = _numbers()
    code = textwrap.dedent(f"""
        import ctypes, os, socket, subprocess, threading
        for name, family, kind in (("vsock", 40, socket.SOCK_STREAM), ("netlink", 16, socket.SOCK_DGRAM),
                                   ("packet", 17, socket.SOCK_RAW), ("unspec", 0, socket.SOCK_STREAM),
                                   ("bluetooth", 31, socket.SOCK_STREAM), ("beyond", 200, socket.SOCK_STREAM)):
            try:
                socket.socket(family, kind).close(); print("made", name)
            except OSError as e:
                print("refused", name, e.errno)
        try:
            socket.socketpair(40); print("made vsock pair")
        except OSError as e:
            print("refused vsock pair", e.errno)
        for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
            socket.socket(family).close()
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)
        for name, args in (("io_uring_setup", ({nr['io_uring_setup']}, 8, params)),
                           ("userfaultfd", ({nr['userfaultfd']}, 0))):
            r = libc.syscall(*args); print(name, r, ctypes.get_errno())
        t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
        print(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
    """)
    out = call(pool, code).splitlines()
    for name in ("vsock", "netlink", "packet", "unspec", "bluetooth", "beyond", "vsock pair"):
        assert f"refused {name} 1" in out, out  # EPERM
    assert "io_uring_setup -1 1" in out and "userfaultfd -1 1" in out, out
    assert out[-2:] == ["thread", "child"], out


@needs_jail
def test_no_host_path_on_the_sandbox_command_lines(pool, host_tmp):
    """The launcher's spec (the host folder, the worker's pid) comes on a pipe: no command line inside shows it."""
    out = call(pool, "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
                     "        print(p, open(f'/proc/{p}/cmdline', 'rb').read())")
    assert PREFIX not in out and str(host_tmp) not in out and "jail_launcher.py" not in out, out
    assert "snippet.py" in out  # (the snippet itself is there)


def test_without_seccomp_the_sandbox_refuses_in_one_line(monkeypatch):
    """No filter, no sandbox: the support check names the reason, the run refuses in one line saying what to
    install, and a call answers an `Error:` line without running anything."""
    from posttrain.tools import jail
    from posttrain.tools.seccomp import SeccompUnavailable

    def missing():
        raise SeccompUnavailable("seccomp filter: Unable to find libseccomp (install libseccomp2 and the pyseccomp "
                                 "package)")

    monkeypatch.setattr(jail, "filter_program", missing)
    why = jail.jail_support.__wrapped__()  # (uncached: the real check, with the filter missing)
    assert why.startswith("seccomp filter: Unable to find libseccomp"), why
    monkeypatch.setattr(python_sandbox, "jail_support", lambda: why)
    with pytest.raises(SandboxUnavailable) as e:
        check_sandbox(SandboxConfig())
    msg = str(e.value)
    assert "\n" not in msg and "libseccomp" in msg and "apt-get install libseccomp2" in msg, msg
    assert run_python("print(1)").startswith("Error: the sandbox could not run the code: seccomp filter")


# ---------------------------------------------------------------------- limits that always apply
def test_the_pools_limit_for_the_python_tool_is_derived():
    """The python tool's sandbox ends (and cleans up) before the pool would kill its worker."""
    cfg = SandboxConfig(wall_s=3.0)
    pool = ToolPool(num_workers=1, sandbox=cfg)
    [python, calculator] = load_tools(["python", "calculator"]).values()
    assert pool.time_limit(python, 1.0) == cfg.call_limit_s == 3.0 + START_SLACK_S
    assert pool.time_limit(calculator, 1.0) == 1.0
    remote = SandboxConfig(backend="remote", url="http://127.0.0.1:1", wall_s=3.0, request_timeout_s=2.0, retries=2)
    assert remote.call_limit_s > 3 * (3.0 + 2.0)


@needs_jail
def test_timed_out_calls_leave_no_folder_and_no_cgroup(pool, host_tmp):
    """3 snippets past the sandbox's wall limit (2 s here; the tool's own limit given is shorter, 1 s, and does not
    apply to the python tool): each answers a time-limit error, and no host folder or cgroup is left."""
    parents = _cgroup_parents()
    before = {p: _groups(p) for p in parents}
    tools = load_tools(["python"])
    futures = [pool.submit(tools, ToolCall("python", {"code": "while True: pass"}), timeout=1.0,
                           max_output_chars=500) for _ in range(3)]
    for f in futures:
        msg, rec = f.result(timeout=120)
        assert rec.error is None and "ran past the 2s time limit" in msg["content"], msg
    assert [n for n in os.listdir(host_tmp) if n.startswith(PREFIX)] == []
    assert {p: _groups(p) for p in parents} == before


def _cgroup_parents() -> list[str]:
    from posttrain.tools import cgroups

    v2 = cgroups._v2_parent()
    return [v2[0]] if v2 else list((cgroups._v1_parents() or {}).values())


def _groups(parent: str) -> set[str]:
    return {n for n in os.listdir(parent) if n.startswith("posttrain-sandbox-")}


def test_leftovers_of_dead_makers_are_swept(tmp_path, monkeypatch):
    """A folder named after a process that is gone is removed; one of a live process stays."""
    from posttrain.tools.scratch import owner_tag, sweep_stale_folders

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}{dead.pid}-1-abc"
    live = tmp_path / f"{PREFIX}{owner_tag()}-def"
    for folder in (stale, live):
        (folder / "jail").mkdir(parents=True)
        (folder / "stdout").write_bytes(b"x" * 1000)
    assert sweep_stale_folders(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists()


@needs_jail
@needs_cgroups
def test_a_call_gets_a_cpu_quota():
    """While a call runs, its cgroup holds a quarter-core CPU quota (`cpus=0.25`), and its memory and process
    limits; the group is gone after the call."""
    from posttrain.tools import cgroups

    if "cpu" not in cgroup_controllers():
        pytest.skip("the cgroup's cpu controller is not delegated here")
    v2 = cgroups._v2_parent()
    cpu_parent = v2[0] if v2 else cgroups._v1_parents()["cpu"]
    before = _groups(cpu_parent)
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(run_python(
        "import time; time.sleep(3); print('done')", config=SandboxConfig(cpus=0.25, wall_s=20))))
    worker.start()
    seen = {}
    for _ in range(200):
        new = _groups(cpu_parent) - before
        if new:
            folder = os.path.join(cpu_parent, new.pop())
            for name in ("cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us"):
                if os.path.exists(os.path.join(folder, name)):
                    seen[name] = open(os.path.join(folder, name)).read().strip()
            break
        time.sleep(0.05)
    worker.join()
    assert result == ["done"]
    assert seen.get("cpu.max") == "25000 100000" or (seen.get("cpu.cfs_quota_us"), seen.get("cpu.cfs_period_us")) == (
        "25000", "100000"), seen
    assert _groups(cpu_parent) == before


def test_without_cgroups_the_sandbox_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(python_sandbox, "jail_support", lambda: None)
    monkeypatch.setattr(python_sandbox, "cgroup_controllers", lambda: ())
    monkeypatch.setattr(python_sandbox, "_NOTED", set())
    with caplog.at_level(logging.WARNING):
        check_sandbox(SandboxConfig())
        check_sandbox(SandboxConfig())
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "1024 MiB address space x 32 processes = 32 GiB a call" in notes[0], notes
    assert "no CPU quota" in notes[0]


# ---------------------------------------------------------------------- the remote backend's answer
class _Flood(http.server.BaseHTTPRequestHandler):
    """A SandboxFusion stand-in whose answer is 96 MiB of stdout, streamed (chunked, no length) or declared."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        declared = self.path.startswith("/declared")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if declared:
            self.send_header("Content-Length", str(96 << 20))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        head = b'{"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "'
        chunk = b"x" * (1 << 20)
        try:
            for i, part in enumerate([head] + [chunk] * 96):
                self.wfile.write(part if declared else b"%x\r\n%s\r\n" % (len(part), part))
            if not declared:
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as it should
            pass


MEASURE = r'''
import json, resource, sys
from posttrain.tools.python_sandbox import SandboxConfig, run_python

def peak():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024

before = peak()
outs = [run_python("print(1)", config=SandboxConfig(backend="remote", url=url, retries=0))
        for url in sys.argv[1:]]
print(json.dumps({"outs": outs, "grown": peak() - before}))
'''


def test_a_huge_remote_answer_is_an_error_line_and_not_held_in_memory():
    """A service streaming 96 MiB (chunked, and with its length declared): the python tool answers one `Error:`
    line each time, and the process asking grows by less than 48 MiB."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flood)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        proc = subprocess.run([sys.executable, "-c", MEASURE, url, url + "/declared"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO}, check=False)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for out in got["outs"]:
        assert out.startswith("Error: the sandbox could not run the code") and "\n" not in out, out
        assert "more than the" in out and "bytes this client reads" in out, out
    assert got["grown"] < 48 << 20, got["grown"]
