"""Helpers shared by the fleet tests (`test_fleet.py`, `test_fleet_processes.py`): the toy task and its reward
functions, the environment of the processes they start, and reading a run's ledger and metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DISTINCT_REWARD, write_toy_task


REWARD = '''
import time
from itertools import groupby

def count_a(prompts, completions, **fields):
    """1/8 per letter 'a' among the first 8 characters."""
    return [sum(c == "a" for c in text[:8]) / 8 for text in completions]

def slow_count_a(prompts, completions, **fields):
    """count_a, slowly: generation + scoring outlasts a trainer step, so workers are busy when killed."""
    time.sleep(0.3)
    return count_a(prompts, completions)

def held_count_a(prompts, completions, **fields):
    """count_a, held while a file `hold` exists next to this one (a test pauses the run's progress with it); a
    call that waits leaves `held.PID` there (PID: the process scoring, a fleet worker with in-process rewards)."""
    import os
    from pathlib import Path

    here = Path(__file__).parent
    if (here / "hold").exists():
        (here / f"held.{os.getpid()}").touch()
    while (here / "hold").exists():
        time.sleep(0.05)
    return count_a(prompts, completions)

def hangs(prompts, completions, **fields):
    time.sleep(60)
    return [0.0 for _ in completions]
'''

ENV = {"JAX_PLATFORMS": "cpu", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
       "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _env(**extra) -> dict[str, str]:
    """The environment of the runs these tests start: this process's (with the session's compile cache)."""
    return {**os.environ, **ENV, **extra}


@pytest.fixture
def toy(tmp_path, compile_cache, monkeypatch):
    """The toy task's files and `toy(name, *overrides)` -> its RL arguments. Every process of a test (trainers,
    and the Ray workers that inherit this process's environment) shares the session's compilation cache, so a
    restarted trainer or worker loads its programs instead of compiling them again."""
    for k, v in compile_cache.items():
        monkeypatch.setenv(k, v)
    write_toy_task(tmp_path, REWARD + DISTINCT_REWARD)

    def args(name: str, *overrides: str) -> list[str]:
        return [f"output_dir={tmp_path / name}", "model.path=tiny:llama", f"data.train={tmp_path / 'prompts.jsonl'}",
                "rollout.batch_prompts=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                f"rewards.functions=[{{name: '{tmp_path / 'reward.py'}:count_a'}}]", "rewards.correctness=null",
                "rewards.num_workers=0", "optim.lr=3e-3", "optim.decay=constant", "trainer.log_every=1",
                "trainer.save_every=0", "trainer.progress=false", "eval.at_start=false", "export_hf=false", *overrides]

    args.dir = tmp_path
    return args


def ledger(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "trained.jsonl").read_text().splitlines()]


def metric_rows(out: Path) -> dict[int, dict]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            rows[r["step"]] = r
    return rows


def _start(args: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "rl", *args], env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _ray_pids(title: str, exact: bool = False, sessions=()) -> list[int]:
    """Processes of the runs started in `sessions` (`_start` gives each run its own session, which its Ray
    processes keep: another test run's workers on the machine are never counted, or killed) whose title
    (Ray sets `ray::Class` when idle, `ray::Class.method` while running one) matches."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    name = f.read().split(b"\0")[0].decode(errors="replace").strip()
                with open(f"/proc/{d}/stat") as f:
                    session = int(f.read().rsplit(")", 1)[1].split()[3])
            except (OSError, IndexError, ValueError):
                continue
            if session in sessions and (name == title or (not exact and name.startswith(title))):
                out.append(int(d))
    return out


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, ok: bool = False):
    """`cond()`'s first true value within `timeout` s (else an AssertionError, or None with `ok`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended while waiting for {what}:\n{proc.stdout.read()}")
        time.sleep(0.02)
    if ok:
        return None
    raise AssertionError(f"timed out waiting for {what}")


def _steps_done(out: Path) -> int:
    p = out / "trained.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
