"""Benchmark: what one call of the built-in `python` tool costs, per sandbox backend, interleaved in one process.

`print(1)` through `run_python` (as a rollout's tool worker calls it): `namespaces` (the kernel sandbox: new
user, PID, mount, network, IPC namespaces, read-only binds, a tmpfs, cgroup limits where writable) against
`process` (a plain process with rlimits and an audit hook: the python tool's only isolation before the kernel
sandbox, and still its opt-in weak mode). Rounds alternate the order; the figure is each backend's median ms
and the per-round ratio namespaces / process.

    python benchmarks/bench_sandbox.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

from posttrain.tools.cgroups import cgroup_support
from posttrain.tools.jail import jail_support
from posttrain.tools.python_sandbox import SandboxConfig, run_python


def one(config: SandboxConfig) -> float:
    t = time.perf_counter()
    out = run_python("print(1)", config=config)
    assert out == "1", out
    return 1000 * (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    why = jail_support()
    if why is not None:
        raise SystemExit(f"the kernel sandbox cannot run here: {why}")
    backends = {"namespaces": SandboxConfig(), "process": SandboxConfig(backend="process")}
    for cfg in backends.values():  # warm: page cache, the first interpreter starts
        one(cfg)
    times: dict[str, list[float]] = {k: [] for k in backends}
    ratios = []
    for r in range(args.rounds):
        order = list(backends) if r % 2 == 0 else list(reversed(backends))
        got = {name: one(backends[name]) for name in order}
        for name, ms in got.items():
            times[name].append(ms)
        ratios.append(got["namespaces"] / got["process"])
    print(f"python tool, print(1), {args.rounds} interleaved rounds (cgroups: {cgroup_support() or 'none'})")
    for name, ts in times.items():
        print(f"  {name:10s} median {statistics.median(ts):6.1f} ms  min {min(ts):6.1f}  max {max(ts):6.1f}")
    print(f"  namespaces / process: median {statistics.median(ratios):.2f}x  "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
