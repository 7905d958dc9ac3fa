"""`posttrain configs`: the shipped example configs (the checkout's configs/ folder), each with the command that runs it
and its first comment line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=str(CONFIG_DIR), help="the folder of configs to list (default: the checkout's configs/)")


def first_comment(path: Path) -> str:
    """The first comment line of a YAML file, without its `#` (empty when it starts with no comment)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def command_of(path: Path) -> str:
    """The subcommand a config is for: the one its comments run it with (`posttrain rl configs/NAME.yaml`), else
    the one its name starts with or holds (`sft_smoke`, `smollm2_rl_cpu`)."""
    m = re.search(rf"posttrain (\w+) configs/{re.escape(path.name)}", path.read_text(encoding="utf-8"))
    if m:
        return m.group(1)
    stem = path.stem
    for cmd in ("sft", "dpo", "distill", "rl"):
        if stem.startswith(cmd + "_") or f"_{cmd}_" in f"_{stem}_":
            return cmd
    return "rl" if stem.startswith(("agent_", "gsm8k_")) else "sft"


def run(args) -> int:
    from posttrain.config import ConfigError

    folder = Path(args.dir)
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    if not files:
        raise ConfigError(f"{folder}: no configs there (the example configs ship in the checkout's configs/ folder)")
    width = max(len(f"posttrain {command_of(f)} {f.relative_to(folder.parent)}") for f in files)
    for f in files:
        cmd = f"posttrain {command_of(f)} {f.relative_to(folder.parent)}"
        print(f"{cmd:<{width}}  {first_comment(f)}")
    return 0
