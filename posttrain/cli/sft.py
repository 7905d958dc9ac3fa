"""`posttrain sft CONFIG.yaml [key=value ...]`: supervised fine-tuning (full, LoRA, QLoRA) from a YAML config."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/sft_smoke.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model.path=tiny:llama data.train=FILE output_dir=DIR trainer.max_steps=N")


# `posttrain.cli.main` leaves `distributed.initialize` to this command: it reads the config's `distributed`.
DISTRIBUTED_FROM_CONFIG = True


def run(args) -> int:
    from posttrain import distributed
    from posttrain.training.runlock import RunLock
    from posttrain.training.sft import load_sft_config, run_sft

    cfg = load_sft_config(args.config, args.overrides)
    distributed.initialize(cfg.distributed)  # before any device is touched; a no-op on one process
    distributed.check_same_config(cfg)
    with RunLock(cfg.output_dir):
        result = run_sft(cfg)
    distributed.finish()
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
