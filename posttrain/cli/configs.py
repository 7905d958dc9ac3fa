"""`posttrain configs`: the shipped example configs (the checkout's configs/ folder), each with the command that runs it
and its description: the first sentence of its opening comment, whole (it may span several comment lines)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=str(CONFIG_DIR), help="the folder of configs to list (default: the checkout's configs/)")


# a full stop that ends a sentence: followed by a space or the end, not the one of "e.g." or "i.e."
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.(?=\s|$)")


def description(path: Path) -> str:
    """The first sentence of a YAML file's opening comment (its lines joined, up to the first full stop; the whole
    first paragraph when none ends it), without the `#`s; empty when the file starts with no comment."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or not text or line.startswith("#   "):
            break  # the comment ends, a blank comment line ends the paragraph, an indented line is a command
        words.append(text)
    paragraph = " ".join(words)
    end = SENTENCE_END.search(paragraph)
    return paragraph[: end.end()] if end else paragraph


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
        print(f"{cmd:<{width}}  {description(f)}")
    return 0
