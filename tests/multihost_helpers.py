"""Helpers of the multi-host tests (tests/test_multihost*.py): N processes x M CPU devices (JAX's CPU collectives
over loopback) stand in for N hosts, started as a user starts them (one command per host, with POSTTRAIN_*
variables). Every process runs in its own process group with a time limit; `Procs.kill` ends all of them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int, **extra) -> dict[str, str]:
    """The environment of one process with `devices` CPU devices (and `extra` variables), no POSTTRAIN_* of ours."""
    out = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), POSTTRAIN_COMPILE_CACHE="0")
    for k in ("POSTTRAIN_COORDINATOR", "POSTTRAIN_NUM_PROCESSES", "POSTTRAIN_PROCESS_ID"):
        out.pop(k, None)
    out.update({k: str(v) for k, v in extra.items()})
    return out


class Procs:
    """Processes started in their own process groups; `kill()` ends every group (tests call it in `finally`)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        f = open(log, "w")
        p = subprocess.Popen(args, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        p.log = log  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def wait(self, procs, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"a process did not finish within {timeout:.0f}s:\n{self.logs()}")
        return codes

    def logs(self) -> str:
        out = []
        for p in self.procs:
            text = Path(p.log).read_text(errors="replace")
            text = "\n".join(x for x in text.splitlines() if not x.startswith(("[Gloo]", "WARNING")))
            out.append(f"--- {p.log} (rc={p.returncode})\n{text[-3000:]}")
        return "\n".join(out)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.kill()


def posttrain(command: str, *overrides: str) -> list[str]:
    """The `posttrain COMMAND ...` command line (this interpreter)."""
    return [sys.executable, "-m", "posttrain.cli.main", command, *overrides]


def hosts(procs: Procs, args: list[str], n: int, devices: int, folder: Path, tag: str, **extra) -> list:
    """Starts the command `n` times, as `n` hosts would (same command, POSTTRAIN_* variables per host)."""
    port = free_port()
    return [procs.start(args, env(devices, POSTTRAIN_COORDINATOR=f"127.0.0.1:{port}", POSTTRAIN_NUM_PROCESSES=n,
                                  POSTTRAIN_PROCESS_ID=i, **extra), folder / f"{tag}-{i}.log") for i in range(n)]


def rows(folder: Path, key: str) -> dict[int, float]:
    """step -> `key` of the rows of FOLDER/metrics.jsonl that have it."""
    return {r["step"]: r[key] for r in map(json.loads, open(folder / "metrics.jsonl")) if key in r}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny:llama checkpoint, built once here so that concurrent processes do not race to build it."""
    from posttrain.models.tiny import resolve_model_path

    return resolve_model_path("tiny:llama", cache_dir=tmp_path_factory.mktemp("tiny"))
