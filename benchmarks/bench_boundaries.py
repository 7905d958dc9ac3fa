"""Benchmark: what the process boundaries cost per call, this tree against another (before/after), interleaved.

Three rates, each through the machinery a rollout uses:
- `python`: calls/s of the built-in python tool (`print(1)`) through a one-worker `ToolPool` (the kernel sandbox);
- `env step`: calls/s of an environment's `step` on one session (a worker process per session since issue 47;
  a thread in the trainer's process before);
- `env session`: sessions/s opened, reset and closed (a fresh instance; since issue 47 a fresh worker process).

Each tree runs in a child process of its own (`PYTHONPATH` set to it), started once and warmed; the rounds alternate
the order (A B, B A, ...), so both see the same machine load, and each figure is the median over rounds.

    git worktree add /tmp/before main   # or any tree of posttrain
    python benchmarks/bench_boundaries.py --against /tmp/before [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r'''
import json, sys, time

ENV = """
class Counter:
    def reset(self, record):
        self.n = 0
        return "go"

    def step(self, text: str):
        self.n += 1
        return str(self.n), 0.0, False
"""


def main():
    from posttrain.agent import load_environment
    from posttrain.tools import ToolCall, ToolPool, load_tools, run_tool_call

    pool = ToolPool(num_workers=1)
    tools = load_tools(["python"])
    with open(sys.argv[1], "w") as f:
        f.write(ENV)
    spec = load_environment(sys.argv[1] + ":Counter")

    def session():
        try:
            return spec.make(30.0, pool)
        except TypeError:  # before issue 47: make(timeout_s) only, sessions in this process
            return spec.make(30.0)

    def close(s):
        getattr(s, "close", lambda: None)()

    def python(n):
        t = time.perf_counter()
        for _ in range(n):
            msg, rec = run_tool_call(tools, ToolCall("python", {"code": "print(1)"}), timeout=60,
                                     max_output_chars=100, pool=pool)
            assert msg["content"] == "1", msg
        return time.perf_counter() - t

    def steps(n):  # the steps alone (the session's start is the third figure)
        s = session()
        s.reset({})
        t = time.perf_counter()
        for _ in range(n):
            assert s.step("x").error is None
        took = time.perf_counter() - t
        close(s)
        return took

    def sessions(n):
        t = time.perf_counter()
        for _ in range(n):
            s = session()
            s.reset({})
            close(s)
        return time.perf_counter() - t

    work = {"python": python, "env step": steps, "env session": sessions}
    for name, fn in work.items():  # warm: fork server, page cache, first imports
        fn(2)
    print("ready", flush=True)
    for line in sys.stdin:
        name, n = line.rsplit(" ", 1)
        print(json.dumps({"rate": int(n) / work[name](int(n))}), flush=True)
    pool.close()


if __name__ == "__main__":
    main()
'''

COUNTS = {"python": 20, "env step": 400, "env session": 20}


def start(tree: str, folder: str) -> subprocess.Popen:
    script = os.path.join(folder, f"child_{abs(hash(tree))}.py")
    with open(script, "w") as f:
        f.write(CHILD)
    proc = subprocess.Popen([sys.executable, script, os.path.join(folder, f"env_{abs(hash(tree))}.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree,
                            env={**os.environ, "PYTHONPATH": tree})
    assert proc.stdout.readline().strip() == "ready", f"the child of {tree} did not start"
    return proc


def measure(proc: subprocess.Popen, name: str) -> float:
    proc.stdin.write(f"{name} {COUNTS[name]}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["rate"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the other source tree (before)")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": os.path.abspath(args.against), "after": here}
    with tempfile.TemporaryDirectory() as folder:
        procs = {k: start(t, folder) for k, t in trees.items()}
        rates = {(k, name): [] for k in trees for name in COUNTS}
        try:
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in COUNTS:
                    for k in order:
                        rates[k, name].append(measure(procs[k], name))
        finally:
            for proc in procs.values():
                proc.stdin.close()
                proc.wait(timeout=60)
    print(f"{args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}")
    for name in COUNTS:
        b, a = statistics.median(rates["before", name]), statistics.median(rates["after", name])
        print(f"  {name:12s} before {b:9.1f}/s  after {a:9.1f}/s  ({1000 / b:7.2f} -> {1000 / a:7.2f} ms a call; "
              f"after/before per round {min(x / y for x, y in zip(rates['after', name], rates['before', name])):.2f}"
              f"-{max(x / y for x, y in zip(rates['after', name], rates['before', name])):.2f})")


if __name__ == "__main__":
    main()
