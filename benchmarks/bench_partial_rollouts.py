"""Benchmark: partial rollouts (`fleet.swap=segment`) against lease swaps on a task with long-tailed completions.

Task: the demo's chained additions (`posttrain.demo.task`) with a long tail: most problems have 2-3 terms
(`3+4=7 #### 7`), a quarter (--long-fraction) have --long-terms terms, whose worked solutions are ~8x longer
than the median. A small model is built from scratch and fine-tuned on worked solutions (once, cached in
--work-dir for the same data and SFT arguments), so that its completions have those lengths. The RL prompts
come in a fixed order in which each step's prompts hold one long problem (every lease has a long tail).

Regime: generation-bound, which is what partial rollouts are for. One worker, a publish every step, the same
staleness bound and decode segments of --segment-steps tokens in both modes, and a cheap update (4 prompts x 4
samples a step, one optimizer step, packed sequences): a lease lasts as long as its longest completion, the
update costs its tokens, so the trainer publishes while the worker is mid-lease. Modes:

    lease     workers take newer weights at the start of each lease only
    segment   ... and between decode segments of a lease (partial rollouts)

Each run is `posttrain rl` in its own process, as a user runs it. An unmeasured lease run first fills JAX's
persistent compilation cache, so that the measured runs mostly load programs; then --rounds rounds,
interleaved lease/segment, segment/lease, ... since timings on a shared machine drift. Reported per run, after
--warmup steps, first what machine load does not move: token staleness (`tok_stale`: the mean version lag of
each sampled token at the update that trains it), the fraction of tokens produced by the newest weights
(`fresh`: lag 0), group staleness (`grp_stale`, on version_first: what the bound applies to), swaps per lease,
the versions a sample spans and `mismatch_kl` (sampler vs trainer log-probs of the sampled tokens); then,
load-dependent, samples/s (wall clock between step ends in `trained.jsonl`, leaving out the `compiles`: steps
whose update took over COMPILE_S) and the trainer's mean wait for rollouts per step; and held-out greedy
accuracy at the end (--eval problems of the same distribution; the SFT model's is printed first).

    python benchmarks/bench_partial_rollouts.py [--steps 100] [--warmup 5] [--rounds 2] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("lease", "segment")
COLS = ("round", "mode", "tok_stale", "fresh", "grp_stale", "swaps/lease", "span", "mismatch_kl", "samples/s",
        "compiles", "wait_s", "len_mean", "accuracy", "load")
COMPILE_S = 1.0  # an update this long compiled or loaded a program (a new packed shape); steady ones take ~0.1 s


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


def build_sft(work: Path, args) -> None:
    """Data (SFT, the RL prompts' pool, held-out), base model and SFT checkpoint."""
    import yaml

    from posttrain.demo.run import build_base_model, sft_config
    from posttrain.demo.task import write_jsonl
    from posttrain.training.sft import load_sft_config, run_sft

    data = work / "data"
    held = list({p["prompt"]: p for p in make_data(args.seed + 1, 4 * args.eval, args.long_fraction,
                                                     args.long_terms)}.values())[: args.eval]  # distinct
    problems = make_data(args.seed, args.sft_examples + args.rl_prompts, args.long_fraction, args.long_terms,
                         exclude={p["prompt"] for p in held})
    rl, sft = problems[: args.rl_prompts], problems[args.rl_prompts:]
    write_jsonl(sft, data / "sft_train.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in rl], data / "rl_pool.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in held], data / "heldout.jsonl")
    s = types.SimpleNamespace(hidden=64, layers=2, heads=4, sft_batch=16, sft_lr=3e-3, sft_steps=args.sft_steps)
    base = build_base_model(work, s, args.seed)
    cfg = sft_config(work, base, s, args.seed, seq_len=256)
    cfg["trainer"]["progress"] = False
    (work / "sft.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_sft(load_sft_config(work / "sft.yaml"))


def prepare(work: Path, args) -> Path:
    """The SFT checkpoint (rebuilt when the data or SFT arguments changed) and the RL config; returns its path."""
    import yaml

    key = {k: getattr(args, k) for k in ("seed", "sft_steps", "sft_examples", "rl_prompts", "eval", "long_fraction",
                                         "long_terms")}
    stamp = work / "prepared.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != key:
        for d in ("data", "model_init", "sft"):
            shutil.rmtree(work / d, ignore_errors=True)
        build_sft(work, args)
        stamp.write_text(json.dumps(key))
    data = work / "data"
    write_rl_prompts(data, args.batch_prompts, args.long_terms)
    rl_yaml = work / "rl.yaml"
    rl_yaml.write_text(yaml.safe_dump({
        "model": {"path": str(work / "sft" / "hf")},
        "data": {"train": str(data / "rl_prompts.jsonl"), "eval": str(data / "heldout.jsonl"), "shuffle": False},
        "rollout": {"batch_prompts": args.batch_prompts, "group_size": 4, "max_new_tokens": 192, "temperature": 1.0},
        "algorithm": {"preset": "grpo", "beta": 0.0},
        "learner": {"pack": True},
        "rewards": {"functions": [{"name": "math_answer"}], "correctness": "math_answer", "num_workers": 1},
        "optim": {"lr": args.lr, "decay": "constant", "clip_norm": 1.0},
        "trainer": {"log_every": 1, "save_every": 0, "seed": args.seed, "resume": False, "progress": False},
        "eval": {"every": 0, "at_start": False},
        "fleet": {"workers": 1, "max_staleness": args.staleness, "publish_every": 1,
                  "segment_steps": args.segment_steps},
        "export_hf": False,
    }, sort_keys=False))
    return rl_yaml


def write_rl_prompts(data: Path, batch: int, long_terms: int) -> None:
    """The RL prompts in a fixed order (no shuffle) in which every step's `batch` prompts hold one long problem:
    every lease has its long tail, and the packed update's shapes barely change from step to step (each new
    shape is a compile, or ~1 s to load it from the cache, on a step that takes ~0.1 s)."""
    from posttrain.demo.task import write_jsonl

    pool = [json.loads(x) for x in (data / "rl_pool.jsonl").read_text().splitlines()]
    longs = [p for p in pool if p["prompt"].count("+") == long_terms - 1]
    shorts = [p for p in pool if p["prompt"].count("+") != long_terms - 1]
    n = min(len(longs), len(shorts) // (batch - 1)) if batch > 1 else len(longs)
    write_jsonl([p for i in range(n) for p in [longs[i], *shorts[i * (batch - 1): (i + 1) * (batch - 1)]]],
                data / "rl_prompts.jsonl")


def length_tail(work: Path) -> tuple[float, float]:
    """(median, max) completion length in characters (= tokens: a character tokenizer) of the SFT data."""
    lengths = [len(json.loads(x)["completion"]) for x in (work / "data" / "sft_train.jsonl").read_text().splitlines()]
    return statistics.median(lengths), max(lengths)


def run(rl_yaml: Path, out: Path, mode: str, steps: int, *overrides: str) -> list[dict]:
    """One `posttrain rl` run in its own process; returns its metrics rows."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "rl", str(rl_yaml), f"output_dir={out}",
                           f"trainer.max_steps={steps}", f"fleet.swap={mode}", *overrides], capture_output=True,
                          text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, check=False)
    if proc.returncode:
        raise SystemExit(f"{out.name} failed:\n{proc.stdout}\n{proc.stderr}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict], out: Path, warmup: int, batch: int) -> dict:
    """The run's figures after `warmup` steps; token-level ones weighted by each step's sampled tokens.
    samples/s leaves out the steps whose update compiled a program (over COMPILE_S; counted in `compiles`)."""
    after = [r for r in rows if "loss" in r and r["step"] > warmup]
    tokens = [r["completion/length_mean"] for r in after]  # x batch samples, the same every step

    def per_token(key):
        return sum(r[key] * w for r, w in zip(after, tokens)) / sum(tokens)

    times = [json.loads(x)["time"] for x in (out / "trained.jsonl").read_text().splitlines()]
    steady = [times[r["step"] - 1] - times[r["step"] - 2] for r in after if r["time/train_s"] < COMPILE_S]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    leases = max(sum(r["fleet/leases"] for r in after), 1)
    return {"tok_stale": per_token("fleet/token_staleness_mean"), "fresh": per_token("fleet/fresh_token_fraction"),
            "grp_stale": statistics.mean(r["fleet/staleness_mean"] for r in after),
            "swaps/lease": sum(r["fleet/swaps_mid_lease"] for r in after) / leases,
            "span": statistics.mean(r["fleet/version_span_mean"] for r in after),
            "mismatch_kl": statistics.mean(r["mismatch_kl"] for r in after),
            "samples/s": batch * len(steady) / sum(steady), "compiles": len(after) - len(steady),
            "wait_s": statistics.mean(r["time/rollout_s"] for r in after),
            "len_mean": statistics.mean(tokens), "len_max": max(r["completion/length_max"] for r in after),
            "accuracy": evals[-1] if evals else float("nan")}


def schedule(rounds: int) -> list[tuple[int, str]]:
    """(round, mode): lease/segment, segment/lease, ... (each mode first in every other round)."""
    return [(r, m) for r in range(1, rounds + 1) for m in (MODES if r % 2 else MODES[::-1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", default="/tmp/bench_partial_rollouts")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--segment-steps", type=int, default=1)
    ap.add_argument("--batch-prompts", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-examples", type=int, default=6000)
    ap.add_argument("--rl-prompts", type=int, default=1000)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--long-terms", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rl_yaml = prepare(work, args)
    med, longest = length_tail(work)
    print(f"data + SFT: {time.perf_counter() - t0:.0f} s; completion length median {med:g}, max {longest} "
          f"({longest / med:.1f}x); load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = run(rl_yaml, work / "rl_warmup", "lease", args.steps, "eval.at_start=true")
    sft_acc = next(r["eval/accuracy"] for r in rows if "eval/accuracy" in r)
    print(f"compile pass (unmeasured): SFT model's held-out accuracy {sft_acc:.3f}; {time.perf_counter() - t0:.0f} s "
          "so far", flush=True)
    results = []
    for rnd, mode in schedule(args.rounds):
        out = work / f"rl_{rnd}_{mode}"
        load = os.getloadavg()[0]
        res = summarize(run(rl_yaml, out, mode, args.steps), out, args.warmup, args.batch_prompts * 4)
        results.append({"round": rnd, "mode": mode, **res, "load": f"{load:.1f}-{os.getloadavg()[0]:.1f}"})
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s in all. fleet: 1 worker, max_staleness={args.staleness}, publish every "
          f"step, segment_steps={args.segment_steps}, {args.steps} steps (first {args.warmup} left out), "
          f"{args.batch_prompts} prompts x 4 samples a step, packed update, lr {args.lr:g}; load = 1-min load average "
          f"at the run's start-end ({os.cpu_count()} cores)")
    print("| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for r in results:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in COLS) + " |")


if __name__ == "__main__":
    main()
