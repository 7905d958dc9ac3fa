"""`posttrain sft CONFIG.yaml [key=value ...]`: supervised fine-tuning (full, LoRA, QLoRA) from a YAML config."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/sft_smoke.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model.path=tiny:llama data.train=FILE output_dir=DIR trainer.max_steps=N")


def run(args) -> int:
    import sys

    from posttrain.config import ConfigError

    try:
        from posttrain.training.sft import load_sft_config

        cfg = load_sft_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from posttrain.data.sources import DataError
    from posttrain.models.hf_io import CheckpointError
    from posttrain.tokenizer import TokenizerError
    from posttrain.training.sft import ResumeError, TrainingDivergedError, run_sft

    try:
        result = run_sft(cfg)
    except (ConfigError, DataError, CheckpointError, TokenizerError, TrainingDivergedError, ResumeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    last = result.losses[-1][1] if result.losses else float("nan")
    print(f"sft: done at step {result.final_step}, last loss {last:.4f}"
          + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
          + f"; outputs in {result.output_dir}")
    return 0
