"""`posttrain distill CONFIG.yaml [key=value ...]`: knowledge distillation from a teacher (logit or on-policy)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/distill_smoke.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. mode=on_policy teacher.path=DIR loss.kind=jsd loss.beta=0.5")


# `posttrain.cli.main` leaves `distributed.initialize` to the run skeleton (`posttrain.training.run.Run`),
# which reads the config's `distributed` section first.
DISTRIBUTED_FROM_CONFIG = True


def run(args) -> int:
    from posttrain import distributed
    from posttrain.distill.run import load_distill_config, run_distill

    cfg = load_distill_config(args.config, args.overrides)
    summary = run_distill(cfg)  # holds the output folder's run lock (posttrain.training.run.Run)
    distributed.finish()  # multi-host: every process waits for the others (process 0's export), then leaves
    if distributed.is_primary():
        print(summary)
    return 0
