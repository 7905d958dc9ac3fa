"""`posttrain generate`: completions for a JSONL file of prompts (`prompt` text or chat `messages`) as JSON lines, to a
file or to standard output (`--output -`, the default).

The flags become a `GenerateConfig` and `posttrain.rollout.generate.run_generate` runs it (one output line per
completion; with `--tools` or `--environment` each one's multi-turn trajectory). Text prompts are rendered as the
model was trained to be prompted (the prompt format its export records: `posttrain.models.prompt_format`; raw text
for a checkpoint that records none); `--chat` / `--no-chat` and `--system-prompt` override it."""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.agent_args import add_agent_arguments, options
from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--prompts", required=True,
                   help="JSONL input: one object per line with `prompt` or `messages` (`-`: read standard input)")
    p.add_argument("--output", default="-", help="JSONL output: one line per completion (`-`, the default: standard "
                                                 "output)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    add_prompt_style_arguments(p, default_chat=False)  # a `messages` prompt always goes through the template
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-slots", type=int, default=32, help="sequences decoded at once (at most)")
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (default: fitted to the prompts)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_agent_arguments(p)


def run(args) -> int:
    from posttrain import distributed
    from posttrain.rollout.generate import GenerateConfig, run_generate

    result = run_generate(options(GenerateConfig, args))
    if distributed.is_primary():
        stats, where = result.stats, "standard output" if result.output is None else result.output
        print(f"wrote {len(result.completions)} completions to {where} "
              f"({stats.get('generated_tokens', 0)} tokens, {stats.get('seconds', 0.0):.1f}s)", file=sys.stderr)
    return 0
