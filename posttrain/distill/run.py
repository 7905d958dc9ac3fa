"""`posttrain distill`: the config, and one entry point for both modes (logit, on-policy)."""

from __future__ import annotations

from pathlib import Path

from posttrain.config import ConfigError, load_config
from posttrain.distill.config import DistillConfig
from posttrain.distill.logit import run_logit
from posttrain.distill.on_policy import run_on_policy

__all__ = ["load_distill_config", "run_distill"]


def load_distill_config(path: str | Path | None, overrides=()):
    """DistillConfig from a YAML file and `key=value` overrides (unknown keys are a ConfigError)."""
    cfg = load_config(DistillConfig, path, list(overrides))
    if cfg.mode == "logit" and not cfg.data.train:
        raise ConfigError("data.train: logit distillation needs SFT data (set data.train=FILE)")
    if cfg.mode == "on_policy" and not cfg.on_policy.prompts.train:
        raise ConfigError("on_policy.prompts.train: on-policy distillation needs prompts (set "
                          "on_policy.prompts.train=FILE)")
    return cfg


def run_distill(cfg, *, stop_after: int | None = None) -> str:
    """Runs (or resumes) the distillation `cfg` describes; returns a one-line summary."""
    if cfg.mode == "on_policy":
        res = run_on_policy(cfg, stop_after=stop_after)
        kl = [h["distill/reverse_kl"] for h in res.history]
        first = f", reverse KL on own samples {kl[0]:.4f} -> {kl[-1]:.4f}" if kl else ""
        return f"distill (on-policy): {res.steps} steps{first}; outputs in {res.output_dir}"
    res = run_logit(cfg, stop_after=stop_after)
    last = f", last loss {res.losses[-1][1]:.4f}" if res.losses else ""
    return f"distill (logit): done at step {res.final_step}{last}; outputs in {res.output_dir}"
