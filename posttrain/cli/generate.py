"""`posttrain generate`: completions for a JSONL file of prompts (`prompt` text or chat `messages`) to a JSONL file.

The flags become a `GenerateConfig` and `posttrain.rollout.generate.run_generate` runs it (one output line per
completion; with `--tools` or `--environment` each one's multi-turn trajectory)."""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.agent_args import add_agent_arguments, options
from posttrain.cli.model_arg import add_model_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--prompts", required=True,
                   help="JSONL input: one object per line with `prompt` or `messages` (`-`: read standard input)")
    p.add_argument("--output", required=True, help="JSONL output: one line per completion")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="also wrap plain `prompt` text as one user message")
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
        stats = result.stats
        print(f"wrote {len(result.completions)} completions to {result.output} "
              f"({stats.get('generated_tokens', 0)} tokens, {stats.get('seconds', 0.0):.1f}s)", file=sys.stderr)
    return 0
