"""`posttrain sft CONFIG.yaml [key=value ...]`: supervised fine-tuning (full, LoRA, QLoRA) from a YAML config."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/sft_smoke.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model.path=tiny:llama data.train=FILE output_dir=DIR trainer.max_steps=N")


# `posttrain.cli.main` leaves `distributed.initialize` to the run skeleton (`posttrain.training.run.Run`),
# which reads the config's `distributed` section first.
DISTRIBUTED_FROM_CONFIG = True


def run(args) -> int:
    from posttrain import distributed
    from posttrain.training.sft import load_sft_config, run_sft

    cfg = load_sft_config(args.config, args.overrides)
    result = run_sft(cfg)  # holds the output folder's run lock (posttrain.training.run.Run)
    distributed.finish()  # multi-host: every process waits for the others (process 0's export), then leaves
    if not distributed.is_primary():
        return 0
    done = f"sft: done at step {result.final_step}"
    if result.losses:
        done += f", last loss {result.losses[-1][1]:.4f}"
    elif result.final_step == result.start_step:
        done += " (already finished: nothing to do)"
    print(done + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
          + f"; outputs in {result.output_dir}")
    return 0
