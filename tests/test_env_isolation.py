"""Environments out of the trainer's process (issue 47): an environment whose method holds the interpreter lock in
one C call, or ends its process, is stopped at its limit or noticed at once, in its own worker, and becomes one line
naming the class, the method and the record; the trainer stays responsive (SIGTERM included); each trajectory's
instance keeps its state between calls and shares none with another; no worker outlives its trajectory.

Rollouts run under the scripted sampler of `test_agent_rollout`; the `posttrain rl` runs (the acceptance tests:
limit + 30 s with one `error:` line, SIGTERM within 30 s, `os._exit(3)` not silent) are marked slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_agent_rollout import REPO, call, run

from posttrain.agent import AgentLimits, EnvCallError, load_environment
from posttrain.tools import ToolPool

ENVS = '''
import os, time

MARK = os.environ.get("POSTTRAIN_TEST_MARK")


def _started():
    if MARK:
        open(MARK, "w").close()


class GilReset:
    """Holds the interpreter lock in one C call (a Python thread could not be stopped, nor could the trainer
    answer a signal while it ran in the trainer's process)."""

    def reset(self, record):
        _started()
        sum(range(10**13))
        return "never"


class GilStep:
    def reset(self, record):
        return "play"

    def step(self, text: str):
        if record_hangs(text):
            sum(range(10**13))
        return None, 1.0, True


def record_hangs(text):
    return "hang" in text


class Exiting:
    def reset(self, record):
        return "play"

    def step(self, text: str):
        os._exit(3)


class Counter:
    """State between calls: step n answers n; a tool adds to the same count; the reward reads it."""

    def reset(self, record):
        self.n, self.steps = int(record.get("start", 0)), 0
        return "count"

    def step(self, text: str):
        self.n += 1
        self.steps += 1
        return str(self.n), 1.0, self.steps >= 3

    def reward(self, turn_rewards) -> float:
        return float(self.n) + 100 * len(turn_rewards)


class CountingTools:
    def reset(self, record):
        self.n = 0
        return "add"

    def add(self, k: int) -> str:
        """Add k to the count.

        Args:
            k: how much
        """
        self.n += k
        return str(self.n)

    def exit_now(self, k: int) -> str:
        """End the process.

        Args:
            k: its exit status
        """
        os._exit(k)

    def reward(self) -> float:
        return float(self.n)
'''

LIMIT = 2.0


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    path = tmp_path_factory.mktemp("iso_envs") / "iso_envs.py"
    path.write_text(ENVS)
    return str(path)


@pytest.fixture(scope="module")
def tok():
    from posttrain.models.tiny import resolve_model_path
    from posttrain.models.tokenizer import load as load_tokenizer

    return load_tokenizer(resolve_model_path("tiny:llama"))


@pytest.fixture(scope="module")
def pool(envs):
    p = ToolPool(num_workers=1)
    warm = load_environment(f"{envs}:Counter").make(60.0, p)  # the fork server starts once, not in a limit
    warm.reset({})
    warm.close()
    yield p
    p.close()


def _children() -> set[int]:
    """Live child processes of this one (environment workers are children: started through the fork server,
    they are its children, so count the processes whose parent is the fork server too)."""
    out = set()
    me = os.getpid()
    parents = {me}
    for _ in range(2):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) in parents and fields[0] != "Z":
                out.add(int(pid))
        parents |= out
    return out


def test_a_step_holding_the_interpreter_lock_is_stopped_at_its_limit(tok, pool, envs):
    """One trajectory's `step` holds the lock; it ends at the limit (its worker killed) with one line naming the
    class, the method and the record; the other trajectory finishes normally meanwhile."""
    env = load_environment(f"{envs}:GilStep")
    t0 = time.monotonic()
    ro, agent = run(tok, pool, {}, lambda p, i, k: "hang" if p == 0 else "fine", [{"n": 0}, {"n": 1}], env=env,
                    limits=AgentLimits(tool_timeout_s=LIMIT))
    agent.close()
    assert time.monotonic() - t0 < LIMIT + 3.0
    assert ro.finish_reasons == ["env_error", "stop"]
    bad = ro.trajectories[0]
    assert bad["env_error"] == f"GilStep.step ran past its {LIMIT:g}s time limit (its worker process was killed)"
    assert bad["env_error_kind"] == "step timeout" and bad["env_error_record"] == "record 0"
    assert list(ro.per_reward["environment"]) == [0.0, 1.0]


def test_a_step_that_exits_its_process_ends_only_its_trajectory(tok, pool, envs):
    env = load_environment(f"{envs}:Exiting")
    t0 = time.monotonic()
    ro, agent = run(tok, pool, {}, lambda p, i, k: "move", [{"n": 0}], env=env, n=2,
                    limits=AgentLimits(tool_timeout_s=30.0))
    agent.close()
    assert time.monotonic() - t0 < 5.0  # noticed at once, not at the 30 s limit
    assert ro.finish_reasons == ["env_error"] * 2
    assert {t["env_error"] for t in ro.trajectories} == {"Exiting.step ended its worker process (exit code 3)"}


def test_a_reset_holding_the_lock_fails_set_up_in_one_line(tok, pool, envs):
    from posttrain.agent.rollout import Agent

    agent = Agent(tok, environment=load_environment(f"{envs}:GilReset"), limits=AgentLimits(tool_timeout_s=LIMIT),
                  pool=pool)
    t0 = time.monotonic()
    with pytest.raises(EnvCallError) as e:
        agent.first_messages({"n": 1})
    agent.close()
    assert time.monotonic() - t0 < LIMIT + 3.0
    assert str(e.value) == f"GilReset.reset ran past its {LIMIT:g}s time limit (its worker process was killed)"


def test_each_trajectory_keeps_its_own_state_between_steps(tok, pool, envs):
    """Three steps per trajectory count 1, 2, 3 on the trajectory's own instance (started from its record's
    value); the reward reads the same instance; two trajectories of one record share nothing; no worker is left
    once the rollouts are scored."""
    before = _children()
    env = load_environment(f"{envs}:Counter")
    ro, agent = run(tok, pool, {}, lambda p, i, k: f"turn {k}", [{"start": 0}, {"start": 10}], env=env, n=2,
                    limits=AgentLimits(tool_timeout_s=30.0))
    agent.close()
    observations = [[m["content"] for m in t["messages"] if m["role"] == "user"][1:] for t in ro.trajectories]
    assert observations == [["1", "2"], ["1", "2"], ["11", "12"], ["11", "12"]]
    # 3 turn rewards of 1, plus the final reward: the count n (3 or 13) + 100 x the 3 turn rewards it was given
    assert list(ro.per_reward["environment"]) == [306.0, 306.0, 316.0, 316.0]
    for _ in range(50):
        if _children() <= before:
            break
        time.sleep(0.1)
    assert _children() <= before


def test_tool_methods_share_the_trajectory_instance_and_a_crash_ends_it(tok, pool, envs):
    env = load_environment(f"{envs}:CountingTools")
    turns = {0: [call("add", k=2), call("add", k=3), "done"], 1: [call("add", k=1), call("exit_now", k=4), "x"]}
    ro, agent = run(tok, pool, {}, lambda p, i, k: turns[p][k], [{"n": 0}, {"n": 1}], env=env,
                    limits=AgentLimits(tool_timeout_s=30.0))
    agent.close()
    assert ro.finish_reasons == ["stop", "env_error"]
    assert [r["content"] for r in ro.trajectories[0]["tool_results"]] == ["2", "5"]
    assert list(ro.per_reward["environment"]) == [5.0, 0.0]
    crashed = ro.trajectories[1]
    assert crashed["env_error_kind"] == "exit_now crash" and "exit code 4" in crashed["env_error"]
    assert crashed["tool_results"][1]["error"] == "crash"


# ---------------------------------------------------------------------- `posttrain rl`, end to end
def _rl_command(tmp_path, env: str, *overrides: str) -> list[str]:
    (tmp_path / "iso_envs.py").write_text(ENVS)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(4)))
    return [sys.executable, "-m", "posttrain.cli.main", "rl", "configs/rl_smoke.yaml", f"output_dir={tmp_path}/out",
            "model.path=tiny:llama", f"data.train={data}", "data.eval=null", "rollout.batch_prompts=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", f"rollout.environment={tmp_path}/iso_envs.py:{env}",
            f"rollout.stop_token_ids=[{', '.join(map(str, range(104)))}]",  # every turn ends on its first token
            "rewards.functions=[]", "rewards.correctness=environment", "rewards.num_workers=0",
            "eval.at_start=false", "trainer.max_steps=2", "trainer.progress=false", *overrides]


@pytest.mark.slow
def test_rl_with_a_reset_holding_the_lock_ends_with_one_error_line(tmp_path):
    """The acceptance run: `posttrain rl` whose environment's reset holds the interpreter lock ends within its
    limit + 30 s, exit status 1, exactly one `error:` line naming the class, the method and the record, and no
    traceback."""
    t0 = time.monotonic()
    proc = subprocess.run(_rl_command(tmp_path, "GilReset", "rollout.tool_timeout_s=5"), capture_output=True,
                          text=True, cwd=REPO, timeout=300, check=False)
    took = time.monotonic() - t0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert errors == [f"error: {tmp_path}/d.jsonl, line 1: GilReset.reset ran past its 5s time limit (its worker "
                      "process was killed)"], proc.stderr[-3000:]
    assert took < 5 + 30, took


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_environment_holds_the_lock(tmp_path):
    """SIGTERM while the environment's reset holds the lock (a 10-minute limit: the signal must be what stops it):
    the run is gone within 30 s, its worker too."""
    mark = tmp_path / "started"
    proc = subprocess.Popen(_rl_command(tmp_path, "GilReset", "rollout.tool_timeout_s=600"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "POSTTRAIN_TEST_MARK": str(mark)})
    try:
        for _ in range(1200):
            if mark.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert mark.exists(), proc.communicate()[1][-3000:]
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]  # as the CLI stops on SIGTERM
    assert err.strip().splitlines()[-1] == "terminated (SIGTERM)", err[-3000:]
    for _ in range(50):  # the environment's worker (and every other process of the run) is gone too
        if not _with_environ(f"POSTTRAIN_TEST_MARK={mark}"):
            break
        time.sleep(0.1)
    assert not _with_environ(f"POSTTRAIN_TEST_MARK={mark}")


def _with_environ(entry: str) -> list[int]:
    """Pids of processes whose environment holds `entry`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry.encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_rl_with_a_step_that_exits_its_process_is_not_silent(tmp_path):
    """Every trajectory's step calls `os._exit(3)`: a warning line, then one `error:` line naming the class, the
    crash and the record, exit status 1 (never the environment's status 3 without a word)."""
    proc = subprocess.run(_rl_command(tmp_path, "Exiting"), capture_output=True, text=True, cwd=REPO, timeout=600,
                          check=False)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: environment Exiting: 4 of 4 trajectories of step 1 "
                                                     "failed"), proc.stderr[-3000:]
    assert re.search(rf"first error: Exiting.step ended its worker process \(exit code 3\) \({tmp_path}/d.jsonl, "
                     r"line [1-4]\)$", errors[0]), errors
    assert sum("warning: environment Exiting: step crash" in x for x in proc.stdout.splitlines()) == 1
