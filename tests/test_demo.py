"""A reduced `posttrain demo` through the CLI: every file is written, summary.json agrees with the metrics logs,
and the final checkpoint loads in `transformers` with the same greedy answers as ours on 20 held-out problems; its
model answers alike in `chat`, `generate` and `eval` (the prompt format its export records), and its run folder is a
model for `info`."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posttrain.demo.run import DemoSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reduced_demo(tmp_path_factory):
    """`posttrain demo --reduced --seed 1`, run once for the module: (its output folder, what it printed)."""
    from posttrain.cli.main import main

    out = tmp_path_factory.mktemp("reduced") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--output-dir", str(out), "--seed", "1", "--reduced"]) == 0  # `posttrain demo`
    return out, printed.getvalue()


@pytest.mark.slow
def test_reduced_demo_plumbing(reduced_demo):
    import torch
    import transformers

    out, printed = reduced_demo
    assert "held-out accuracy" in printed
    s = DemoSettings.reduced()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seed"] == 1 and summary["final_checkpoint"] == str(out / "rl" / "hf")
    assert [st["name"] for st in summary["stages"]] == ["init", "sft", "rl"]
    for st in summary["stages"]:
        assert math.isfinite(st["accuracy"]) and 0 <= st["accuracy"] <= 1
        assert math.isfinite(st["mean_reward"]) and math.isfinite(st["seconds"])
    for f in ("sft.yaml", "rl.yaml", "demo.png", "sft/metrics.jsonl", "rl/metrics.jsonl", "rl/samples.jsonl",
              "sft/config.yaml", "rl/config.yaml", "rl/hf/config.json", "rl/hf/model.safetensors"):
        assert (out / f).exists(), f
    assert list((out / "sft" / "tensorboard").iterdir()) and list((out / "rl" / "tensorboard").iterdir())
    rows = [json.loads(line) for line in open(out / "rl" / "metrics.jsonl")]
    for r in rows:
        assert all(not isinstance(v, float) or math.isfinite(v) for v in r.values())
    sft_rows = [json.loads(line) for line in open(out / "sft" / "metrics.jsonl")]
    assert sft_rows[-1]["step"] == s.sft_steps and all(math.isfinite(r["loss"]) for r in sft_rows)

    # metrics.jsonl agrees with the summary: one training row per RL step, held-out rows every
    # rl_eval_every steps and at the end, and the last of these (greedy, the final weights, the same
    # held-out problems) is what the summary reports for the RL stage's exported checkpoint.
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, s.rl_steps + 1))
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [*range(s.rl_eval_every, s.rl_steps, s.rl_eval_every), s.rl_steps]
    assert all(r["eval/num_prompts"] == s.n_eval for r in evals)
    rl_stage = summary["stages"][2]
    print("\ndemo stages:", [(st["name"], st["accuracy"], st["mean_reward"]) for st in summary["stages"]],
          "eval rows:", [(r["step"], r["eval/accuracy"]) for r in evals])
    assert rl_stage["accuracy"] == pytest.approx(evals[-1]["eval/accuracy"], abs=1e-9)
    assert rl_stage["mean_reward"] == pytest.approx(evals[-1]["eval/reward_mean"], abs=1e-6)

    # the final checkpoint in transformers: same greedy answers as ours on 20 held-out problems
    from posttrain.models import tokenizer as tok_lib
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    hf_dir = out / "rl" / "hf"
    tok = tok_lib.load(hf_dir)
    problems = [json.loads(x)["prompt"] for x in open(out / "data" / "heldout.jsonl")][:20]
    prompts = [tok.encode(p) for p in problems]
    ours = Sampler(from_pretrained(hf_dir), tok).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    for p, c in zip(prompts, ours):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_ids,
                            pad_token_id=tok.pad_token_id)
        theirs = g[0, len(p):].tolist()
        np.testing.assert_array_equal(c.token_ids, theirs[: len(c.token_ids)])
        assert len(theirs) == len(c.token_ids) or c.finish_reason == "stop"


@pytest.mark.slow
def test_the_demo_model_answers_alike_in_chat_generate_and_eval(reduced_demo, tmp_path, capsys):
    """The demo trains on raw prompts and its exports say so: `posttrain chat` on the RL run (standard input, greedy)
    answers 5 held-out problems with the text `generate --output -` writes and `eval` scores, no flag needed."""
    from posttrain.cli.main import main
    from posttrain.models.prompt_format import PromptStyle, read_prompt_style

    out, _ = reduced_demo
    assert read_prompt_style(out / "sft" / "hf") == read_prompt_style(out / "rl" / "hf") == PromptStyle(chat=False)
    heldout = [json.loads(x) for x in (out / "data" / "heldout.jsonl").read_text().splitlines()][:5]
    budget = ["--max-new-tokens", "32", "--temperature", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    chat = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "chat", str(out / "rl" / "hf"), *budget],
                          input="".join(r["prompt"] + "\n" for r in heldout), capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert chat.returncode == 0, chat.stderr
    assert "raw prompts" in chat.stderr

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in heldout))
    capsys.readouterr()
    assert main(["generate", "--model", str(out / "rl"), "--prompts", str(prompts), "--output", "-", *budget,
                 "--no-progress"]) == 0
    generated = [json.loads(x)["text"] for x in capsys.readouterr().out.splitlines()]
    assert chat.stdout == "".join(t + "\n" for t in generated)  # one reply per line, the same greedy text

    assert main(["eval", "--model", str(out / "rl"), "--data", str(out / "data" / "heldout.jsonl"), "--limit", "5",
                 "--n", "0", "--max-new-tokens", "32", "--reward-workers", "0", "--no-progress",
                 "--output", str(tmp_path / "eval.jsonl")]) == 0
    scored = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["greedy"]["text"] for r in scored] == generated
    with capsys.disabled():
        print("\nthe demo's RL model on 5 held-out problems:", list(zip([r["prompt"] for r in heldout], generated)))

    capsys.readouterr()
    assert main(["info", str(out / "rl")]) == 0  # the run folder, as generate and eval take it
    assert "raw prompt" in capsys.readouterr().out


@pytest.mark.slow
def test_reduced_tools_demo_plumbing(tmp_path, capsys):
    """`posttrain demo --task tools --reduced`: tool-use SFT then multi-turn RL with the calculator; every
    file written, trajectories logged with their token buffers, tool calls counted in the summary."""
    from posttrain.cli.main import main
    from posttrain.demo.tools_run import ToolsDemoSettings

    out = tmp_path / "demo_tools"
    assert main(["demo", "--task", "tools", "--output-dir", str(out), "--seed", "1", "--reduced"]) == 0
    assert "tool calls per trajectory" in capsys.readouterr().out
    s = ToolsDemoSettings.reduced()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "tools" and [st["name"] for st in summary["stages"]] == ["init", "sft", "rl"]
    assert all(0 <= st["accuracy"] <= 1 and st["tool_calls"] >= 0 for st in summary["stages"])
    for f in ("sft.yaml", "rl.yaml", "demo_tools.png", "rl/trajectories.jsonl", "rl/hf/config.json"):
        assert (out / f).exists(), f
    sft_rows = [json.loads(line) for line in open(out / "data" / "sft_train.jsonl")]
    assert any(len(r["messages"]) == 4 for r in sft_rows) and any(len(r["messages"]) == 2 for r in sft_rows)
    rows = [json.loads(line) for line in open(out / "rl" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "agent/tool_calls_mean" in r] == list(range(1, s.rl_steps + 1))
    t = json.loads(open(out / "rl" / "trajectories.jsonl").readline())
    assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"])


def test_tools_demo_call_tokens_parse_and_match_the_rollout_buffer(tmp_path):
    """The tools demo's tokenizer makes the calculator call 11 tokens (tags and the fixed JSON around the
    expression are added tokens); its text still parses with the Hermes parser, and a multi-turn rollout that
    samples the demonstration's turns builds exactly the token ids SFT trains on (loss mask on the model's turns)."""
    import random

    from posttrain.agent.parsers import parse_tool_calls
    from posttrain.agent.rollout import Agent, AgentRollout
    from posttrain.data.formats import DataFormatConfig, encode_record
    from posttrain.demo.tools_task import build_tools_tokenizer, make_problem, sft_records
    from posttrain.sampling.params import Completion, TurnEnd
    from posttrain.tools import load_tools

    tok = build_tools_tokenizer(tmp_path / "tok")
    p = make_problem(random.Random(3), use_tool=True)
    a, b = p["prompt"][:-1].split("*")
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
    call_ids = tok.encode(call, add_special_tokens=False)
    assert len(call_ids) == 11 and tok.decode(call_ids, skip_special_tokens=False) == call
    parsed = parse_tool_calls(call, "hermes")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": f"{a}*{b}"})]

    example = encode_record(sft_records([p])[0], tok, DataFormatConfig(format="messages"))
    answer_ids = tok.encode(f"#### {p['answer']}", add_special_tokens=False)
    agent = Agent(tok, tools=load_tools(["calculator"]))
    try:
        prompt = agent.prompt_ids(agent.first_messages({"prompt": p["prompt"]}))
        rollout = AgentRollout(agent, [{"prompt": p["prompt"]}], [prompt])
        ids, mask = [], []
        for k, turn in enumerate([call_ids + [tok.eos_token_id], answer_ids + [tok.eos_token_id]]):
            more = rollout(TurnEnd(0, 0, k, turn, [-0.5] * len(turn), None, "stop", 1000, len(prompt) + len(ids)))
            more = more.result(timeout=30) if hasattr(more, "result") else more
            ids, mask = ids + turn + (more or []), mask + [1] * len(turn) + [0] * len(more or [])
        traj = rollout.finished(Completion(0, 0, ids, [-0.5 if m else 0.0 for m in mask], None, "stop", "",
                                           mask=mask, turns=2))
    finally:
        agent.close()
    assert traj.buffer.ids == example.input_ids.tolist()
    assert traj.buffer.loss_mask[1:] == example.loss_mask[1:].astype(int).tolist()
    assert traj.tool_results[0]["content"] == p["answer"] and traj.final_text == f"#### {p['answer']}"
