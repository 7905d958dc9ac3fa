"""`posttrain rl CONFIG.yaml [key=value ...]`: a GRPO-family RL run from a typed config."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (see configs/rl_smoke.yaml, configs/gsm8k_grpo.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=DIR trainer.max_steps=10")


# `posttrain.cli.main` leaves `distributed.initialize` to the run skeleton (`posttrain.training.run.Run`),
# which reads the config's `distributed` section first.
DISTRIBUTED_FROM_CONFIG = True


def run(args) -> int:
    from posttrain import distributed
    from posttrain.rl.loop import load_rl_config, run_rl

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]
    cfg = load_rl_config(config, overrides)
    result = run_rl(cfg)  # holds the output folder's run lock (posttrain.training.run.Run)
    distributed.finish()  # multi-host: every process waits for the others (process 0's export), then leaves
    if not distributed.is_primary():
        return 0
    last = result.evals[-1] if result.evals else {}
    acc = f", held-out accuracy {last['eval/accuracy']:.3f}" if "eval/accuracy" in last else ""
    print(f"done: {result.steps} steps{acc}; outputs in {result.output_dir}")
    return 0
