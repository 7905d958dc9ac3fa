"""`posttrain eval`: greedy pass@1, sampled pass@k and maj@k of a model on a problem set, with a reward.

    posttrain eval --model DIR --data FILE --reward math_answer --n 8 --temperature 0.6 [--chat] [--limit N]

Text prompts are rendered as the model was trained to be prompted (the prompt format its export records:
`posttrain.models.prompt_format`; raw text for a checkpoint that records none); `--chat` / `--no-chat` and
`--system-prompt` override it.

The evaluator is RL's held-out evaluator (`posttrain.eval.evaluate`): the same sampling, rewards and
estimators. The model is sharded over every device (of every process: on several hosts every process runs
the same sampler on the global mesh, process 0 scores the rewards and writes the outputs). Writes one JSONL row per problem (the greedy completion, the n samples with their answers and
correctness, the problem's pass@k / maj@k) to `--output`, the summary next to it (`.summary.json`), and
prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.cli.agent_args import add_agent_arguments, check_agent, make_agent
from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments, fitted_budget, model_folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--data", required=True, help="problems: JSONL/JSON/Parquet file (or reasoning_gym:TASK?size=N)")
    p.add_argument("--reward", default="math_answer",
                   help="correctness reward: a built-in name (math_answer, reasoning_gym), module:function or "
                        "file.py:function; 1.0 = correct (default: math_answer)")
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


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return sorted(set(ks + [n])) if n > 0 else []


def parse_ks(text: str | None, n: int) -> list[int]:
    from posttrain.config import ConfigError

    if not text:
        return default_ks(n)
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--k: expected comma-separated integers, found {text!r}") from None
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ConfigError(f"--k: every k must be in [1, --n={n}], found {bad}")
    return ks


def _as_text(obj) -> str:
    """What a per-problem row shows of a value JSON cannot hold (an image in a prompt: `<image RGB 32x32>`)."""
    size = getattr(obj, "size", None)
    if isinstance(size, tuple) and hasattr(obj, "mode"):
        return f"<image {obj.mode} {size[0]}x{size[1]}>"
    return repr(obj)


def _prompt_field(path: str, given: str | None, environment: bool = False) -> str | None:
    """`given`, else the first of `PROMPT_FIELDS` the first record has; None (no prompt) with an environment,
    whose `reset` makes the conversation."""
    if given:
        return given
    from posttrain.data.sources import PROMPT_FIELDS, DataError, pick_prompt_field, read_records

    first = read_records(path)[0]
    field = pick_prompt_field(first, None, fallback=True, optional=True)
    if field is None and not environment:
        raise DataError(f"{path}: the first record has none of the prompt fields {list(PROMPT_FIELDS)} "
                        f"(fields present: {sorted(first)}); name one with --prompt-field")
    return field


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
    from posttrain.config import ConfigError

    if args.n < 0 or args.limit < 0:
        raise ConfigError("--n and --limit must be >= 0")
    ks = parse_ks(args.k, args.n)

    from rich.console import Console

    from posttrain import distributed
    from posttrain.models import tokenizer as tok_lib
    from posttrain.data import read_prompts
    from posttrain.models import from_pretrained
    from posttrain.models.prompt_format import prompt_style
    from posttrain.rewards.runner import RewardRunner, RewardSpec
    from posttrain.eval.evaluate import evaluate, per_problem
    from posttrain.sampling import Sampler

    console = Console(stderr=True)
    prompt_field = _prompt_field(args.data, args.prompt_field, environment=bool(args.environment))
    records = read_prompts(args.data, prompt_field=prompt_field)
    if args.limit:
        records = records[: args.limit]
    checked = check_agent(args)
    by_env = checked is not None and args.reward == "environment"
    spec = None if by_env else RewardSpec.coerce(args.reward)
    correctness = "environment" if by_env else spec.name
    primary = distributed.is_primary()  # multi-host: process 0 scores (`score_once`) and writes
    with RewardRunner([spec] if spec else [], num_workers=args.reward_workers if primary else 0) as runner:
        runner.check_records(records)  # a missing field fails before the model loads
        folder = model_folder(args.model)
        tok = tok_lib.load(folder)
        model = from_pretrained(folder, dtype=args.dtype, mesh=distributed.devices_mesh())
        style = prompt_style(folder, args.chat, args.system_prompt, default_chat=False)  # flags, else the export's
        agent = make_agent(checked, tok, system_prompt=style.system_prompt, prompt_field=prompt_field or "prompt")
        from posttrain.data.vlm import VisionSpec
        from posttrain.rollout.prompts import encode_prompts

        vision = VisionSpec.from_checkpoint(folder, tok) if Path(folder).is_dir() else None
        # each prompt carries its ids, images (handed to its prefill) and record
        prompts = encode_prompts(records, tok, style, agent=agent, vision=vision)
        total = len(records) * max(args.n, 1)
        slots = min(args.max_slots, 1 << (total - 1).bit_length())
        sampler = Sampler(model, tok, max_slots=slots)
        max_new_tokens = fitted_budget(sampler, prompts.ids, args.max_new_tokens, "eval")
        try:
            e = evaluate(sampler, prompts, runner, correctness=correctness, max_new_tokens=max_new_tokens,
                         k=ks, n_samples=args.n, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         progress=not args.no_progress and primary, agent=agent)
        finally:
            if agent is not None:
                agent.close()
    distributed.finish()
    if not primary:
        return 0
    rows = per_problem(e, records, correctness=correctness, k=ks)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=_as_text) + "\n")
    summary = {k: v for k, v in e.items() if not k.startswith("_")}
    summary.update({"model": str(args.model), "data": str(args.data), "reward": correctness, "n": args.n,
                    "temperature": args.temperature, "chat": style.chat,
                    "system_prompt": style.system_prompt})
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(summary_table(summary, f"{args.model} on {args.data} ({len(records)} problems, n={args.n})"))
    print(f"eval: greedy pass@1 {summary['eval/accuracy']:.4f}"
          + "".join(f", pass@{k} {summary[f'eval/pass@{k}']:.4f}" for k in ks if k > 1)
          + "".join(f", maj@{k} {summary[f'eval/maj@{k}']:.4f}" for k in ks if k > 1)
          + f"; per-problem samples in {out}", file=sys.stdout)
    return 0
