"""verifiers environments (`rollout.environment=verifiers:NAME_OR_FILE`): a `SingleTurnEnv`, a `ToolEnv` and a two-turn
`MultiTurnEnv` (`tests/verifiers_envs.py`, datasets built there) run in their worker process, their OpenAI client
talking to our in-process server over the tiny model (one per module). For every trajectory the ids trained on (the
mask-1 runs of the stitched sequence) are exactly the ids the server's engine sampled, the reward is the rubric's,
the rubric's metrics are reward columns; an environment that cannot load is one config error line; `posttrain rl`
trains 2 steps on each kind and logs the rubric's reward; `posttrain eval` reports the rubric's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from posttrain.config import ConfigError
from posttrain.rl.config import FleetConfig, PromptData, RewardsSection, RolloutConfig
from posttrain.rl.verifiers_source import open_verifiers
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptEncoder, PromptStyle
from posttrain.rollout.verifiers_env import VerifiersEnvironment, sampling_args
from posttrain.sampling import SamplingParams
from posttrain.serve.local import SERVED_NAME, serve_policy

REPO = Path(__file__).resolve().parents[1]
ENVS = REPO / "tests" / "verifiers_envs.py"
# the tiny model's character tokenizer: <eos> and the lower-case letters end a reply, so replies are short
STOPS = [2] + list(range(74, 100))


@pytest.fixture(scope="module")
def served():
    """The tiny model served in-process, the engine's sampled ids recorded per sequence (`sampled`)."""
    policy = Policy.open("tiny:llama")
    server = serve_policy(policy, slots=8)
    sampled: list[list[int]] = []
    submit_all = server.engine.submit_all

    def recording(lane, reqs, emits):
        def wrap(emit, ids):
            def on_event(ev):
                ids.extend(getattr(ev, "token_ids", []) or [])
                emit(ev)
            return on_event
        lists = [[] for _ in reqs]
        sampled.extend(lists)
        return submit_all(lane, reqs, [wrap(e, ids) for e, ids in zip(emits, lists)])

    server.engine.submit_all = recording
    yield server, policy, sampled
    server.stop()


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, ...]]:
    """The mask-1 runs of a completion: one per assistant turn."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(tuple(cur))
            cur = []
    return out + ([tuple(cur)] if cur else [])


@pytest.mark.parametrize("kind", ["single", "tool", "multi"])
@pytest.mark.slow
def test_trained_ids_are_the_sampled_ids_and_the_reward_is_the_rubrics(served, kind):
    server, policy, sampled = served
    env = VerifiersEnvironment.open(f"verifiers:{ENVS}", {"kind": kind})
    try:
        records = env.records("train")
        assert [r["answer"] for r in records] == ["0", "1", "2", "3"] and records[0]["prompt"][-1]["role"] == "user"
        prompts = PromptEncoder(policy.tokenizer, PromptStyle(chat=True)).encode(records)
        params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, stop_token_ids=STOPS)
        del sampled[:]
        ro, counts = env.rollouts(prompts, [1, 3], params, f"{server.url}/v1", SERVED_NAME, uids=[7, 8], version=3)
    finally:
        env.close()
    assert len(ro) == 4 and ro.group_size == 2 and ro.record_index == [1, 1, 3, 3] and ro.uid == [7, 7, 8, 8]
    assert counts["verifiers/env_errors"] == 0
    trained = [run for ids, mask in zip(ro.completion_ids, ro.completion_mask) for run in _runs(ids, mask)]
    kept = sum(t["turns"] for t in ro.trajectories)
    assert len(trained) == kept  # one sampled run per kept turn
    # the ids trained on are exactly sequences the engine sampled (a multiset: each sampled sequence used once)
    assert not Counter(trained) - Counter(tuple(s) for s in sampled)
    refused = sum(t["refused_turns"] for t in ro.trajectories)
    assert counts["verifiers/refused_turns"] == refused
    assert kept + refused == sum(len([m for m in t["messages"] if m.get("role") == "assistant"])
                                 for t in ro.trajectories)
    if kind == "multi":
        assert all(t["turns"] + t["refused_turns"] == 2 for t in ro.trajectories)
    for k in range(len(ro)):
        reply = ro.texts[k]
        assert ro.rewards[k] == pytest.approx(min(1.0, 0.1 * len(reply)))  # the rubric's, recomputed
        assert ro.per_reward["rubric/length_reward"][k] == pytest.approx(ro.rewards[k])
        assert ro.per_reward["rubric/has_vowel"][k] == float(any(c in "aeiou" for c in reply))
        assert len(ro.logprobs[k]) == len(ro.completion_ids[k]) == len(ro.completion_mask[k])
        assert all(lp == 0.0 for lp, m in zip(ro.logprobs[k], ro.completion_mask[k]) if not m)
        assert ro.token_versions[k] == [3] * len(ro.completion_ids[k])


def test_the_request_options_ask_for_token_ids_and_logprobs():
    args = sampling_args(SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3))
    assert args["logprobs"] is True and args["extra_body"] == {"return_token_ids": True, "top_k": 3}
    assert (args["max_tokens"], args["temperature"]) == (5, 0.5)


def test_bad_environments_and_settings_are_one_line_config_errors():
    rollout = RolloutConfig(environment=f"verifiers:{ENVS}", environment_args={"kind": "broken"})
    with pytest.raises(ConfigError, match=r"rollout.environment: cannot load .*RuntimeError: this environment "
                                          r"cannot load$"):
        open_verifiers(rollout, RewardsSection(functions=[]), PromptData(), FleetConfig())
    with pytest.raises(ConfigError, match="rollout.environment: 'verifiers:' must be verifiers:NAME_OR_FILE"):
        open_verifiers(RolloutConfig(environment="verifiers:"), RewardsSection(), PromptData(), FleetConfig())
    with pytest.raises(ConfigError, match="no_such_environment_pkg"):
        open_verifiers(RolloutConfig(environment="verifiers:no_such_environment_pkg"), RewardsSection(),
                       PromptData(), FleetConfig())
    with pytest.raises(ConfigError, match="rewards.functions: a verifiers environment's rubric"):
        open_verifiers(rollout, RewardsSection(functions=[{"name": "exact_match"}]), PromptData(), FleetConfig())
    with pytest.raises(ConfigError, match="data.train: a verifiers environment's dataset"):
        open_verifiers(rollout, RewardsSection(), PromptData(train="x.jsonl"), FleetConfig())


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "tool"])
def test_rl_trains_two_steps_on_the_rubrics_reward(tmp_path, kind):
    config = yaml.safe_load((REPO / "configs/rl_smoke.yaml").read_text())
    config["data"] = {"chat": True}  # the environment's dataset gives the prompts
    config["rewards"] = {"functions": []}  # its rubric the rewards
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "posttrain.cli.main", "rl", "rl.yaml",
           f"output_dir={tmp_path / 'out'}", "trainer.max_steps=2", "trainer.save_every=0", "eval.at_start=false",
           f"rollout.environment=verifiers:{ENVS}", f"rollout.environment_args={{kind: {kind}}}",
           "eval.log_samples=64", "rollout.max_new_tokens=6", f"rollout.stop_token_ids={STOPS}"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "Traceback" not in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "out/trajectories.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {1, 2}
    for row in rows:
        reply = [m for m in row["messages"] if m["role"] == "assistant"][-1]["content"] or ""
        assert row["reward"] == pytest.approx(min(1.0, 0.1 * len(reply)))
    for step in (1, 2):
        m = next(x for x in metrics if x.get("step") == step and "reward/mean" in x)
        step_rows = [r["reward"] for r in rows if r["step"] == step]
        assert m["reward/mean"] == pytest.approx(float(np.mean(step_rows)), abs=1e-5)
        assert m["verifiers/env_errors"] == 0 and "verifiers/refused_turns" in m


@pytest.mark.slow
def test_eval_reports_the_rubrics_metrics(tmp_path):
    """`posttrain eval --environment verifiers:FILE`: the environment's eval split (3 rows), a greedy and 2 sampled
    rollouts of each, the summary the rubric's reward and metrics, each row's reward the rubric's."""
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "eval", "--model", "tiny:llama",
                          "--environment", f"verifiers:{ENVS}", "--environment-args", '{"kind": "tool"}',
                          "--n", "2", "--max-new-tokens", "6", "--output", "ev.jsonl", "--no-progress"],
                         cwd=tmp_path, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "rubric/length_reward" in out.stdout and "Traceback" not in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "ev.summary.json").read_text())
    assert len(rows) == 3 and summary["eval/num_prompts"] == 3 and summary["reward"] == "rubric"
    greedy = [r["greedy"] for r in rows]
    for g in greedy:
        assert g["reward"] == pytest.approx(min(1.0, 0.1 * len(g["text"])))
        assert set(g["metrics"]) >= {"length_reward", "has_vowel", "total_tool_calls"}
    assert summary["eval/reward_mean"] == pytest.approx(np.mean([g["reward"] for g in greedy]), abs=1e-6)
    assert summary["eval/rubric/has_vowel"] == pytest.approx(np.mean([g["metrics"]["has_vowel"] for g in greedy]))
    assert all(len(r["samples"]) == 2 for r in rows) and "eval/rubric/length_reward_sampled" in summary
    assert "eval/pass@2" in summary and summary["eval/env_errors"] == 0


def test_eval_options_read_the_environment_arguments():
    from posttrain.eval.run import EvalConfig

    cfg = EvalConfig(model="tiny:llama", environment=f"verifiers:{ENVS}", environment_args='{"kind": "multi"}')
    assert cfg.environment_args == {"kind": "multi"}
    with pytest.raises(ConfigError, match="--environment-args: not a JSON object"):
        EvalConfig(model="m", environment_args="{kind")
    with pytest.raises(ConfigError, match="--environment-args: expected a JSON object"):
        EvalConfig(model="m", environment_args="[1]")


def test_generate_and_chat_refuse_a_verifiers_environment():
    from posttrain.rollout.generate import GenerateConfig

    with pytest.raises(ConfigError, match="verifiers environments run in posttrain rl and posttrain eval"):
        GenerateConfig(model="tiny:llama", environment=f"verifiers:{ENVS}").check_agent()
