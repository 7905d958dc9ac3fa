"""Tools: loading by reference with schemas, the built-in calculator and sandboxed python tool, and running
calls in worker processes where a tool that raises, hangs, floods its output or crashes gives an error
message and the caller goes on."""

from __future__ import annotations

import json
import os
import time

import pytest

from posttrain.loading import LoadError
from posttrain.tools import ToolCall, ToolPool, calculator, load_tool, load_tools, run_tool_call
from posttrain.tools.python_sandbox import PythonLimits, run_python

USER_TOOLS = '''
import os, time

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b

def boom(x: str) -> str:
    """Always raises.

    Args:
        x: ignored
    """
    raise RuntimeError("tool exploded: " + x)

def hang(x: str) -> str:
    """Never returns.

    Args:
        x: ignored
    """
    time.sleep(600)

def flood(x: str) -> str:
    """Prints 10 MB, returns 10 MB.

    Args:
        x: ignored
    """
    print("y" * 10_000_000)
    return "z" * 10_000_000

def crash(x: str) -> str:
    """Kills its own process.

    Args:
        x: ignored
    """
    os._exit(3)

def meet(folder: str, n: int) -> str:
    """Waits until n calls have arrived in folder (only possible when calls run concurrently).

    Args:
        folder: a shared folder
        n: how many calls to wait for
    """
    open(os.path.join(folder, str(os.getpid())), "w").close()
    for _ in range(600):
        if len(os.listdir(folder)) >= n:
            return "met"
        time.sleep(0.1)
    return "alone"

def no_hints(x):
    """No type hints.

    Args:
        x: something
    """

def no_args_doc(x: int) -> int:
    """Has no Args section."""
'''


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


@pytest.fixture(scope="module")
def pool():
    p = ToolPool(num_workers=3)
    yield p
    p.close()


@pytest.mark.parametrize("expr, out", [("1+2*3", "7"), ("(12.5 + 3) * 4 ** 2", "248"), ("7/2", "3.5"),
                                       ("-7 // 2", "-4"), ("-3 % 5", "2"), ("2**-1", "0.5"),
                                       ("123*456*789", str(123 * 456 * 789)), ("10**999", str(10**999))])
def test_calculator(expr, out):
    assert calculator(expr) == out


@pytest.mark.parametrize("expr, why", [("1/0", "division by zero"), ("x + 1", "Name"), ("__import__('os')", "Call"),
                                       ("2 ^ 3", "use '**'"), ("2**10000", "digits"), ("9**9**9", "digits"),
                                       ("10**999*10", "digits"), ("1e308*10", "not finite"), ("'a'*3", "Constant"),
                                       ("(-8)**0.5", "not a real"), ("1 +", "cannot parse"), ("1" * 2000, "longer"),
                                       ("(" * 400 + "1" + ")" * 400, "")])
def test_calculator_refuses_with_a_message(expr, why):
    out = calculator(expr)
    assert out.startswith("Error:") and why in out


def test_python_tool_runs_code_in_its_own_folder():
    assert run_python("print(sum(range(10)))\nimport numpy as np\nprint(np.arange(4).sum())") == "45\n6"
    assert run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())") == "hi"
    out = run_python("raise ValueError('bad value')")
    assert out.startswith("Error: the code exited with status 1") and "ValueError: bad value" in out


def test_python_tool_limits():
    limits = PythonLimits(wall_s=3, cpu_s=2, max_output_bytes=1000)
    t = time.monotonic()
    assert "time limit" in run_python("import time\ntime.sleep(60)", limits)
    assert time.monotonic() - t < 30
    assert "CPU time" in run_python("while True: pass", PythonLimits(wall_s=30, cpu_s=1))
    big = run_python("print('x' * 10_000_000)", limits)
    assert big.startswith("Error:") and "output cut" in big and len(big) < 3000
    assert "MemoryError" in run_python("a = bytearray(8 << 30)", limits)


def test_tool_schemas_and_load_errors(tools_file):
    tools = load_tools(["calculator", "posttrain.tools:python", f"{tools_file}:add"])
    assert list(tools) == ["calculator", "python", "add"]
    assert tools["add"].schema["function"]["parameters"]["required"] == ["a", "b"]
    assert tools["calculator"].schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    cases = {f"{tools_file}:no_hints": "type hint", f"{tools_file}:no_args_doc": "no description for the argument",
             f"{tools_file}:missing": "not found", "nonexist.py:fn": "not found", "no_such_module:fn": "cannot import",
             "abacus": "unknown tool"}
    for ref, why in cases.items():
        with pytest.raises(LoadError) as e:
            load_tools(["calculator", ref])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("rollout.tools[1]: ") and why in msg, msg
    with pytest.raises(LoadError, match="already taken"):
        load_tools(["calculator", "posttrain.tools:calculator"])
    with pytest.raises(LoadError, match="^rollout.tools: expected a list"):
        load_tools("calculator")
    assert load_tool("calculator").ref == "calculator"


def test_tool_calls_fail_as_messages_and_the_caller_goes_on(tools_file, pool):
    tools = load_tools(["calculator", "python"] + [f"{tools_file}:{n}" for n in ("add", "boom", "hang", "flood",
                                                                                 "crash")])

    def call(name, timeout=5.0, **args):
        return run_tool_call(tools, ToolCall(name, args, id="c1"), timeout=timeout, max_output_chars=2000, pool=pool)

    msg, rec = call("add", a=2, b=40)
    assert msg == {"role": "tool", "name": "add", "content": "42", "tool_call_id": "c1"} and rec.error is None
    outcomes = {
        "exception": call("boom", x="now"),
        "timeout": call("hang", timeout=2.0, x=""),
        "crash": call("crash", x=""),
        "unknown_tool": call("nope", x=""),
        "bad_arguments": call("add", a=1, c=2),
    }
    for kind, (msg, rec) in outcomes.items():
        assert rec.error == kind and msg["role"] == "tool"
        assert set(json.loads(msg["content"])) == {"error"}, msg
    assert "tool exploded: now" in json.loads(outcomes["exception"][0]["content"])["error"]
    assert "missing: ['b']" in json.loads(outcomes["bad_arguments"][0]["content"])["error"]
    assert outcomes["timeout"][1].seconds == 2.0
    msg, rec = call("flood", x="")
    assert rec.error is None and msg["content"].startswith("z" * 2000) and "output cut: 9998000 more" in msg["content"]
    msg, rec = call("python", timeout=30, code="print(open('/etc/passwd').read())")
    assert rec.error is None and msg["content"].startswith("Error:") and "root:" not in msg["content"]
    assert call("calculator", expression="6*7")[0]["content"] == "42"  # the pool still works after all that


def test_calls_run_concurrently(tools_file, tmp_path):
    tools = load_tools([f"{tools_file}:meet"])
    pool = ToolPool(num_workers=3)
    try:
        futures = [pool.submit(tools, ToolCall("meet", {"folder": str(tmp_path), "n": 3}), timeout=120,
                               max_output_chars=100) for _ in range(3)]
        assert [f.result()[0]["content"] for f in futures] == ["met"] * 3
    finally:
        pool.close()


MARK = "posttrain-killed-worker-marker"


def _marked() -> set[str]:
    """Pids of running processes whose command line carries MARK (a snippet's child)."""
    import os

    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARK.encode() in f.read():
                    out.add(pid)
        except OSError:
            pass
    return out


KILLED_IN_A_SNIPPET = f'''
from posttrain.tools.python_sandbox import run_python

def long_snippet(x: str) -> str:
    """Runs a snippet that outlives this tool's own time limit.

    Args:
        x: ignored
    """
    return run_python("import subprocess, sys, time\\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', '{MARK}'])\\n"
                      "time.sleep(120)")
'''


def test_python_tool_processes_die_with_a_killed_tool_worker(tmp_path, monkeypatch):
    """A tool of the user's that runs the python tool itself, killed by the pool mid-snippet (its own limit is
    shorter than the sandbox's): nothing of the snippet survives, and the host folder it left is swept when the
    next worker starts. (The python tool itself is never killed by the pool: its limit is the sandbox's wall limit
    plus start-up slack, tests/test_sandbox_limits.py.)"""
    from posttrain.tools.jail import jail_support
    from posttrain.tools.scratch import PREFIX

    if jail_support() is not None:
        pytest.skip(f"the kernel sandbox cannot run here: {jail_support()}")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' temporary folder (spawned: read at their start)
    (tmp_path / "killer.py").write_text(KILLED_IN_A_SNIPPET)
    tools = load_tools([f"{tmp_path}/killer.py:long_snippet"])
    pool = ToolPool(num_workers=1, mp_context="spawn")
    try:
        msg, rec = run_tool_call(tools, ToolCall("long_snippet", {"x": ""}), timeout=4.0, max_output_chars=100,
                                 pool=pool)
        assert rec.error == "timeout", msg
        for _ in range(50):
            if not _marked():
                break
            time.sleep(0.1)
        assert not _marked()
        assert [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)]  # left by the killed worker ...
        assert run_tool_call(load_tools(["calculator"]), ToolCall("calculator", {"expression": "1+1"}), timeout=60,
                             max_output_chars=100, pool=pool)[0]["content"] == "2"
        assert not [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)]  # ... swept by the next one
    finally:
        pool.close()
