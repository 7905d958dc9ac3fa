"""`posttrain demo [--output-dir DIR] [--seed S]`: the embedded default run, SFT then RL on CPU in minutes."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", default="outputs/demo", help="where configs, metrics, plot and checkpoints go")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, the model and both stages")
    p.add_argument("--reduced", action="store_true", help="a minute-long version that checks the plumbing only")


def run(args) -> int:
    from posttrain.demo.run import DemoSettings, run_demo
    from posttrain.training.runlock import RunLock

    with RunLock(args.output_dir):
        run_demo(args.output_dir, seed=args.seed, settings=DemoSettings.reduced() if args.reduced else None)
    return 0
