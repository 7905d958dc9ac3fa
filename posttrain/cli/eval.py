"""`posttrain eval`: greedy pass@1, sampled pass@k and maj@k of a model on a problem set, with a reward.

    posttrain eval --model DIR --data FILE --reward math_answer --n 8 --temperature 0.6 [--chat] [--limit N]

The flags become an `EvalConfig` and `posttrain.eval.run.run_eval` runs it (RL's held-out evaluator through a
`Policy`): one JSONL row per problem in `--output`, the summary beside it (`.summary.json`), printed as a table.
Text prompts are rendered as the model was trained to be prompted (the prompt format its export records:
`posttrain.models.prompt_format`; raw text for a checkpoint that records none); `--chat` / `--no-chat` and
`--system-prompt` override it.
"""

from __future__ import annotations

import argparse

from posttrain.cli.agent_args import add_agent_arguments, options
from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--data", default="",
                   help="problems: JSONL/JSON/Parquet file (or reasoning_gym:TASK?size=N); none with --environment "
                        "verifiers:NAME, whose own eval split is used")
    p.add_argument("--reward", default="math_answer",
                   help="correctness reward: a built-in name (math_answer, reasoning_gym), module:function or "
                        "file.py:function; 1.0 = correct (default: math_answer)")
    p.add_argument("--reward-kwargs", default=None,
                   help='the reward\'s settings, a JSON object (e.g. --reward judge --reward-kwargs '
                        '\'{"model": "tiny:llama"}\' for a judge on a local checkpoint)')
    p.add_argument("--n", type=int, default=8, help="samples per problem for pass@k / maj@k (0 = greedy only)")
    p.add_argument("--k", default=None,
                   help="comma-separated k for pass@k and maj@k (default: 1, 2, 4, ... up to n, and n)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of the n samples")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    add_prompt_style_arguments(p, default_chat=False)
    p.add_argument("--prompt-field", default=None,
                   help="the record field holding the prompt (default: the first of prompt, question, problem, "
                        "messages; with --environment, none is needed)")
    p.add_argument("--limit", type=int, default=0, help="evaluate the first N problems only (0 = all)")
    p.add_argument("--output", default="eval_samples.jsonl", help="per-problem JSONL output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-slots", type=int, default=64, help="sequences decoded at once (at most)")
    p.add_argument("--reward-workers", type=int, default=2, help="reward processes (0 = in this process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_agent_arguments(p)  # with --environment, --reward environment scores by the environment's reward


def summary_table(summary: dict, title: str):
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    names = {"accuracy": "greedy pass@1", "reward_mean": "greedy mean reward", "completion_length":
             "greedy mean length (tokens)", "pass@1_sampled": "pass@1 (sampled)", "reward_mean_sampled":
             "sampled mean reward", "num_prompts": "problems"}
    for key, v in summary.items():
        if key.startswith("eval/"):
            name = key.removeprefix("eval/")
            t.add_row(names.get(name, name), f"{v:.4f}" if isinstance(v, float) else str(v))
    return t


def run(args) -> int:
    from rich.console import Console

    from posttrain import distributed
    from posttrain.eval.run import EvalConfig, run_eval

    result = run_eval(options(EvalConfig, args))
    if distributed.is_primary():
        m, later = result.metrics, [k for k in result.k if k > 1]
        title = f"{args.model} on {args.data or args.environment} ({m['eval/num_prompts']} problems, n={args.n})"
        Console(stderr=True).print(summary_table(m, title))
        print(f"eval: greedy pass@1 {m['eval/accuracy']:.4f}" + "".join(f", pass@{k} {m[f'eval/pass@{k}']:.4f}"
              for k in later if f"eval/pass@{k}" in m) + "".join(f", maj@{k} {m[f'eval/maj@{k}']:.4f}"
                                                                  for k in later if f"eval/maj@{k}" in m)
              + "".join(f", {k.removeprefix('eval/')} {v:.4f}" for k, v in m.items() if k.startswith("eval/rubric/")
                        and not k.endswith("_sampled"))
              + f"; per-problem samples in {result.output}")
    return 0
