"""The `judge` reward on a local checkpoint (`kwargs.model` a model spec, no `url`): the run opens it as a `Policy`
and serves it in-process (`posttrain.serve.local.serve_judges`), one judge server per module here (tiny:llama).
Its replies are the checkpoint's own greedy answers to the rendered judge message (checked against the openai
client asking the same server, and against `Policy.sample` with the chat template), read as configured; master keys
are never sent; a local judge that was never served fails its requests with one line; the server stops when the
runner closes; `posttrain rl` with a local judge runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from posttrain.rewards.judge import Judge, JudgeConfig
from posttrain.rewards.runner import RewardRunner
from posttrain.rollout.policy import Policy
from posttrain.sampling import SamplingParams
from posttrain.serve.local import SERVED_NAME, serve_judges

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "Grade: {answer}"
# the tiny model writes characters; any one of them is read as the score's one group (a non-number: unparseable)
KWARGS = {"model": "tiny:llama", "template": TEMPLATE, "max_new_tokens": 4, "score": "number", "max": 9.0}


@pytest.fixture(scope="module")
def runner():
    r = RewardRunner([{"name": "judge", "kwargs": KWARGS}, {"name": "judge2", "fn": "judge", "kwargs": KWARGS}],
                     num_workers=0)
    servers = serve_judges(r)
    assert len(servers) == 1  # two judges on one checkpoint share its server
    yield r, servers[0]
    r.close()
    assert servers[0].uvicorn.should_exit  # stopped with the runner


def test_a_local_judge_answers_with_the_checkpoints_greedy_reply(runner):
    r, server = runner
    judges = [fn for fn in r.functions if isinstance(fn, Judge)]
    assert all(j.cfg.url == f"{server.url}/v1" and j.cfg.model == SERVED_NAME and j.spec == "tiny:llama"
               for j in judges)
    completions = ["forty two", "Answer:", "x y z"]
    total, per, stats = r.score(["q"] * 3, completions, {"answer": ["42"] * 3})
    assert stats["reward/judge/failures"] == 0 and stats["reward/judge/skipped"] == 1  # "Answer:" never sent
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x")
    policy = Policy.open("tiny:llama", default_chat=True)
    parsed = 0
    for i in (0, 2):
        message = TEMPLATE.format(answer=completions[i])
        reply = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": message}],
                                               max_tokens=4, temperature=0.0).choices[0].message.content or ""
        ids = policy.encode([{"prompt": [{"role": "user", "content": message}]}]).ids
        own = policy.sample(ids, SamplingParams(max_new_tokens=4, temperature=0.0)).texts[0]
        assert reply and reply.strip() == own.strip(), (reply, own)  # the served reply: the model's greedy one
        score = JudgeConfig(url="http://x/v1", **{k: v for k, v in KWARGS.items() if k != "model"}).read(reply)
        assert per["judge"][i] == pytest.approx(0.0 if score is None else score)
        assert per["judge2"][i] == per["judge"][i]
        parsed += score is not None
    assert stats["reward/judge/parse_failures"] == 2 - parsed
    assert per["judge"][1] == 0.0


def test_a_local_judge_that_was_never_served_fails_with_one_line():
    with RewardRunner([{"name": "judge", "kwargs": {"model": "tiny:llama"}}], num_workers=0) as r:
        _, per, stats = r.score(["q"], ["an answer"], {"answer": ["a"]})
        assert stats["reward/judge/failures"] == 1
        assert "the local judge 'tiny:llama' is not served" in " ".join(r.last_errors.get("judge", []))


@pytest.mark.slow
def test_rl_with_a_local_judge_runs_end_to_end(tmp_path):
    judge = json.dumps([{"name": "judge", "kwargs": {"model": "tiny:llama", "max_new_tokens": 4}}])
    cmd = [sys.executable, "-m", "posttrain.cli.main", "rl", str(REPO / "configs/rl_smoke.yaml"),
           f"output_dir={tmp_path / 'out'}", "trainer.max_steps=1", "trainer.save_every=0", "eval.at_start=false",
           f"data.train={REPO / 'tests/data/rl_prompts_tiny.jsonl'}", "data.eval=null", f"rewards.functions={judge}",
           "rewards.correctness=judge", "rollout.max_new_tokens=4"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if "reward/judge" in m)
    assert step["reward/judge/failures"] == 0  # every request reached the served checkpoint and was answered
    assert 0 <= step["reward/judge/parse_failures"] <= 16 and 0.0 <= step["reward/judge"] <= 1.0
