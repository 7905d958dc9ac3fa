"""Training-inference mismatch on a real model on this CPU (issue 51): the recipe `configs/smollm2_rl_cpu.yaml` (LoRA
GRPO on SmolLM2-135M-Instruct, a reasoning-gym task) run with the sampler and the trainer in various precisions and
rollout corrections, several seeds each, in one run:

    a   matched float32            the recipe as it is (token-TIS on, so the trainer recomputes pi_old)
    b   bf16 sampler, token-TIS    rollout.compute_dtype=bfloat16 (the trainer stays float32)
    c   bf16 sampler, token-MIS    the same with learner.is_mode=mask (weights in [0.5, 2], tokens outside dropped)
    d   float16 both sides         model.compute_dtype=float16 (the sampler follows; dynamic loss scaling)
    ref bf16 both sides            model.compute_dtype=bfloat16: the reference for d's mismatch

Reported per run (one JSON line): `mismatch_kl` per step (the sampler's log-probs of the sampled tokens against the
trainer's recomputed ones, k3 per token), the masked fraction, held-out greedy accuracy before and after (evaluated
with the run's own sampler, in its dtype: the policy as it would be deployed), the train reward of the first and last
steps, seconds, and float16's skipped overflow steps; then a table per variant (means over the seeds, mismatch_kl per
step) and the issue's two goals: c's held-out accuracy within 2 points of a's, and d's mean mismatch_kl at least 10x
below ref's.

The base model's accuracy is evaluated once per variant (in the first seed's run) and reused for the others. Needs the
weights: `posttrain models fetch smollm2-135m-instruct`. The full recipe (16 steps, 200 held-out problems) takes
10-18 min a run on 2 shared cores; `--steps` and `--eval-limit` shrink it:

    python benchmarks/bench_mismatch.py [--variants a b c d ref] [--seeds 0 1 2] [--steps N] [--eval-limit N]
                                        [--out DIR] [--append] [key=value ...]

`--append` adds a run's rows to those of an earlier invocation with the same `--out` and summarises them together
(e.g. the accuracy variants at full length, then the mismatch-only variants shorter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "a": ("matched float32", []),
    "b": ("bf16 sampler + f32 trainer, token-TIS", ["rollout.compute_dtype=bfloat16"]),
    "c": ("bf16 sampler + f32 trainer, token-MIS", ["rollout.compute_dtype=bfloat16", "learner.is_mode=mask"]),
    "d": ("float16 both sides", ["model.compute_dtype=float16"]),
    "ref": ("bf16 both sides (d's reference)", ["model.compute_dtype=bfloat16"]),
}


def run_one(variant: str, seed: int, args, base_accuracy: float | None) -> dict:
    """One recipe run of `variant` with `seed`; its figures (module docstring)."""
    from posttrain.rl.loop import load_rl_config, run_rl

    out = Path(args.out) / f"{variant}-seed{seed}"
    overrides = [f"output_dir={out}", f"trainer.seed={seed}", f"data.seed={seed}", "trainer.progress=false",
                 "trainer.save_every=0", "export_hf=false", *VARIANTS[variant][1], *args.overrides]
    if base_accuracy is not None:
        overrides.append("eval.at_start=false")
    if args.steps:
        overrides.append(f"trainer.max_steps={args.steps}")
    if args.eval_limit:
        overrides.append(f"data.eval_limit={args.eval_limit}")
    cfg = load_rl_config(REPO / "configs/smollm2_rl_cpu.yaml", overrides)
    load_start = os.getloadavg()[0]
    t = time.perf_counter()
    res = run_rl(cfg)
    wall = time.perf_counter() - t
    h = res.history
    before = next((e["eval/accuracy"] for e in res.evals if e["step"] == 0), base_accuracy)
    return {
        "variant": variant, "seed": seed, "steps": res.steps,
        "mismatch_kl": [h_["mismatch_kl"] for h_ in h],
        "masked_frac": statistics.fmean(h_.get("is/masked_frac", 0.0) for h_ in h),
        "accuracy_before": before, "before_evaluated_here": base_accuracy is None,
        "accuracy_after": next((e["eval/accuracy"] for e in res.evals if e["step"] == res.steps), None),
        "reward_first_last": [round(h[0]["reward/mean"], 3), round(h[-1]["reward/mean"], 3)],
        "overflow_steps": h[-1].get("loss_scale/overflows", 0.0),
        "eval_limit": args.eval_limit,
        "wall_s": round(wall, 1),
        "generation_s_per_step": round(statistics.fmean(x["time/rollout_s"] for x in h), 2),
        "training_s_per_step": round(statistics.fmean(x["time/train_s"] for x in h), 2),
        "eval_s": round(sum(e["eval/seconds"] for e in res.evals), 1),
        "load_avg_1min_start_end": [round(load_start, 1), round(os.getloadavg()[0], 1)],
    }


def summarise(rows: list[dict]) -> list[str]:
    """The table per variant and the issue's goals, as printable lines."""
    by = {v: [r for r in rows if r["variant"] == v] for v in VARIANTS if any(r["variant"] == v for r in rows)}
    lines = ["variant | runs | mismatch_kl mean | per step (mean over seeds) | masked | held-out before -> after "
             "| s/run"]
    mean_kl, acc = {}, {}
    for v, rs in by.items():
        steps = min(len(r["mismatch_kl"]) for r in rs)
        per_step = [statistics.fmean(r["mismatch_kl"][i] for r in rs) for i in range(steps)]
        mean_kl[v] = statistics.fmean(per_step)
        after = [r["accuracy_after"] for r in rs if r["accuracy_after"] is not None]
        acc[v] = statistics.fmean(after) if after else float("nan")
        before = next((r["accuracy_before"] for r in rs if r["accuracy_before"] is not None), float("nan"))
        lines.append(f"{v} ({VARIANTS[v][0]}) | {len(rs)} | {mean_kl[v]:.2e} | "
                     f"{' '.join(f'{x:.1e}' for x in per_step)} | {statistics.fmean(r['masked_frac'] for r in rs):.4f} "
                     f"| {before:.3f} -> {acc[v]:.3f} | {statistics.fmean(r['wall_s'] for r in rs):.0f}")
    if "a" in acc and "c" in acc:
        gap = 100 * (acc["c"] - acc["a"])
        lines.append(f"goal: c within 2 points of a: {gap:+.1f} points -> {'met' if abs(gap) <= 2 else 'NOT met'}")
    if "d" in mean_kl and "ref" in mean_kl:
        ratio = mean_kl["ref"] / max(mean_kl["d"], 1e-30)
        lines.append(f"goal: d's mismatch_kl >= 10x below bf16-both: {ratio:.1f}x -> "
                     f"{'met' if ratio >= 10 else 'NOT met'}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=0, help="override trainer.max_steps (0 = the recipe's 16)")
    p.add_argument("--eval-limit", type=int, default=0, help="held-out problems (0 = the recipe's 200)")
    p.add_argument("--out", default="/tmp/bench_mismatch")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to OUT/summary.json's (an earlier invocation's) and summarise them all")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more overrides for every run")
    args = p.parse_args(argv)
    summary = Path(args.out) / "summary.json"
    rows = json.loads(summary.read_text()) if args.append and summary.exists() else []
    t0 = time.perf_counter()
    for variant in args.variants:
        # the base model's accuracy: evaluated once per variant, also across --append invocations (same held-out set)
        base = next((r["accuracy_before"] for r in rows if r["variant"] == variant and r["before_evaluated_here"]
                     and r.get("eval_limit", 0) == args.eval_limit), None)
        for seed in args.seeds:
            row = run_one(variant, seed, args, base)
            base = row["accuracy_before"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nbench_mismatch: {len(rows)} runs, this invocation {time.perf_counter() - t0:.0f} s "
          f"(steps {args.steps or 'recipe'}, held-out {args.eval_limit or 'recipe'}, seeds {args.seeds})")
    for line in summarise(rows):
        print(line)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
