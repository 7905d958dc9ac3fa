"""`posttrain dpo CONFIG.yaml [key=value ...]`: preference tuning (DPO, IPO, hinge, robust/cDPO, SimPO, ORPO)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/dpo_smoke.yaml, configs/dpo_qwen2.5_0.5b.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. algorithm.loss=ipo algorithm.beta=0.5 data.train=FILE output_dir=DIR")


def run(args) -> int:
    from posttrain.training.dpo import load_dpo_config, run_dpo

    cfg = load_dpo_config(args.config, args.overrides)
    result = run_dpo(cfg)  # holds the output folder's run lock (posttrain.training.run.Run)
    done = f"dpo: done at step {result.final_step}"
    if result.losses:
        done += f", last loss {result.losses[-1][1]:.4f}"
    elif result.final_step == result.start_step:
        done += " (already finished: nothing to do)"
    e = result.eval_metrics
    if "eval/rewards/accuracies" in e:
        done += (f", held-out reward accuracy {e['eval/rewards/accuracies']:.3f}, "
                 f"margin {e['eval/rewards/margins']:.3f}")
    print(done + f"; outputs in {result.output_dir}")
    return 0
