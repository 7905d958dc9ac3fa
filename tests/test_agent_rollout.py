"""Multi-turn rollouts (`posttrain.agent.rollout`): the per-trajectory driver behind the sampler's turn ends.

The driver tests run it under a scripted sampler that follows `Sampler.generate`'s `on_turn_end` contract
(turn ids and log-probs in; None, ids to append, or a Future of either out; appended ids enter the completion
with log-prob 0.0 and mask 0), with the model's turns written as text, so tool calls, failures and limits are
exercised deterministically: token-in/token-out, error messages for failing tools, limits, truncation.
The end-to-end tests (marked slow) run the real sampler on a tiny random model."""

from __future__ import annotations

import concurrent.futures as cf
from itertools import groupby
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from posttrain.agent import load_environment
from posttrain.agent.rollout import Agent, AgentLimits
from posttrain.models.tiny import resolve_model_path
from posttrain.models.tokenizer import load as load_tokenizer
from posttrain.rl.batch import build_rl_batch
from posttrain.rl.metrics import agent_metrics
from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.collect import generate_rollouts
from posttrain.rollout.policy import Policy
from posttrain.rollout.rollouts import Rollouts
from posttrain.rewards.runner import RewardRunner
from posttrain.sampling import SamplingParams
from posttrain.sampling.params import Completion, TurnEnd
from posttrain.tools import ToolPool, load_tools

REPO = Path(__file__).resolve().parents[1]

BAD_TOOLS = '''
import time

def boom(x: int) -> str:
    """A tool that raises.

    Args:
        x: anything
    """
    raise RuntimeError("tool bug")

def hang(x: int) -> str:
    """A tool that never returns.

    Args:
        x: anything
    """
    time.sleep(600)
    return "never"

def flood(x: int) -> str:
    """A tool that prints and returns 10 MB.

    Args:
        x: anything
    """
    print("y" * 10_000_000)
    return "z" * 10_000_000
'''


class ScriptedSampler:
    """Follows `Sampler.generate`'s multi-turn contract; the model's turn k of sequence (p, i) is the text
    `script(p, i, k)` tokenized (plus the stop token), with made-up log-probs, cut at the turn's budget."""

    def __init__(self, tok, script):
        self.tok, self.script, self.version = tok, script, 0
        self.rng = np.random.default_rng(0)
        self.cfg = SimpleNamespace(max_position_embeddings=100_000)
        self.max_len = None
        self.context = 100_000  # as `Sampler.context`: the model's positions (no cache limit)

    def generate(self, prompts, params, *, key_ids=None, on_turn_end=None, max_len=None, progress=False):
        out = []
        for p in range(len(prompts)):
            for i in range(params.n):
                ids, lps, mask, reason = [], [], [], "stop"
                for k in range(100):
                    turn = self.tok.encode(self.script(p, i, k), add_special_tokens=False) + [self.tok.eos_token_id]
                    budget = params.max_new_tokens
                    turn, reason = (turn, "stop") if len(turn) <= budget else (turn[:budget], "length")
                    tlp = (-self.rng.random(len(turn))).tolist()
                    ids += turn
                    lps += tlp
                    mask += [1] * len(turn)
                    length = len(prompts[p]) + len(ids)
                    room = (max_len or 100_000) - length - 1
                    more = on_turn_end(TurnEnd(p, i, k, turn, tlp, None, reason, room, length))
                    if isinstance(more, cf.Future):
                        more = more.result(timeout=60)
                    if more is None:
                        break
                    assert len(more) <= room
                    ids += more
                    lps += [0.0] * len(more)
                    mask += [0] * len(more)
                out.append(Completion(p, i, ids, lps, None, reason, self.tok.decode(ids), mask=mask, turns=k + 1))
        return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("tiny:llama"))


@pytest.fixture(scope="module")
def pool():
    p = ToolPool(num_workers=2)
    yield p
    p.close()


def call(name, **args):
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def run(tok, pool, tools, script, records, *, limits=AgentLimits(), max_new=2000, n=1, env=None):
    """Multi-turn rollouts of `records` under the scripted sampler (`max_new`: each turn's token budget)."""
    agent = Agent(tok, tools=tools, environment=env, limits=limits, pool=pool)
    prompts = [agent.prompt_ids(agent.first_messages(r)) for r in records]
    sampler = ScriptedSampler(tok, script)
    runner = RewardRunner([], num_workers=0)
    ro = generate_rollouts(Policy(None, tok, sampler=sampler), PromptSet.of(records, prompts),
                           SamplingParams(max_new_tokens=max_new, n=n), runner, agent=agent)
    return ro, agent


def test_token_in_token_out_with_the_calculator(tok, pool):
    """Every trajectory: the buffer's model tokens are the sampler's tokens and log-probs, the appended ids decode
    to the tool result and the next header, and the loss mask is 1 exactly on sampled tokens."""
    turns = [call("calculator", expression="12*34") + call("calculator", expression="2+2"), "It is 408."]
    ro, agent = run(tok, pool, load_tools(["calculator"]), lambda p, i, k: turns[k],
                    [{"prompt": "What is 12*34?"}, {"prompt": "And 2+2?"}], n=2)
    assert len(ro) == 4 and ro.finish_reasons == ["stop"] * 4
    for c_ids, lps, mask, traj in zip(ro.completion_ids, ro.logprobs, ro.completion_mask, ro.trajectories):
        mask = np.asarray(mask)
        sampled = [t for t, m in zip(c_ids, mask) if m]
        expected = [t for text in turns for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]]
        assert sampled == expected
        assert traj["turns"] == 2 and traj["num_tool_calls"] == 2 and traj["tool_errors"] == 0
        assert [r["content"] for r in traj["tool_results"]] == ["408", "4"]
        appended = tok.decode([t for t, m in zip(c_ids, mask) if not m], skip_special_tokens=False)
        assert appended == "<|user|><tool_response>\n408\n</tool_response>\n<tool_response>\n4\n</tool_response><eos><|assistant|>"
        assert np.all(np.asarray(lps)[mask == 0] == 0.0)
        assert traj["messages"][-1] == {"role": "assistant", "content": "It is 408."}
    assert ro.texts == ["It is 408."] * 4  # the reward functions see the final answer
    # the training batch: loss only on the sampled tokens, the behaviour log-probs the sampler's
    batch = build_rl_batch(ro, np.ones(len(ro)))
    for i in range(len(ro)):
        n = len(ro.completion_ids[i])
        assert batch.loss_mask[i, :n].tolist() == ro.completion_mask[i] and not batch.loss_mask[i, n:].any()
        np.testing.assert_allclose(batch.behaviour_logp[i, :n], ro.logprobs[i])
    m = agent_metrics(ro.trajectories)
    assert m["agent/turns_mean"] == 2 and m["agent/tool_calls_mean"] == 2 and m["agent/tool_errors"] == 0
    # plain data through the checkpoint and the fleet's wire format
    back = Rollouts.from_json(json.loads(json.dumps(ro.to_json())))
    assert back.completion_mask == ro.completion_mask and back.trajectories == ro.trajectories
    assert [g.completion_mask for g in ro.groups()] == [ro.completion_mask[:2], ro.completion_mask[2:]]


@pytest.mark.slow
def test_tool_failures_are_messages_and_counted(tok, pool, tmp_path):
    """A tool that raises, hangs past its limit, floods its output, or (python) reads the run's files: the model
    reads an error (or a cut output), the rollout goes on, and the metrics count the failures."""
    (tmp_path / "bad.py").write_text(BAD_TOOLS)
    secret = tmp_path / "config.yaml"
    secret.write_text("secret: do-not-leak-7e3fa1\n")  # a value no temp path can hold
    tools = load_tools([f"{tmp_path}/bad.py:boom", f"{tmp_path}/bad.py:hang", f"{tmp_path}/bad.py:flood", "python"])
    turns = [call("boom", x=1) + call("hang", x=1), call("flood", x=1),
             call("python", code=f"print(open({str(secret)!r}).read())"), '<tool_call>{"name": oops</tool_call>',
             call("nonexistent"), "done"]
    limits = AgentLimits(max_tool_output_tokens=400, tool_timeout_s=2.0)
    ro, _ = run(tok, pool, tools, lambda p, i, k: turns[k], [{"prompt": "go"}], limits=limits, max_new=5000)
    [traj] = ro.trajectories
    res = traj["tool_results"]
    assert [r["error"] for r in res] == ["exception", "timeout", None, None, "parse", "unknown_tool"]
    assert "tool bug" in json.loads(res[0]["content"])["error"]
    assert "time limit" in json.loads(res[1]["content"])["error"]
    assert "output cut" in res[2]["content"] and len(res[2]["content"]) < 500
    assert "No such file" in res[3]["content"] and "do-not-leak-7e3fa1" not in res[3]["content"]  # not in its view
    assert traj["turns"] == 6 and ro.finish_reasons == ["stop"] and traj["tool_errors"] == 4
    assert agent_metrics(ro.trajectories)["agent/tool_errors"] == 4
    assert agent_metrics(ro.trajectories)["agent/tool_seconds"] >= 2.0


def test_limits_turns_calls_and_truncation(tok, pool):
    tools = load_tools(["calculator"])
    always = lambda p, i, k: call("calculator", expression="1+1") * 2  # noqa: E731
    ro, _ = run(tok, pool, tools, always, [{"prompt": "x"}], limits=AgentLimits(max_turns=3, max_tool_calls=3))
    [t] = ro.trajectories
    assert ro.finish_reasons == ["max_turns"] and t["turns"] == 3 and t["num_tool_calls"] == 4
    assert [r["error"] for r in t["tool_results"]] == [None, None, None, "limit"]  # the 4th call is refused
    # an append that does not fit in the trajectory's budget ends it cleanly, marked truncated
    budget = len(tok.encode(always(0, 0, 0), add_special_tokens=False)) + 1 + 10
    ro, _ = run(tok, pool, tools, always, [{"prompt": "x"}], limits=AgentLimits(max_total_tokens=budget))
    assert ro.finish_reasons == ["truncated"]
    assert len(ro.completion_ids[0]) <= budget and ro.completion_mask[0][-1] == 1
    assert agent_metrics(ro.trajectories)["agent/truncated_frac"] == 1.0
    # the model's own turn hitting the budget is `length`
    ro, _ = run(tok, pool, tools, lambda p, i, k: "a" * 100, [{"prompt": "x"}], max_new=30)
    assert ro.finish_reasons == ["length"] and ro.trajectories[0]["turns"] == 1


def test_environment_step_game_and_rewards(tok, pool):
    env = load_environment("posttrain.agent.envs.guess_number:GuessNumber")
    guesses = ["50", "25", "37"]
    ro, _ = run(tok, pool, {}, lambda p, i, k: f"My guess: {guesses[k]}", [{"prompt": "", "secret": 37}], env=env)
    [t] = ro.trajectories
    assert t["turns"] == 3 and ro.finish_reasons == ["stop"]
    assert [m["content"] for m in t["messages"] if m["role"] == "user"][1:] == ["lower", "higher"]
    assert ro.per_reward["environment"].tolist() == [1.0] and ro.rewards.tolist() == [1.0]


@pytest.mark.slow
def test_environment_tools_and_final_reward(tok, pool):
    env = load_environment("posttrain.agent.envs.chain_sum:ChainSum")
    turns = [call("calculator", expression="3+4-2"), "<answer>5</answer>"]
    ro, _ = run(tok, pool, {}, lambda p, i, k: turns[k], [{"prompt": "3 + 4 - 2 =", "answer": "5"}], env=env)
    [t] = ro.trajectories
    assert t["tool_results"][0]["content"] == "5" and ro.per_reward["environment"].tolist() == [1.0]
    assert ro.texts == ["<answer>5</answer>"]


# ---------------------------------------------------------------------- configuration errors (CLI)
BAD = "def untyped(x):\n    return x\n\nclass NoReset:\n    pass\n"


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.tools=[nonexist.py:search]"], "rollout.tools[0]: tool file 'nonexist.py' not found"),
    (["rollout.tools=[posttrain.tools:nosuch]"], "rollout.tools[0]: tool 'nosuch' not found"),
    (["rollout.tools=[{tmp}/t.py:untyped]"], "rollout.tools[0]: tool"),
    (["rollout.environment={tmp}/t.py:NoReset"], "rollout.environment: environment class NoReset"),
    (["rollout.tools=[calculator]", "rollout.tool_format=xml"], "rollout.tool_format"),
    (["rollout.tools=[calculator]", "rollout.max_turns=0"], "rollout.max_turns must be >= 1"),
    (["rollout.tools=[nonexist.py:search]", "fleet.workers=2"], "rollout.tools[0]: tool file"),  # before Ray
])
def test_bad_agent_configs_are_one_line_errors(tmp_path, capsys, overrides, expected):
    """Through the CLI's entry point (in-process: the errors come before any model loads)."""
    from posttrain.cli.main import main

    (tmp_path / "t.py").write_text(BAD)
    args = ["rl", str(REPO / "configs/rl_smoke.yaml"), f"output_dir={tmp_path / 'out'}",
            f"data.train={REPO / 'tests/data/rl_prompts_tiny.jsonl'}", "data.eval=null",
            *(o.replace("{tmp}", str(tmp_path)) for o in overrides)]
    assert main(args) != 0
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, lines


def test_template_that_cannot_carry_tool_turns_is_a_config_error(tmp_path):
    """A chat template that is not prefix-preserving stops the set-up with one line naming the key."""
    from test_agent import NOT_PREFIX_PRESERVING, chatml_tokenizer

    from posttrain.agent.setup import build_agent
    from posttrain.config import ConfigError
    from posttrain.rl.config import RolloutConfig

    tok, stops = chatml_tokenizer(tmp_path, NOT_PREFIX_PRESERVING)
    with pytest.raises(ConfigError, match=r"^rollout.tools: chat template .* is not prefix-preserving") as e:
        build_agent(RolloutConfig(tools=["calculator"], stop_token_ids=stops), tok)
    assert "\n" not in str(e.value)
    env = RolloutConfig(environment="posttrain.agent.envs.guess_number:GuessNumber", stop_token_ids=stops)
    with pytest.raises(ConfigError, match=r"^rollout.environment: chat template"):
        build_agent(env, tok)


@pytest.mark.slow
def test_bad_reward_reference_is_one_line_from_the_command(tmp_path):
    """The `posttrain` command itself (tools and rewards share the loader): one line, no traceback."""
    for override, expected in (("rewards.functions=[{name: nonexist.py:fn}]", "reward file 'nonexist.py' not found"),):
        proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "rl", "configs/rl_smoke.yaml",
                               f"output_dir={tmp_path / 'out'}", override], capture_output=True, text=True,
                              cwd=REPO, timeout=300, check=False)
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        assert proc.returncode != 0 and len(lines) == 1 and expected in lines[0], proc.stderr


# ---------------------------------------------------------------------- RL end to end (real sampler, tiny model)
@pytest.fixture(scope="module")
def guess_cfg(tmp_path_factory):
    """Multi-turn RL on the guess-the-number `step` game with the tiny random model; many stop ids, so its turns
    are short and most trajectories have several turns with appended observations."""
    from posttrain.rl.loop import load_rl_config

    folder = tmp_path_factory.mktemp("guess")
    with open(folder / "guess.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": "guess", "secret": 10 + i, "max_guesses": 4}) + "\n")

    def cfg(name, *overrides):
        return load_rl_config(None, [
            f"output_dir={folder / name}", "model.path=tiny:llama", f"data.train={folder / 'guess.jsonl'}",
            f"data.eval={folder / 'guess.jsonl'}", "data.eval_limit=2",
            "rollout.batch_prompts=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            f"rollout.stop_token_ids=[{', '.join(str(i) for i in range(2, 60))}]",
            "rollout.environment=posttrain.agent.envs.guess_number:GuessNumber", "rollout.max_turns=4",
            "rollout.max_total_tokens=160", "rewards.functions=[]", "rewards.correctness=environment",
            "rewards.num_workers=0", "optim.lr=1e-3", "trainer.save_every=0", "trainer.progress=false",
            "eval.at_start=false", "trainer.log_every=1", "eval.log_samples=4", *overrides])
    return cfg


@pytest.mark.slow
def test_multi_turn_rl_token_in_token_out_and_exact_resume(guess_cfg, tok):
    """Every trajectory of a multi-turn RL run: the sampler's tokens and log-probs are the buffer's (checked per
    trajectory by the driver, which raises otherwise), the appended tokens decode to the environment's
    observations, the loss mask is 1 exactly on sampled tokens; agent metrics logged; a run stopped after step
    2 and resumed gives the same losses as one that ran through."""
    from posttrain.rl.loop import run_rl

    overrides = ("trainer.max_steps=3", "trainer.save_every=2", "trainer.async_checkpointing=false")
    full = run_rl(guess_cfg("full", *overrides))
    rows = [json.loads(x) for x in open(full.output_dir / "trajectories.jsonl")]
    assert len(rows) == 3 * 4
    samples = [json.loads(x) for x in open(full.output_dir / "samples.jsonl")]
    train = [s for s in samples if s["kind"] == "train"]  # one a logged step: the step's first trajectory
    assert [s["messages"] for s in train] == [rows[4 * k]["messages"] for k in range(3)]
    assert all(s["completion"] == next(m["content"] for m in reversed(s["messages"]) if m["role"] == "assistant")
               for s in train)
    multi = [r for r in rows if r["turns"] > 1]
    assert len(multi) >= 3, [r["turns"] for r in rows]
    for r in rows:
        mask = r["loss_mask"]
        assert len(mask) == len(r["token_ids"]) == len(r["logprobs"]) and mask[0] == 1
        assert all((p is None) == (m == 0) for p, m in zip(r["logprobs"], mask))
        observations = [m["content"] for m in r["messages"][1:] if m["role"] == "user"]
        runs = [(m, [t for _, t in g]) for m, g in groupby(zip(mask, r["token_ids"]), key=lambda x: x[0])]
        appended = [(ids, runs[k - 1][1][-1]) for k, (m, ids) in enumerate(runs) if m == 0]
        assert len(appended) == len(observations) == r["turns"] - 1
        for (ids, last), o in zip(appended, observations):  # the template's <eos> unless the model wrote it
            expected = ("" if last == tok.eos_token_id else "<eos>") + f"<|user|>{o}<eos><|assistant|>"
            assert tok.decode(ids, skip_special_tokens=False) == expected
        assert r["finish_reason"] in ("stop", "length", "truncated", "max_turns")
    for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_errors", "agent/tool_seconds",
                "agent/truncated_frac", "reward/environment"):
        assert key in full.history[-1], key
    assert max(h["agent/turns_mean"] for h in full.history) > 1
    [final] = full.evals  # the held-out evaluation runs the same multi-turn rollout
    assert final["eval/turns_mean"] >= 1 and "eval/accuracy" in final

    cfg = guess_cfg("resumed", *overrides)
    first = run_rl(cfg, stop_after=2)
    assert first.steps == 2
    second = run_rl(cfg)
    np.testing.assert_allclose([h["loss"] for h in second.history], [h["loss"] for h in full.history[2:]],
                               rtol=0, atol=1e-6)
    assert [h["agent/turns_mean"] for h in second.history] == [h["agent/turns_mean"] for h in full.history[2:]]


@pytest.mark.slow
def test_generate_runs_the_multi_turn_rollout(tmp_path):
    """`posttrain generate --environment ...`: each output line holds the trajectory (messages, turns, the loss
    mask over the ids after the prompt); `--tools` with a bad reference is a one-line error before any model
    loads."""
    from posttrain.cli.main import main

    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"prompt": "guess", "secret": 5, "max_guesses": 3}) + "\n")
    assert main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(out),
                 "--environment", "posttrain.agent.envs.guess_number:GuessNumber", "--max-new-tokens", "8",
                 "--n", "2", "--no-progress"]) == 0
    rows = [json.loads(x) for x in open(out)]
    assert len(rows) == 2
    for r in rows:
        assert r["messages"][0]["content"].startswith("I am thinking of a whole number")
        assert len(r["loss_mask"]) == len(r["token_ids"]) and r["turns"] >= 1
        assert r["text"] == [m for m in r["messages"] if m["role"] == "assistant"][-1]["content"]
    assert main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(out),
                 "--tools", "nonexist.py:f"]) == 2
