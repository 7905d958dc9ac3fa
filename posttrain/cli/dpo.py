"""`posttrain dpo CONFIG.yaml [key=value ...]`: preference tuning (DPO, IPO, hinge, robust/cDPO, SimPO, ORPO)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/dpo_smoke.yaml, configs/dpo_qwen2.5_0.5b.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. algorithm.loss=ipo algorithm.beta=0.5 data.train=FILE output_dir=DIR")


# `posttrain.cli.main` leaves `distributed.initialize` to the run skeleton (`posttrain.training.run.Run`),
# which reads the config's `distributed` section first.
DISTRIBUTED_FROM_CONFIG = True


def run(args) -> int:
    from posttrain import distributed
    from posttrain.training.dpo import load_dpo_config, run_dpo

    cfg = load_dpo_config(args.config, args.overrides)
    result = run_dpo(cfg)  # holds the output folder's run lock (posttrain.training.run.Run)
    distributed.finish()  # multi-host: every process waits for the others (process 0's export), then leaves
    if not distributed.is_primary():
        return 0
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
