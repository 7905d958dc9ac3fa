"""Environments and rewards that fail: a hanging, raising or ill-typed environment call (`reset`, `step`, a tool
method) ends its trajectory with a counted error (`agent/env_errors`, the text in trajectories.jsonl) within the
tool time limit; a run warns once per kind and stops with one `error:` line when too many of a step's
trajectories fail; a reward that raises prints one warning line, without a traceback. (Environments that hold
the interpreter lock or exit their process, and SIGTERM during them: tests/test_env_isolation.py.)

The rollouts run under the scripted sampler of `test_agent_rollout` (the sampler's turn-end contract, the model's
turns as text); the end-to-end run through the `posttrain` command is marked slow."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_agent_rollout import REPO, ScriptedSampler, call, run

from posttrain.agent import AgentLimits, EnvCallError, load_environment
from posttrain.agent.failures import EnvErrorWatch, EnvironmentFailedError
from posttrain.agent.rollout import Agent
from posttrain.rl.ledger import Ledger
from posttrain.rl.metrics import agent_metrics
from posttrain.rollout.collect import generate_rollouts
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptEncoder, PromptSet
from posttrain.rollout.rollouts import Rollouts
from posttrain.rewards.runner import RewardRunner
from posttrain.sampling import SamplingParams
from posttrain.tools import ToolPool

ENVS = '''
import threading

RELEASE = threading.Event()  # never set: a hanging call waits until its worker is killed


class Hanging:
    def reset(self, record):
        return "play"

    def step(self, text: str):
        RELEASE.wait(60)
        return "late", 1.0, False


class Raising:
    def reset(self, record):
        return "play"

    def step(self, text: str):
        raise RuntimeError("the game broke")


class IllTyped:
    def reset(self, record):
        return "play"

    def step(self, text: str):
        return "an observation alone"


class HangingTool:
    def reset(self, record):
        return "use the tool"

    def probe(self, x: int) -> str:
        """Never answers in time.

        Args:
            x: anything
        """
        RELEASE.wait(60)
        return "late"


class HangingReset:
    def reset(self, record):
        if record.get("hang"):
            RELEASE.wait(60)
        return "play"

    def step(self, text: str):
        return None, 1.0, True


class SometimesRaising:
    def reset(self, record):
        self.bad = record["bad"]
        return "play"

    def step(self, text: str):
        if self.bad:
            raise ValueError("bad record")
        return None, 1.0, True
'''

LIMIT = 1.0  # seconds: the tool (and environment) time limit of these tests


@pytest.fixture(scope="module")
def tok():
    from posttrain.models.tiny import resolve_model_path
    from posttrain.models.tokenizer import load as load_tokenizer

    return load_tokenizer(resolve_model_path("tiny:llama"))


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "failing_envs.py"
    path.write_text(ENVS)
    return str(path)


@pytest.fixture(scope="module")
def pool(envs):
    """The tool pool, its fork server started (the first worker of a process pays for it, once: not a limit)."""
    p = ToolPool(num_workers=1)
    session = load_environment(f"{envs}:Raising").make(30.0, p)
    session.reset({})
    session.close()
    yield p
    p.close()


def _rollouts(tok, pool, env, records, turns=("my move",), limit=LIMIT):
    return run(tok, pool, {}, lambda p, i, k: turns[min(k, len(turns) - 1)], records, env=env,
               limits=AgentLimits(tool_timeout_s=limit))


def _logged(ro: Rollouts, folder: Path) -> list[dict]:
    ledger = Ledger(folder)
    ledger.record_trajectories(1, "train", ro, 4)
    ledger.close()
    return [json.loads(x) for x in (folder / "trajectories.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name, kind, text", [
    ("Hanging", "step timeout", f"Hanging.step ran past its {LIMIT:g}s time limit (its worker process was killed)"),
    ("Raising", "step exception", "Raising.step failed: RuntimeError: the game broke"),
    ("IllTyped", "step bad_type", "IllTyped.step must return (observation, reward, done), got str"),
])
def test_failing_step_ends_the_trajectory_with_a_counted_error(tok, pool, envs, tmp_path, name, kind, text):
    """The trajectory ends at once (the hanging step within the limit plus a little), finish reason `env_error`,
    counted in `agent/env_errors`, its text and kind in the summary and in trajectories.jsonl."""
    env = load_environment(f"{envs}:{name}")
    t0 = time.monotonic()
    ro, _ = _rollouts(tok, pool, env, [{"prompt": "go"}])
    assert time.monotonic() - t0 < LIMIT + 2.0
    [t] = ro.trajectories
    assert ro.finish_reasons == ["env_error"] and t["turns"] == 1
    assert t["env_errors"] == 1 and t["env_error_kind"] == kind and t["env_error"] == text
    assert agent_metrics(ro.trajectories)["agent/env_errors"] == 1.0
    [row] = _logged(ro, tmp_path)
    assert row["env_error"] == text and row["finish_reason"] == "env_error"


def test_hanging_environment_tool_method_ends_the_trajectory(tok, pool, envs):
    """An environment's tool method runs in its session's worker (where its state is): past the limit the worker is
    killed, the model's call gets a timeout error, and the trajectory ends (the instance is lost)."""
    env = load_environment(f"{envs}:HangingTool")
    t0 = time.monotonic()
    ro, _ = _rollouts(tok, pool, env, [{"prompt": "go"}], turns=(call("probe", x=1), "done"))
    assert time.monotonic() - t0 < LIMIT + 2.0
    [t] = ro.trajectories
    assert ro.finish_reasons == ["env_error"] and t["env_error_kind"] == "probe timeout"
    assert t["tool_results"][0]["error"] == "timeout" and "time limit" in t["tool_results"][0]["content"]


def test_hanging_reset_is_an_error_at_set_up_and_in_a_trajectory(tok, pool, envs, tmp_path):
    """At set-up (prompt ids of every record) a hanging reset is a one-line data error naming the file and line;
    during a rollout (a reset that hangs only then) it ends that trajectory."""
    from posttrain.data import read_prompts
    from posttrain.data.sources import DataError
    from posttrain.rl.config import PromptData
    from posttrain.rl.prompts import encode_prompt_set

    env = load_environment(f"{envs}:HangingReset")
    agent = Agent(tok, environment=env, limits=AgentLimits(tool_timeout_s=LIMIT), pool=pool)
    data = tmp_path / "d.jsonl"
    data.write_text('{"n": 1}\n{"n": 2, "hang": true}\n')
    records = read_prompts(str(data), optional=True)
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        encode_prompt_set(PromptEncoder(tok), records, PromptData(), agent)
    assert time.monotonic() - t0 < LIMIT + 2.0
    assert str(e.value) == (f"{data}, line 2: HangingReset.reset ran past its 1s time limit (its worker process "
                            "was killed)")
    prompt = agent.prompt_ids(agent.first_messages({}))
    sampler = ScriptedSampler(tok, lambda p, i, k: "a move")
    ro = generate_rollouts(Policy(None, tok, sampler=sampler), PromptSet.of([{"hang": True}], [prompt]),
                           SamplingParams(max_new_tokens=50), RewardRunner([], num_workers=0), agent=agent)
    assert ro.finish_reasons == ["env_error"] and ro.trajectories[0]["env_error_kind"] == "reset timeout"
    with pytest.raises(EnvCallError, match="HangingReset.reset ran past"):
        agent.first_messages({"hang": True})


def test_more_than_the_allowed_fraction_stops_the_run_with_one_line(tok, pool, envs, tmp_path):
    """3 of 4 trajectories fail (over 0.5): the step's failed trajectories are written to trajectories.jsonl and the
    run stops with `EnvironmentFailedError` naming the class and the first error; a warning line the first time
    each kind occurs, never again; at or under the fraction the run goes on."""
    env = load_environment(f"{envs}:SometimesRaising")
    ro, _ = _rollouts(tok, pool, env, [{"bad": True}, {"bad": True}, {"bad": True}, {"bad": False}])
    assert ro.finish_reasons == ["env_error"] * 3 + ["stop"]
    assert agent_metrics(ro.trajectories)["agent/env_errors"] == 0.75
    warnings: list[str] = []
    watch = EnvErrorWatch("SometimesRaising", 0.75, warnings.append)
    watch.check(1, ro.trajectories)  # 0.75 is not more than 0.75
    watch.check(2, ro.trajectories)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("environment SometimesRaising: step exception at step 1, the trajectory ended: "
                                  "SometimesRaising.step failed: ValueError: bad record")

    from posttrain.rl.steps import RLState, check_environment

    ledger = Ledger(tmp_path)
    parts = SimpleNamespace(env_watch=EnvErrorWatch("SometimesRaising", 0.5, warnings.append),
                            cfg=SimpleNamespace(eval=SimpleNamespace(log_samples=1)))
    with pytest.raises(EnvironmentFailedError) as e:
        check_environment(parts, RLState(ledger=ledger), 3, ro)
    ledger.close()
    assert str(e.value) == ("environment SometimesRaising: 3 of 4 trajectories of step 3 failed, more than "
                            "rollout.max_env_error_fraction=0.5; first error: SometimesRaising.step failed: "
                            "ValueError: bad record (record 0)")  # the record: its file and line in a run
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [r.get("env_error") is not None for r in rows] == [True, True]  # the first, and one more failed


def test_the_command_prints_the_error_in_one_line(monkeypatch, capsys, tmp_path):
    """`posttrain rl` reports `EnvironmentFailedError` as one `error:` line, exit code 1, no traceback."""
    import posttrain.cli.rl
    from posttrain.cli.main import main

    def failing(args):
        raise EnvironmentFailedError("environment Raising: 4 of 4 trajectories of step 1 failed, more than "
                                     "rollout.max_env_error_fraction=0.5; first error: Raising.step failed: boom")

    monkeypatch.setattr(posttrain.cli.rl, "run", failing)
    assert main(["--no-compile-cache", "rl", str(tmp_path / "c.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: environment Raising: 4 of 4 trajectories of step 1 failed, more than "
                   "rollout.max_env_error_fraction=0.5; first error: Raising.step failed: boom"]


def test_max_env_error_fraction_is_checked():
    from posttrain.rl.config import RolloutConfig

    assert RolloutConfig().max_env_error_fraction == 0.5
    with pytest.raises(ValueError, match=r"rollout.max_env_error_fraction must be between 0 and 1"):
        RolloutConfig(max_env_error_fraction=1.5)


REWARDS = '''
def broken(prompts, completions, **kw):
    return [1 / 0 for _ in completions]
'''


def test_a_raising_reward_prints_one_line_without_a_traceback(tmp_path, caplog, monkeypatch):
    """One warning line naming the reward, the error and where it was raised, the first time; the next scoring
    calls count the failures silently. POSTTRAIN_DEBUG=1 adds the traceback."""
    (tmp_path / "r.py").write_text(REWARDS)
    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    with RewardRunner([f"{tmp_path}/r.py:broken"], num_workers=0) as runner, caplog.at_level(logging.WARNING):
        for _ in range(3):
            _, _, stats = runner.score(["p"] * 3, ["c"] * 3)
            assert stats["reward/broken/failures"] == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0] and "Traceback" not in lines[0], lines
    assert re.fullmatch(r"reward 'broken': 3 completion\(s\) got failure_value 0.0: \[0:3\] error: ZeroDivisionError: "
                        r"division by zero \(r.py:3, in (<listcomp>|broken)\) \(counted in reward/broken/failures; "
                        r"this kind is not printed again\)", lines[0]), lines[0]
    caplog.clear()
    monkeypatch.setenv("POSTTRAIN_DEBUG", "1")
    with RewardRunner([f"{tmp_path}/r.py:broken"], num_workers=0) as runner, caplog.at_level(logging.WARNING):
        runner.score(["p"], ["c"])
    [debug] = [r.getMessage() for r in caplog.records]
    assert 'r.py", line 3' in debug and "\n" in debug


@pytest.mark.slow
def test_rl_command_stops_on_a_failing_environment(tmp_path):
    """End to end: `posttrain rl` with an environment whose step always raises prints a warning line, then one
    `error:` line naming the class and the first error, and exits 1; trajectories.jsonl holds the error."""
    import subprocess

    (tmp_path / "envs.py").write_text(ENVS)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "rl", "configs/rl_smoke.yaml", f"output_dir={out}",
         "model.path=tiny:llama", f"data.train={data}", "data.eval=null", "rollout.batch_prompts=2",
         "rollout.group_size=2", "rollout.max_new_tokens=4", f"rollout.environment={tmp_path}/envs.py:Raising",
         f"rollout.stop_token_ids=[{', '.join(map(str, range(104)))}]",  # every turn ends on its first token
         "rewards.functions=[]", "rewards.correctness=environment", "rewards.num_workers=0", "eval.at_start=false",
         "trainer.max_steps=2", "trainer.progress=false"],
        capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and re.fullmatch(
        r"error: environment Raising: 4 of 4 trajectories of step 1 failed, more than "
        r"rollout.max_env_error_fraction=0.5; first error: Raising.step failed: RuntimeError: the game broke "
        rf"\({data}, line [1-4]\)", errors[0]), proc.stderr[-3000:]
    assert sum("warning: environment Raising: step exception" in x for x in proc.stdout.splitlines()) == 1
    rows = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert rows and all(r["env_error"] == "Raising.step failed: RuntimeError: the game broke" for r in rows)
