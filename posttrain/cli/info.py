"""`posttrain info MODEL`: architecture, parameter count and dtype of a checkpoint, read without loading weights."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder (config.json + *.safetensors), hub id, or tiny:<family>")


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from posttrain.models import hf_io
    from posttrain.models.tiny import resolve_model_path

    console = Console()
    try:
        folder, cfg = hf_io.load_config(resolve_model_path(args.model))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    counted, dtypes = hf_io.count_checkpoint_params(folder)
    hf = json.loads((Path(folder) / "config.json").read_text())
    table = Table(title=f"{args.model}", show_header=False)
    for k, v in cfg.describe().items():
        table.add_row(k, str(v))
    table.add_row("parameters", f"{counted:,} ({counted / 1e6:.2f} M)")
    table.add_row("dtype (config)", str(hf.get("dtype", hf.get("torch_dtype", "?"))))
    table.add_row("dtype (tensors)", ", ".join(sorted(dtypes)))
    console.print(table)
    return 0
