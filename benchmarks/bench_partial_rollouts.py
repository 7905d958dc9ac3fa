"""Benchmark: partial rollouts (`fleet.swap=segment`) against lease swaps on a task with long-tailed completions.

Task: the demo's chained additions (`posttrain.demo.task`) with a long tail: most problems have 2-3 terms
(`3+4=7 #### 7`), a few (--long-fraction) have --long-terms terms, whose worked solutions are ~8x longer than
the median. A small model is built from scratch and fine-tuned on worked solutions (once, cached in
--work-dir), so that its completions have those lengths; then `posttrain rl` runs from it on the fleet (one
worker, the same `fleet.max_staleness`, the same decode segments) once per mode, one after another, each in
its own process as a user runs it:

    lease     workers take newer weights at the start of each lease only
    segment   ... and between decode segments of a lease (partial rollouts)

Reported per mode: samples/s (wall clock between step ends in `trained.jsonl`, after --warmup steps, which
carry the compiles and the worker's start), group staleness (on version_first: what the bound applies to;
mean and max), token staleness (each sampled token's version lag, mean), the versions a sample spans, the
swaps within leases, the trainer's mean wait for rollouts per step (near 0: the worker runs ahead of the
trainer, so publishes seldom land mid-lease), and held-out greedy accuracy at the end (--eval problems of
the same distribution).

    python benchmarks/bench_partial_rollouts.py [--steps 16] [--warmup 3] [--staleness 1] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("lease", "segment")


def make_data(seed: int, n: int, long_fraction: float, long_terms: int, exclude=frozenset()) -> list[dict]:
    """n problems (repeats allowed, none of the prompts in `exclude`): 2-3 terms of 0-9, or `long_terms` terms
    with probability `long_fraction`."""
    from posttrain.demo.task import make_problem

    rng, out = random.Random(seed), []
    while len(out) < n:
        terms = long_terms if rng.random() < long_fraction else rng.choice((2, 3))
        p = make_problem(rng, max_operand=9, terms=terms)
        if p["prompt"] not in exclude:
            out.append(p)
    return out


def prepare(work: Path, args) -> Path:
    """Data, base model and SFT checkpoint (built once); returns the RL config's path."""
    import yaml

    from posttrain.demo.run import build_base_model, sft_config
    from posttrain.demo.task import write_jsonl
    from posttrain.training.sft import load_sft_config, run_sft

    data = work / "data"
    hf = work / "sft" / "hf"
    if not (hf / "config.json").exists():
        held = list({p["prompt"]: p for p in make_data(args.seed + 1, 4 * args.eval, args.long_fraction,
                                                         args.long_terms)}.values())[: args.eval]  # distinct
        problems = make_data(args.seed, args.sft_examples + args.rl_prompts, args.long_fraction, args.long_terms,
                             exclude={p["prompt"] for p in held})
        rl, sft = problems[: args.rl_prompts], problems[args.rl_prompts:]
        write_jsonl(sft, data / "sft_train.jsonl")
        write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in rl], data / "rl_prompts.jsonl")
        write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in held], data / "heldout.jsonl")
        s = types.SimpleNamespace(hidden=64, layers=2, heads=4, sft_batch=16, sft_lr=3e-3, sft_steps=args.sft_steps)
        base = build_base_model(work, s, args.seed)
        cfg = sft_config(work, base, s, args.seed, seq_len=256)
        cfg["trainer"]["progress"] = False
        (work / "sft.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        run_sft(load_sft_config(work / "sft.yaml"))
    rl_yaml = work / "rl.yaml"
    rl_yaml.write_text(yaml.safe_dump({
        "model": {"path": str(hf)},
        "data": {"train": str(data / "rl_prompts.jsonl"), "eval": str(data / "heldout.jsonl"), "seed": args.seed},
        "rollout": {"batch_prompts": 8, "group_size": 4, "max_new_tokens": 192, "temperature": 1.0},
        "algorithm": {"preset": "grpo", "beta": 0.0},
        "rewards": {"functions": [{"name": "math_answer"}], "correctness": "math_answer", "num_workers": 1},
        "optim": {"lr": 1e-4, "decay": "constant", "clip_norm": 1.0},
        "trainer": {"log_every": 1, "save_every": 0, "seed": args.seed, "resume": False, "progress": False},
        "eval": {"every": 0, "at_start": False},
        "fleet": {"workers": 1, "max_staleness": args.staleness, "segment_steps": args.segment_steps},
        "export_hf": False,
    }, sort_keys=False))
    return rl_yaml


def length_tail(work: Path) -> tuple[float, float]:
    """(median, max) completion length in characters (= tokens: a character tokenizer) of the SFT data."""
    lengths = [len(json.loads(x)["completion"]) for x in (work / "data" / "sft_train.jsonl").read_text().splitlines()]
    return statistics.median(lengths), max(lengths)


def run_mode(mode: str, rl_yaml: Path, work: Path, steps: int, warmup: int) -> dict:
    out = work / f"rl_{mode}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "rl", str(rl_yaml), f"output_dir={out}",
                           f"trainer.max_steps={steps}", f"fleet.swap={mode}"], capture_output=True, text=True,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stdout}\n{proc.stderr}")
    ledger = [json.loads(x) for x in (out / "trained.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in rows if "loss" in r and r["step"] > warmup]
    evals = [r for r in rows if "eval/accuracy" in r]
    times = [r["time"] for r in ledger]
    per_step = (times[-1] - times[warmup - 1]) / (len(times) - warmup)

    def mean(key):
        return statistics.mean(r[key] for r in after)

    return {"mode": mode, "samples_per_s": 32 / per_step, "s_per_step": per_step, "wall_s": wall,
            "staleness_mean": mean("fleet/staleness_mean"), "staleness_max": max(r["staleness_max"] for r in ledger),
            "token_staleness_mean": mean("fleet/token_staleness_mean"), "span_mean": mean("fleet/version_span_mean"),
            "swaps": sum(r["fleet/swaps_mid_lease"] for r in after), "wait_s": mean("time/rollout_s"),
            "length_mean": mean("completion/length_mean"),
            "length_max": max(r["completion/length_max"] for r in after),
            "heldout_accuracy": evals[-1]["eval/accuracy"] if evals else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", default="/tmp/bench_partial_rollouts")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--segment-steps", type=int, default=16)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-examples", type=int, default=6000)
    ap.add_argument("--rl-prompts", type=int, default=1000)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--long-fraction", type=float, default=0.1)
    ap.add_argument("--long-terms", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rl_yaml = prepare(work, args)
    med, longest = length_tail(work)
    print(f"data + SFT: {time.perf_counter() - t0:.0f} s; completion length median {med:g}, max {longest} "
          f"({longest / med:.1f}x); load average {os.getloadavg()[0]:.1f}")
    results = []
    for mode in args.modes:
        results.append(run_mode(mode, rl_yaml, work, args.steps, args.warmup))
        print(json.dumps(results[-1]), f"load average {os.getloadavg()[0]:.1f}", flush=True)
    cols = ("mode", "samples_per_s", "staleness_mean", "staleness_max", "token_staleness_mean", "span_mean", "swaps",
            "wait_s", "length_mean", "length_max", "heldout_accuracy")
    print(f"\nfleet: 1 worker, max_staleness={args.staleness}, segment_steps={args.segment_steps}, {args.steps} steps "
          f"(first {args.warmup} not timed), 8 prompts x 4 samples per step")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
