"""`posttrain info MODEL`: architecture, parameter count, dtype and prompt format of a checkpoint (any model spec the
sampling commands take: HF folder, a run's output folder, GGUF file, ...), read without loading (or dequantizing)
weights."""

from __future__ import annotations

import argparse

from posttrain.cli.model_arg import add_model_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, positional=True)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from posttrain.models import gguf_io, hf_io
    from posttrain.models.spec import resolve_checkpoint

    console = Console()
    path = resolve_checkpoint(args.model)  # bad files raise errors that posttrain.cli.main prints in one line
    if gguf_io.is_gguf_path(path):
        rows = _gguf_rows(gguf_io.GGUFCheckpoint(path))
    else:
        rows = _hf_rows(*hf_io.load_config(path))
    table = Table(title=f"{args.model}", show_header=False)
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)
    return 0


def _hf_rows(folder, cfg) -> list[tuple[str, str]]:
    import json
    from pathlib import Path

    from posttrain.models import hf_io, prompt_format

    counted, dtypes = hf_io.count_checkpoint_params(folder)
    hf = json.loads((Path(folder) / "config.json").read_text())
    return [("folder", str(folder)), *cfg.describe().items(), ("parameters", f"{counted:,} ({counted / 1e6:.2f} M)"),
            ("dtype (config)", str(hf.get("dtype", hf.get("torch_dtype", "?")))),
            ("dtype (tensors)", ", ".join(sorted(dtypes))),
            ("prompt format", prompt_format.describe(prompt_format.read_prompt_style(folder)))]


def _gguf_rows(index) -> list[tuple[str, str]]:
    """Rows for a GGUF file: its config as we read it, parameters counted from the tensor shapes, and the
    quantization types with how many tensors use each."""
    import collections
    import math

    from posttrain.models.config import ModelConfig

    cfg = ModelConfig.from_hf(index.hf_config(), source=str(index.path))
    counted = sum(math.prod(t.shape) for t in index.tensors.values())
    types = collections.Counter(t.qtype.name for t in index.tensors.values())
    name = index.field("general.name")
    return [("file", f"{index.path} ({index.path.stat().st_size / 2**20:.1f} MiB)"),
            *([("name", str(name))] if name else []),
            ("gguf architecture", index.architecture), *cfg.describe().items(),
            ("parameters", f"{counted:,} ({counted / 1e6:.2f} M)"),
            ("quantization (tensors)", ", ".join(f"{k} ({v})" for k, v in sorted(types.items()))),
            ("chat template", "yes" if index.field("tokenizer.chat_template") else "no")]
