"""A model's prompt format travels with its export (`posttrain.models.prompt_format`): what each training command's data
records, how config.json carries it (transformers keeps it), and how `generate`, `eval` and `chat` default to it
(flags override it); a run's output folder is a model spec for every command (`posttrain.models.spec`)."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from posttrain.cli.main import main
from posttrain.models.prompt_format import PromptStyle, config_block, prompt_style, read_prompt_style, trained_style

CHAT = [{"role": "user", "content": "2+2="}]
SYSTEM = [{"role": "system", "content": "Be brief."}, *CHAT]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny:llama checkpoint (built once for the module)."""
    from posttrain.models.tiny import resolve_model_path

    return resolve_model_path("tiny:llama", cache_dir=tmp_path_factory.mktemp("tiny-cache"))


def _with_style(src, dst, style: PromptStyle | None):
    """A copy of checkpoint `src` whose config.json records `style` (None: records nothing)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("posttrain", None)
    (dst / "config.json").write_text(json.dumps(cfg | (config_block(style) if style else {})))
    return dst


@pytest.mark.parametrize("prompts,kw,expected", [
    (["7+15+9=", "1+2="], {}, PromptStyle(chat=False)),  # raw text prompts (the demo's)
    ([CHAT, CHAT], {}, PromptStyle(chat=True)),  # message lists go through the template
    ([SYSTEM, SYSTEM], {}, PromptStyle(chat=True, system_prompt="Be brief.")),  # the system turn they all share
    ([SYSTEM, CHAT], {}, PromptStyle(chat=True)),  # no common system turn: none recorded
    (["a", "b"], {"chat": True, "system_prompt": "S"}, PromptStyle(chat=True, system_prompt="S")),  # data.chat
    ([CHAT, "raw", "raw"], {}, PromptStyle(chat=False)),  # the majority decides
    ([None, None], {}, PromptStyle(chat=False)),  # plain texts: no prompt, raw
])
def test_trained_style_of_a_training_set(prompts, kw, expected):
    assert trained_style(prompts, **kw) == expected


def test_sft_and_preference_data_record_their_style():
    from posttrain.data.formats import DataFormatConfig, records_prompt_style
    from posttrain.data.preference import PreferenceFormat
    from posttrain.data.preference import prompt_style as preference_style

    assert records_prompt_style([{"prompt": "1+1=", "completion": "2"}]) == PromptStyle(chat=False)
    assert records_prompt_style([{"messages": [*SYSTEM, {"role": "assistant", "content": "4"}]}]) == \
        PromptStyle(chat=True, system_prompt="Be brief.")
    assert records_prompt_style([{"prompt": CHAT, "completion": "4"}]) == PromptStyle(chat=True)
    assert records_prompt_style([{"text": "7+15=22"}], DataFormatConfig(format="text")) == PromptStyle(chat=False)
    pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]
    assert preference_style(pairs, PreferenceFormat()) == PromptStyle(chat=False)
    assert preference_style(pairs, PreferenceFormat(chat=True, system_prompt="S")) == PromptStyle(True, "S")
    implicit = [{"chosen": [*CHAT, {"role": "assistant", "content": "4"}],
                 "rejected": [*CHAT, {"role": "assistant", "content": "5"}]}]
    assert preference_style(implicit, PreferenceFormat()) == PromptStyle(chat=True)


def test_the_export_carries_the_style_and_transformers_keeps_it(tiny, tmp_path):
    """save_pretrained writes the block; our loader and transformers' read the folder as before, and transformers
    writes the block back when it saves the config again."""
    import transformers

    from posttrain.models import from_pretrained, load_config, save_pretrained

    style = PromptStyle(chat=False, system_prompt=None)
    out = save_pretrained(from_pretrained(tiny), tmp_path / "hf", prompt_style=style)
    assert json.loads((out / "config.json").read_text())["posttrain"] == {
        "prompt_format": {"chat_template": False, "system_prompt": None}}
    assert read_prompt_style(out) == style and read_prompt_style(tiny) is None
    assert load_config(out)[1] == load_config(tiny)[1]
    cfg = transformers.AutoConfig.from_pretrained(out)
    cfg.save_pretrained(tmp_path / "again")
    assert read_prompt_style(tmp_path / "again") == style


def test_flags_win_then_the_export_then_the_command_default(tiny, tmp_path):
    raw = _with_style(tiny, tmp_path / "raw", PromptStyle(chat=False))
    sys_chat = _with_style(tiny, tmp_path / "sys", PromptStyle(chat=True, system_prompt="Be brief."))
    assert prompt_style(raw, default_chat=True) == PromptStyle(chat=False)
    assert prompt_style(raw, chat=True, default_chat=True) == PromptStyle(chat=True)
    assert prompt_style(sys_chat, default_chat=False) == PromptStyle(chat=True, system_prompt="Be brief.")
    assert prompt_style(sys_chat, system_prompt="", default_chat=False) == PromptStyle(chat=True)  # '' = none
    assert prompt_style(sys_chat, chat=False, system_prompt="X", default_chat=False) == PromptStyle(False, "X")
    assert prompt_style(tiny, default_chat=True) == PromptStyle(chat=True)  # records nothing: the default
    assert prompt_style(tiny, default_chat=False) == PromptStyle(chat=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text('{"posttrain": {"prompt_format": "chat"}}')
    assert read_prompt_style(tmp_path / "junk") is None and read_prompt_style(tmp_path / "none") is None


def test_generate_prompts_as_the_export_says_unless_told(tiny, tmp_path, capsys):
    """A checkpoint recording the chat template: `generate` renders text prompts through it with no flag (the same
    completions as `--chat` on the same weights recording nothing); `--no-chat` gives the raw prompt's."""
    chat_model = _with_style(tiny, tmp_path / "chat", PromptStyle(chat=True))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "2+2="}) + "\n")

    def texts(model, *flags):
        capsys.readouterr()
        assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "6",
                     "--temperature", "0", "--no-progress", *flags]) == 0
        return [json.loads(x)["text"] for x in capsys.readouterr().out.splitlines()]

    assert texts(chat_model) == texts(tiny, "--chat")
    assert texts(chat_model, "--no-chat") != texts(chat_model)  # the raw prompt: another greedy completion


def test_chat_prompts_a_raw_model_with_each_line_alone_and_says_reset(tiny, tmp_path, monkeypatch, capsys):
    """A model trained on raw prompts: each chat line is its raw prompt, answered on its own (a greedy reply equals
    the sampler's on the line's tokens, on the second line too); `/reset` says that it reset."""
    from posttrain.rollout.chat import Conversation
    from posttrain.rollout.policy import Policy
    from posttrain.sampling import SamplingParams

    raw = _with_style(tiny, tmp_path / "raw", PromptStyle(chat=False))
    policy = Policy.open(str(raw), max_slots=1, default_chat=True)
    tok = policy.tokenizer
    assert policy.style == prompt_style(raw, default_chat=True)
    chat = Conversation(policy, SamplingParams(max_new_tokens=6, temperature=0.0), style=policy.style)
    assert chat.raw
    chat.reply("1+1=")
    second = chat.reply("2+2=")[0]["content"]
    alone = policy.sampler.generate([tok.encode("2+2=")], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert second == alone.text

    # a line longer than the model's context (2048) is that turn's one-line error; the next line is answered
    monkeypatch.setattr("sys.stdin", io.StringIO("2+2=\n/reset\n" + "1" * 2100 + "\n2+2=\n"))
    capsys.readouterr()
    assert main(["chat", str(raw), "--max-new-tokens", "6", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "raw prompts: each line is answered on its own" in err and "reset: a new conversation starts" in err
    assert "error: turn 1: the line has 2100 tokens; the model's context holds 2048\n" in err
    assert out == f"{second}\n{second}\n"


def test_a_run_folder_is_a_model_for_info_and_its_missing_export_is_one_line(tiny, tmp_path, capsys):
    from posttrain.models.spec import resolve_checkpoint

    run = tmp_path / "run"
    _with_style(tiny, run / "hf", PromptStyle(chat=False))
    (run / "config.yaml").write_text("output_dir: run\n")
    assert resolve_checkpoint(run) == run / "hf" and resolve_checkpoint(run / "hf") == run / "hf"
    capsys.readouterr()
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "raw prompt" in out
    (tmp_path / "unfinished" / "checkpoints").mkdir(parents=True)
    assert main(["info", str(tmp_path / "unfinished")]) != 0
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path / 'unfinished'} is a run's output folder with no hf/ export (the run has not " \
                  "finished, or its export_hf is off)"
