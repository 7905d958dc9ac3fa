"""First contact with the CLI: `--version`, `posttrain configs`, `posttrain chat` (piped stdin, multi-turn, tools)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import configs as configs_cli
from posttrain.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-cache"))


def test_version_prints_the_installed_version():
    from importlib import metadata

    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "--version"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"posttrain {metadata.version('posttrain')}"


def test_configs_lists_every_shipped_config_with_its_command_and_first_sentence(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shipped = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(lines) == len(shipped)
    for line, path in zip(lines, shipped):
        cmd = f"posttrain {configs_cli.command_of(path)} configs/{path.name}"
        about = configs_cli.description(path)
        assert line.startswith(cmd) and line.endswith(about) and about.endswith(".")  # whole sentences, not cut
        first_line = path.read_text().splitlines()[0].lstrip("#").strip()
        assert about.startswith(first_line)
    by_name = {p.name: configs_cli.command_of(p) for p in shipped}
    assert by_name["rl_smoke.yaml"] == "rl" and by_name["sft_smoke.yaml"] == "sft"
    assert by_name["dpo_smoke.yaml"] == "dpo" and by_name["distill_smoke.yaml"] == "distill"
    assert by_name["vlm_rl_smoke.yaml"] == "rl" and by_name["vlm_smoke.yaml"] == "sft"


def test_a_config_description_is_its_first_sentence_across_comment_lines(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("# LoRA SFT of a model (e.g. one H100 80 GB or a\n# TPU host). Then more.\n#   posttrain sft x.yaml\n"
                    "lr: 1\n")
    assert configs_cli.description(path) == "LoRA SFT of a model (e.g. one H100 80 GB or a TPU host)."
    path.write_text("# No full stop here:\n#   posttrain sft x.yaml\n")
    assert configs_cli.description(path) == "No full stop here:"
    path.write_text("lr: 1\n# late comment\n")
    assert configs_cli.description(path) == ""


def test_configs_in_an_empty_folder_is_a_one_line_error(tmp_path, capsys):
    assert main(["configs", "--dir", str(tmp_path)]) == 2  # a ConfigError: exit 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}: no configs there")


def test_user_turns_reads_the_non_empty_lines_of_piped_input():
    from posttrain.cli.chat import user_turns

    assert list(user_turns(io.StringIO("hi\n\n  \nsecond turn\n"))) == ["hi", "second turn"]


def _conversation(policy, images=()):
    from posttrain.rollout.chat import Conversation
    from posttrain.sampling import SamplingParams

    return Conversation(policy, SamplingParams(max_new_tokens=6, temperature=0.0), images=images)


def test_chat_is_multi_turn_through_the_chat_template(monkeypatch, tiny_cache):
    """The second turn's prompt is the template of the whole conversation: the first turn's prompt, the model's reply,
    the new user turn; a greedy reply equals the sampler's on that prompt."""
    monkeypatch.setenv("POSTTRAIN_CACHE", tiny_cache)
    from posttrain.rollout.policy import Policy
    from posttrain.sampling import SamplingParams

    policy = Policy.open("tiny:llama", max_slots=1)
    tok = policy.tokenizer
    chat = _conversation(policy)
    first = chat.reply("1+1=")
    assert [m["role"] for m in first] == ["assistant"]
    second = chat.reply("2+2=")
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == first[0]["content"]
    ids = tok.apply_chat_template(chat.messages[:3], add_generation_prompt=True, tokenize=True)
    again = policy.sampler.generate([list(ids)], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert second[0]["content"] == again.text
    chat.reset()
    assert chat.messages == [] and chat.reply("1+1=") == first  # greedy: the same reply after /reset


def test_chat_command_reads_stdin_and_prints_one_reply_per_turn(tmp_path, tiny_cache):
    env = {**__import__("os").environ, "POSTTRAIN_CACHE": tiny_cache}
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "chat", "tiny:llama", "--max-new-tokens", "4",
                          "--temperature", "0", "--tools", "calculator"],
                         input="1+1=\n\n2+2=\n/exit\nnot read\n", capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) <= 2 * 4 + 2  # two replies (a reply may hold newlines), nothing after /exit
    assert "posttrain chat: tiny:llama (tools: calculator)" in out.stderr


def test_chat_with_an_unknown_tool_fails_before_the_model_loads(capsys):
    assert main(["chat", "tiny:llama", "--tools", "no_such_tool"]) == 2
    assert capsys.readouterr().err.startswith("error: --tools")


@pytest.mark.slow
def test_chat_with_an_image_hands_its_pixels_to_every_turn(tmp_path):
    """`--image` on a vision-language model: the first user turn holds the image; each turn's reply is the sampler's
    on the whole conversation with the image's pixels (greedy), and differs from the same conversation without it."""
    import numpy as np
    from PIL import Image

    from posttrain.models.tiny import resolve_model_path
    from posttrain.rollout.policy import Policy
    from posttrain.sampling import SamplingParams

    policy = Policy.open(resolve_model_path("tiny:gemma3-vlm", cache_dir=tmp_path / "tiny"), max_slots=1)
    img = tmp_path / "red.png"
    Image.fromarray(np.full((40, 30, 3), (200, 10, 10), np.uint8)).save(img)
    chat = _conversation(policy, images=[str(img)])
    chat.reply("colour?")
    second = chat.reply("and now?")[0]["content"]
    chat.messages = chat.messages[:3]  # the conversation as the second turn saw it
    prompt = chat.prompt()
    assert len(prompt.images) == 1 and prompt.images[0].ndim == 3
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert policy.sampler.generate([prompt.ids], greedy, images=[prompt.images])[0].text == second
    blank = [np.zeros_like(prompt.images[0])]
    assert policy.sampler.generate([prompt.ids], greedy, images=[blank])[0].text != second
