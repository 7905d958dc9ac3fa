"""`posttrain generate` run in-process: prompts and chat messages in, completions out; input errors name the line."""

from __future__ import annotations

import json

import pytest

from posttrain.cli.main import main


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """One POSTTRAIN_CACHE for the module, so `tiny:llama` is built once."""
    return str(tmp_path_factory.mktemp("tiny-cache"))


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_generate_writes_one_line_per_completion(tmp_path, monkeypatch, capsys, tiny_cache):
    monkeypatch.setenv("POSTTRAIN_CACHE", tiny_cache)
    prompts = _write(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "2+2="}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"prompt": "hello", "id": 7}),
    ])
    out = tmp_path / "out" / "c.jsonl"
    rc = main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(out),
               "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--n", "2", "--seed", "3",
               "--chat"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, i) for p in range(3) for i in range(2)]
    for r in rows:
        assert set(r) == {"prompt_index", "sample_index", "text", "token_ids", "logprobs", "finish_reason"}
        assert 1 <= len(r["token_ids"]) <= 6 and len(r["logprobs"]) == len(r["token_ids"])
        assert r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str)
        assert all(lp <= 0 for lp in r["logprobs"])
    # same seed, same output; greedy without --chat works too
    out2 = tmp_path / "c2.jsonl"
    assert main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(out2),
                 "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--n", "2", "--seed", "3",
                 "--chat", "--no-progress"]) == 0
    assert out2.read_text() == out.read_text()
    assert main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(out2),
                 "--max-new-tokens", "6", "--temperature", "0", "--n", "2", "--no-progress"]) == 0
    greedy = [json.loads(line) for line in out2.read_text().splitlines()]
    assert len(greedy) == 6 and greedy[0]["token_ids"] == greedy[1]["token_ids"]


def test_generate_writes_json_lines_to_standard_output(tmp_path, monkeypatch, capsys, tiny_cache):
    """`--output -` and no `--output`: the JSON lines on standard output (the same as a file's), no file named `-`;
    the summary line goes to standard error."""
    monkeypatch.setenv("POSTTRAIN_CACHE", tiny_cache)
    monkeypatch.chdir(tmp_path)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "2+2="}), json.dumps({"prompt": "hi"})])
    common = ["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--max-new-tokens", "5", "--n", "2"]
    printed = []
    for flags in (["--output", "-"], []):
        assert main([*common, *flags]) == 0
        out, err = capsys.readouterr()
        rows = [json.loads(x) for x in out.splitlines()]
        assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(set(r) == {"prompt_index", "sample_index", "text", "token_ids", "logprobs", "finish_reason"}
                   for r in rows)
        assert "wrote 4 completions to standard output" in err
        printed.append(out)
    assert printed[0] == printed[1] and not (tmp_path / "-").exists()


def test_a_budget_past_the_context_is_cut_with_a_note(tmp_path, monkeypatch, capsys, tiny_cache):
    """`--max-new-tokens` larger than the room the context leaves (here a 16-token cache) is cut to it, said on
    stderr; no error (a small model's context, e.g. the demo's 256, is below the commands' default budgets)."""
    monkeypatch.setenv("POSTTRAIN_CACHE", tiny_cache)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "2+2="}), json.dumps({"prompt": "1+11+3="})])
    assert main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--max-len", "16",
                 "--max-new-tokens", "64", "--temperature", "0", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "generate: --max-new-tokens 64 cut to 9: the model's context holds 16 tokens and the longest prompt has 7" \
        in err
    assert all(len(json.loads(x)["token_ids"]) <= 9 for x in out.splitlines())


@pytest.mark.parametrize("lines,expected", [
    # a line that ends too early: the column just past its last character (json's own says column 1 of a next line)
    (['{"prompt": "a"}', '{"prompt": "b"', '{"prompt": "c"}'], r"p\.jsonl, line 2: not valid JSON \(Expecting "
                                                               r"',' delimiter, column 15\)"),
    (['{"prompt": "a", oops}'], r"p\.jsonl, line 1: not valid JSON \(.*, column 17\)"),
    (['{"prompt": "a"}', '', '{"text": "b"}'], r"p\.jsonl, line 3: has neither a `prompt`"),
    (['["a"]'], r"p\.jsonl, line 1: expected a JSON object"),
    (['{"messages": "hi"}'], r"p\.jsonl, line 1: `messages` must be a list"),
])
def test_bad_prompts_file(lines, expected, tmp_path, capsys):
    import re

    prompts = _write(tmp_path / "p.jsonl", lines)
    rc = main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 1 and re.search(expected, err), err
    assert str(prompts) in err
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_sampling_flag(tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", ['{"prompt": "a"}'])
    rc = main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"),
               "--top-p", "1.5"])
    assert rc == 1 and "top_p=1.5" in capsys.readouterr().err


def test_too_long_prompt_names_the_line(tmp_path, monkeypatch, capsys, tiny_cache):
    monkeypatch.setenv("POSTTRAIN_CACHE", tiny_cache)
    prompts = _write(tmp_path / "p.jsonl", ['{"prompt": "a"}', json.dumps({"prompt": "x" * 2100})])
    rc = main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"),
               "--max-new-tokens", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "p.jsonl, line 2: prompt 1 has 2100 tokens" in err, err


def test_prompts_from_stdin_equal_the_file_and_errors_name_stdin(tmp_path, monkeypatch, capsys, tiny_cache):
    """`--prompts -` reads standard input: the same completions as the same lines from a file."""
    import io

    monkeypatch.setenv("POSTTRAIN_CACHE", tiny_cache)
    lines = [json.dumps({"prompt": "2+2="}), json.dumps({"messages": [{"role": "user", "content": "hi"}]})]
    prompts = _write(tmp_path / "p.jsonl", lines)
    common = ["--model", "tiny:llama", "--max-new-tokens", "5", "--n", "2", "--seed", "1", "--chat", "--no-progress"]
    assert main(["generate", "--prompts", str(prompts), "--output", str(tmp_path / "f.jsonl"), *common]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(x + "\n" for x in lines)))
    assert main(["generate", "--prompts", "-", "--output", str(tmp_path / "s.jsonl"), *common]) == 0
    assert (tmp_path / "s.jsonl").read_text() == (tmp_path / "f.jsonl").read_text()
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": "a"}\n{"prompt": \n'))
    assert main(["generate", "--prompts", "-", "--output", str(tmp_path / "e.jsonl"), *common]) == 1
    assert "<stdin>, line 2: not valid JSON" in capsys.readouterr().err


def test_every_sampling_command_has_the_same_model_help():
    """generate, eval, chat and info take the same kinds of checkpoint (`posttrain.models.spec`), described by one help
    text, and the same prompt-style flags (info aside)."""
    from posttrain.cli.main import build_parser
    from posttrain.cli.model_arg import MODEL_HELP

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("generate", "eval", "chat", "info"):
        helps = [a.help for a in sub.choices[name]._actions if "--model" in a.option_strings or a.dest == "model"]
        assert helps == [MODEL_HELP], (name, helps)
    for name in ("generate", "eval", "chat"):
        flags = {f for a in sub.choices[name]._actions for f in a.option_strings}
        assert {"--chat", "--no-chat", "--system-prompt"} <= flags, name
    assert ".gguf" in MODEL_HELP and "pypi:" in MODEL_HELP
