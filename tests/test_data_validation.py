"""Data that cannot train, or is malformed, says so: SFT rows too long for `data.seq_len` are counted and warned
about (one line), and when all are the run stops with one `error:` line naming `data.seq_len` and the longest
row; `tool_calls` entries are validated (function name, arguments an object or JSON text of one) with the file and
line; RL with an environment reads records without `prompt` (its `reset` makes the conversation) and falls back to
`messages` as `posttrain eval` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_agent_rollout import REPO, run

from posttrain.agent import load_environment
from posttrain.data import DataError, build_sft_dataset, read_prompts
from posttrain.data.pipeline import too_long_warning
from posttrain.tools import ToolPool
from posttrain.tools.demonstrations import calculator_conversation

SHORT = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}


def _tool_record(i: int) -> dict:
    return calculator_conversation({"prompt": f"What is {i} + 2 =", "answer": str(i + 2)}, use_tool=True)


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tok():
    from posttrain.models.tiny import resolve_model_path
    from posttrain.models.tokenizer import load as load_tokenizer

    return load_tokenizer(resolve_model_path("tiny:llama"))


# ---------------------------------------------------------------------- SFT rows longer than data.seq_len
def test_all_rows_too_long_is_one_error_from_the_command(tmp_path, capsys):
    """Tool-call SFT data with configs/sft_smoke.yaml (seq_len 64): the tools section alone is longer than a row,
    so no row has a token to train on: one `error:` line naming data.seq_len and the longest row, before any
    model loads (it used to train on nothing and report loss 0.0000)."""
    from posttrain.cli.main import main

    data = _write(tmp_path / "tools.jsonl", [_tool_record(i) for i in range(4)])
    code = main(["--no-compile-cache", "sft", str(REPO / "configs/sft_smoke.yaml"), f"data.train={data}",
                 "data.eval=null", f"output_dir={tmp_path / 'out'}", "trainer.progress=false"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: data set '{data}': all 4 examples are longer than data.seq_len=64 (the "
                             "longest has "), err[0]


def test_some_rows_too_long_are_counted_and_warned_about(tok, tmp_path):
    data = _write(tmp_path / "mixed.jsonl", [SHORT, _tool_record(1), SHORT, _tool_record(2), SHORT])
    ds = build_sft_dataset(str(data), tok, seq_len=64, batch_size=2)
    assert ds.stats["num_too_long"] == 2 and ds.stats["num_packed"] == 3 and ds.stats["longest"] > 64
    warning = too_long_warning(ds.stats, 64)
    assert warning == (f"2 of 5 examples are longer than data.seq_len=64 with nothing to train on within it and "
                       f"were skipped (the longest has {ds.stats['longest']} tokens)")
    long_enough = build_sft_dataset(str(data), tok, seq_len=2048, batch_size=2)
    assert long_enough.stats["num_too_long"] == 0 and too_long_warning(long_enough.stats, 2048) is None


@pytest.mark.slow
def test_sft_command_warns_about_skipped_rows(tok, tmp_path, capsys):
    """The run itself prints the warning, once, and trains on the rows that fit."""
    from posttrain.cli.main import main
    from posttrain.data.formats import encode_record

    data = _write(tmp_path / "mixed.jsonl", [SHORT, _tool_record(1)] * 4)
    code = main(["--no-compile-cache", "sft", str(REPO / "configs/sft_smoke.yaml"), f"data.train={data}",
                 "data.eval=null", f"output_dir={tmp_path / 'out'}", "trainer.max_steps=1", "trainer.grad_accum=1",
                 "data.batch_size=2", "trainer.save_every=0", "trainer.progress=false", "export_hf=false"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [x for x in out if x.startswith("warning:")] == [
        "warning: data.train: 4 of 8 examples are longer than data.seq_len=64 with nothing to train on within it and "
        f"were skipped (the longest has {len(encode_record(_tool_record(1), tok))} tokens)"]


# ---------------------------------------------------------------------- malformed tool_calls
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}


@pytest.mark.parametrize("call, why", [
    ({"type": "function", "function": {"name": "calculator"}}, r"tool call 0 \(calculator\): no 'arguments'"),
    ({"type": "function", "id": "call_1"}, "tool call 0 must have a function name"),
    ({"type": "function", "function": {"name": "", "arguments": {}}}, "tool call 0 must have a function name"),
    ({"function": {"name": "calculator", "arguments": "{oops"}}, r"tool call 0 \(calculator\): arguments are not JSON"),
    ({"function": {"name": "calculator", "arguments": "[1]"}}, r"tool call 0 \(calculator\): arguments must be an"),
    ({"function": {"name": "calculator", "arguments": ""}}, r"tool call 0 \(calculator\): arguments are not JSON"),
])
def test_malformed_tool_calls_name_the_file_and_line(tok, tmp_path, call, why):
    bad = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": "calculator", "content": "3"},
                        {"role": "assistant", "content": "3"}]}
    data = _write(tmp_path / "calls.jsonl", [SHORT, SHORT, bad])
    with pytest.raises(DataError, match=rf"^{data}, line 3: message 1: {why}") as e:
        build_sft_dataset(str(data), tok, seq_len=512, batch_size=2)
    assert "\n" not in str(e.value)


def test_well_formed_tool_calls_pass(tok, tmp_path):
    """Arguments as an object or as JSON text of one, the OpenAI and the bare `{name, arguments}` forms."""
    calls = [CALL, {"function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}},
             {"name": "calculator", "arguments": {"expression": "1+2"}}]
    records = [{"messages": [{"role": "user", "content": "1+2="},
                             {"role": "assistant", "content": "", "tool_calls": [c]},
                             {"role": "tool", "name": "calculator", "content": "3"},
                             {"role": "assistant", "content": "3"}]} for c in calls]
    ds = build_sft_dataset(str(_write(tmp_path / "ok.jsonl", records)), tok, seq_len=512, batch_size=2)
    assert ds.stats["num_packed"] == 3


# ---------------------------------------------------------------------- RL prompts: optional with an environment
def test_environment_records_without_prompt(tok, tmp_path):
    """The guess-the-number example's own records (`{"secret": n}`, no prompt) are read with an environment; its
    `reset` makes the conversation, which the rewards see as the prompt. Without one, the missing field is the
    usual error naming file and line."""
    data = _write(tmp_path / "guess.jsonl", [{"secret": 37}, {"secret": 5, "max_guesses": 2}])
    records = read_prompts(str(data), optional=True, fallback=True)
    assert records.prompt_field is None and list(records) == [{"secret": 37}, {"secret": 5, "max_guesses": 2}]
    with pytest.raises(DataError, match=rf"^{data}, line 1: the record has no field 'prompt'"):
        read_prompts(str(data), fallback=True)
    env = load_environment("posttrain.agent.envs.guess_number:GuessNumber")
    guesses = ["50", "25", "37"]
    pool = ToolPool(num_workers=1)
    try:
        ro, _ = run(tok, pool, {}, lambda p, i, k: guesses[k], list(records), env=env)
    finally:
        pool.close()
    assert ro.prompts_text[0].startswith("I am thinking of a whole number from 1 to 100")
    assert ro.per_reward["environment"].tolist() == [1.0, 0.0] and ro.finish_reasons == ["stop", "stop"]


def test_prompt_field_falls_back_to_messages_as_eval_does(tmp_path):
    messages = [{"role": "user", "content": "What is 2 times 3?"}]
    data = _write(tmp_path / "m.jsonl", [{"messages": messages, "answer": "6"}])
    records = read_prompts(str(data), fallback=True)
    assert records.prompt_field == "messages" and records[0] == {"prompt": messages, "answer": "6"}
    from posttrain.eval.run import EvalConfig, _records

    assert _records(EvalConfig(data=str(data))).prompt_field == "messages"
    guess = _write(tmp_path / "g.jsonl", [{"secret": 3}])
    env = "posttrain.agent.envs.guess_number:GuessNumber"
    assert _records(EvalConfig(data=str(guess), environment=env)).prompt_field is None
    with pytest.raises(DataError, match="none of the prompt fields"):
        _records(EvalConfig(data=str(guess)))


@pytest.mark.slow
def test_rl_with_the_example_environment_and_its_own_data(tmp_path):
    """`posttrain rl` on GuessNumber with records that have no prompt runs a step (it used to stop at the data)."""
    from posttrain.rl.loop import load_rl_config, run_rl

    data = _write(tmp_path / "guess.jsonl", [{"secret": 10 + i, "max_guesses": 3} for i in range(4)])
    cfg = load_rl_config(None, [
        f"output_dir={tmp_path / 'out'}", "model.path=tiny:llama", f"data.train={data}", "data.eval=null",
        "rollout.batch_prompts=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        f"rollout.stop_token_ids=[{', '.join(str(i) for i in range(2, 60))}]",
        "rollout.environment=posttrain.agent.envs.guess_number:GuessNumber", "rollout.max_turns=3",
        "rewards.functions=[]", "rewards.correctness=environment", "rewards.num_workers=0", "trainer.max_steps=1",
        "trainer.save_every=0", "trainer.progress=false", "eval.at_start=false", "export_hf=false"])
    res = run_rl(cfg)
    assert res.steps == 1 and res.history[0]["agent/env_errors"] == 0.0
    rows = [json.loads(x) for x in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert rows and all(r["messages"][0]["content"].startswith("I am thinking") for r in rows)
