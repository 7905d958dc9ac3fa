"""RL on a real model on this CPU: the recipe `configs/smollm2_rl_cpu.yaml` (LoRA GRPO on SmolLM2-135M-Instruct,
a reasoning-gym task) for several seeds; held-out greedy accuracy before and after RL, wall time, seconds per
step split into generation (rollouts) and training, and the machine's load average (1 min) at the start and end
of each seed (the 2 cores are shared). `--full` runs the same with full fine-tuning.

The base model's held-out accuracy is the same for every seed (greedy decoding of the same problems by the same
weights), so it is evaluated once, in the first seed's run, and reused (`--eval-base-each` evaluates it in every
run); on a loaded 2-core machine each evaluation of 200 problems costs minutes.

    python benchmarks/bench_real_rl.py --seeds 0 1 2 [--steps N] [--full] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]


def run_seed(seed: int, args, base_accuracy: float | None = None) -> dict:
    from posttrain.rl.loop import load_rl_config, run_rl

    out = Path(args.out) / f"{'full' if args.full else 'lora'}-seed{seed}"
    overrides = [f"output_dir={out}", f"trainer.seed={seed}", f"data.seed={seed}", *args.overrides]
    if base_accuracy is not None:
        overrides.append("eval.at_start=false")
    if args.steps:
        overrides.append(f"trainer.max_steps={args.steps}")
    if args.full:
        overrides += ["lora.enabled=false", f"optim.lr={args.full_lr}"]
    cfg = load_rl_config(REPO / "configs/smollm2_rl_cpu.yaml", overrides)
    load_start = os.getloadavg()[0]
    t = time.perf_counter()
    res = run_rl(cfg)
    wall = time.perf_counter() - t
    before = next((e["eval/accuracy"] for e in res.evals if e["step"] == 0), base_accuracy)
    gen = [h["time/rollout_s"] for h in res.history]
    train = [h["time/train_s"] for h in res.history]
    return {
        "seed": seed,
        "mode": "full" if args.full else "lora",
        "steps": res.steps,
        "accuracy_before": before,
        "before_evaluated_here": base_accuracy is None,
        "accuracy_after": next((e["eval/accuracy"] for e in res.evals if e["step"] == res.steps), None),
        "wall_s": round(wall, 1),
        "generation_s_per_step": round(sum(gen) / max(len(gen), 1), 2),
        "training_s_per_step": round(sum(train) / max(len(train), 1), 2),
        "eval_s": round(sum(e["eval/seconds"] for e in res.evals), 1),
        "train_reward_first_last": [round(res.history[0]["reward/mean"], 3), round(res.history[-1]["reward/mean"], 3)]
        if res.history else None,
        "load_avg_1min_start_end": [round(load_start, 1), round(os.getloadavg()[0], 1)],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=0, help="override trainer.max_steps (0 = the recipe's)")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    p.add_argument("--full-lr", type=float, default=2e-6)
    p.add_argument("--out", default="/tmp/bench_real_rl")
    p.add_argument("--eval-base-each", action="store_true", help="evaluate the base model in every seed's run")
    p.add_argument("--base-accuracy", type=float, default=None,
                   help="the base model's held-out accuracy measured before (skips evaluating it again)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    rows = []
    base = args.base_accuracy
    for seed in args.seeds:
        row = run_seed(seed, args, None if args.eval_base_each else base)
        base = row["accuracy_before"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    gains = [r["accuracy_after"] - r["accuracy_before"] for r in rows
             if r["accuracy_before"] is not None and r["accuracy_after"] is not None]
    if gains:
        print(json.dumps({"mean_gain_points": round(100 * sum(gains) / len(gains), 1),
                          "mean_wall_s": round(sum(r["wall_s"] for r in rows) / len(rows), 1)}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
