"""`posttrain demo [--task arith|tools] [--output-dir DIR] [--seed S]`: the embedded default run, SFT then RL on
CPU in minutes; `--task tools` is the multi-turn version where the model learns to call a calculator."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=["arith", "tools"], default="arith",
                   help="arith (default): chained additions; tools: 3-digit products with a calculator tool")
    p.add_argument("--output-dir", default=None, help="where configs, metrics, plot and checkpoints go "
                   "(default outputs/demo, or outputs/demo_tools with --task tools)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, the model and both stages")
    p.add_argument("--reduced", action="store_true", help="a minute-long version that checks the plumbing only")


def run(args) -> int:
    from posttrain.training.runlock import RunLock

    out = args.output_dir or ("outputs/demo_tools" if args.task == "tools" else "outputs/demo")
    with RunLock(out):
        if args.task == "tools":
            from posttrain.demo.tools_run import ToolsDemoSettings, run_tools_demo

            run_tools_demo(out, seed=args.seed, settings=ToolsDemoSettings.reduced() if args.reduced else None)
        else:
            from posttrain.demo.run import DemoSettings, run_demo

            run_demo(out, seed=args.seed, settings=DemoSettings.reduced() if args.reduced else None)
    return 0
