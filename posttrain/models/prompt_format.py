"""How a model was trained to be prompted, written with its Hugging Face export and read back as the default of the
commands that prompt it.

A `PromptStyle` is how text prompts are rendered: through the tokenizer's chat template (`chat`) or as the raw text,
and the system turn put first (`system_prompt`). A training run writes the style it trained with into the export's
`config.json` as

    "posttrain": {"prompt_format": {"chat_template": false, "system_prompt": null}}

(`transformers` keeps an unknown key as a config attribute and writes it back on `save_pretrained`; vLLM and
transformers ignore it otherwise). `prompt_style(folder, chat, system_prompt, default_chat=...)` is the one place a
command's prompt style is decided: a flag given wins, else the export's own, else the command's default (a checkpoint
we did not train has none). A message-list prompt always goes through the chat template, whatever the style.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PromptStyle", "read_prompt_style", "prompt_style", "trained_style", "config_block", "describe"]

KEY = "posttrain"  # the block of config.json that is ours
FIELD = "prompt_format"


@dataclasses.dataclass(frozen=True)
class PromptStyle:
    """How text prompts are rendered: `chat` (through the chat template) and the `system_prompt` to add."""
    chat: bool = True
    system_prompt: str | None = None


def trained_style(prompts: Iterable, *, chat: bool = False, system_prompt: str | None = None) -> PromptStyle:
    """The style a training set prompts its model with. `prompts`: its records' prompts, a message list (rendered
    through the chat template, `system_prompt` first when it has no system turn) or text (through the template only
    with `chat`, else raw; None for records with no prompt, such as plain texts). The majority decides chat or
    raw; the system prompt is recorded when every chat prompt starts with the same one."""
    n_chat = n_raw = 0
    systems: set = set()
    for p in prompts:
        if isinstance(p, list):
            first = p[0] if p and isinstance(p[0], dict) else {}
            system = first.get("content") if first.get("role") == "system" else system_prompt
        elif chat and p is not None:
            system = system_prompt
        else:
            n_raw += 1
            continue
        n_chat += 1
        systems.add(system if isinstance(system, str) and system else None)
    is_chat = n_chat > n_raw
    return PromptStyle(chat=is_chat, system_prompt=next(iter(systems)) if is_chat and len(systems) == 1 else None)


def config_block(style: PromptStyle) -> dict:
    """The `posttrain` block of an export's config.json that records `style`."""
    return {KEY: {FIELD: {"chat_template": bool(style.chat), "system_prompt": style.system_prompt or None}}}


def read_prompt_style(folder: str | os.PathLike | None) -> PromptStyle | None:
    """The style the checkpoint at `folder` was trained with (its config.json's `posttrain.prompt_format`), or None
    when it does not say (a checkpoint from elsewhere, a GGUF file, a block we cannot read)."""
    path = Path(folder) / "config.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        block = json.loads(path.read_text(encoding="utf-8")).get(KEY, {}).get(FIELD)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(block, dict) or not isinstance(block.get("chat_template"), bool):
        return None
    system = block.get("system_prompt")
    return PromptStyle(chat=block["chat_template"], system_prompt=system if isinstance(system, str) and system else None)


def prompt_style(folder: str | os.PathLike | None, chat: bool | None = None, system_prompt: str | None = None, *,
                 default_chat: bool) -> PromptStyle:
    """The style a command prompts the checkpoint at `folder` with: `chat` and `system_prompt` when given (flags;
    an empty system prompt means none), else what the checkpoint was trained with (`read_prompt_style`), else
    `default_chat` and no system prompt."""
    trained = read_prompt_style(folder) or PromptStyle(chat=default_chat)
    return PromptStyle(chat=trained.chat if chat is None else bool(chat),
                       system_prompt=trained.system_prompt if system_prompt is None else (system_prompt or None))


def describe(style: PromptStyle | None) -> str:
    """One phrase for `posttrain info` and the chat banner: "chat template", "raw prompt", with the system prompt."""
    if style is None:
        return "not recorded (each command's default)"
    text = "chat template" if style.chat else "raw prompt"
    return text + (f", system prompt {style.system_prompt!r}" if style.system_prompt else "")
