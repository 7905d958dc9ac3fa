"""Entry point of the `posttrain` command: dispatches to one module per subcommand.

Each subcommand module defines `add_arguments(parser)` and `run(args) -> int`, and keeps heavy imports
(JAX, transformers) inside `run`, so that `posttrain --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "info": ("posttrain.cli.info", "print the architecture, parameter count and dtype of a checkpoint"),
    "generate": ("posttrain.cli.generate", "generate completions for a JSONL file of prompts"),
    "sft": ("posttrain.cli.sft", "supervised fine-tuning (full, LoRA, QLoRA) from a YAML config"),
    "rl": ("posttrain.cli.rl", "reinforcement learning with verifiable rewards (GRPO family)"),
    "demo": ("posttrain.cli.demo", "SFT then RL on a tiny model and a synthetic task, on CPU, in minutes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="JAX-native post-training for open LLMs.")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache (default: on, in ~/.cache/posttrain/jax "
                             "or $POSTTRAIN_COMPILE_CACHE; POSTTRAIN_COMPILE_CACHE=0 turns it off too)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(p)
        p.set_defaults(_module=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    if not args.no_compile_cache:
        from posttrain import compile_cache

        compile_cache.enable()  # a second run of the same job compiles nothing
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
