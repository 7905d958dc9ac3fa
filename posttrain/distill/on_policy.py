"""On-policy distillation: the student samples, the teacher scores the same tokens, the per-token reverse KL
is the training signal, through the RL loop and learner.

For a completion y ~ q (the student) of prompt x, with q_t = q(y_t | x, y_<t) and p_t the teacher's:

    advantage_t = -(log q_t - log p_t)                (stop-gradient; Agarwal et al. 2024, GKD with beta = 1
                                                       on student samples; Lu & Thinking Machines 2025,
                                                       "On-Policy Distillation")

and the token-level policy-gradient loss -Σ_t A_t log q_t / Σ_t 1 (ratio 1 on policy) has the gradient of
the per-token reverse KL, KL(q || p), estimated on the student's own samples (each token's immediate term;
no discounting over later tokens). The student's log-probs are the sampler's (its behaviour policy at
temperature 1); the teacher's come from a `FrozenScorer` (a frozen model, no optimizer state). Everything
else (data stream, checkpoints and exact resume, logs, held-out evaluation, HF export) is the RL run's: the
distillation is the RL parts (`posttrain.rl.setup.build_rl`) with its own batch builder, `TeacherAdvantages`.
Metric: `distill/reverse_kl`, the mean of log q_t - log p_t over the step's sampled tokens (an unbiased
estimate of the per-token KL(q || p) on the student's own samples).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from posttrain import distributed
from posttrain.config import ConfigError, save_config
from posttrain.distill.teacher import (
    check_same_vocabulary,
    load_teacher,
    teacher_folder,
)
from posttrain.models import tokenizer as tok_lib
from posttrain.models.spec import resolve_checkpoint
from posttrain.rl.batch import RLBatch, build_rl_batch
from posttrain.rl.learner import FrozenScorer
from posttrain.rl.loop import run_rl
from posttrain.rl.setup import RLParts, build_rl
from posttrain.rl.steps import close
from posttrain.rollout.rollouts import Rollouts

__all__ = ["TeacherAdvantages", "build_on_policy", "run_on_policy"]


@dataclasses.dataclass(frozen=True)
class TeacherAdvantages:
    """On-policy distillation's batch builder (the RL parts' `prepare`): the RL batch with per-token advantages
    -(log q - log p) on the completion tokens, and `distill/reverse_kl` (module docstring)."""

    teacher: FrozenScorer
    pad_id: int
    columns: tuple[int, int] = (0, 0)  # (P, C) at least (`posttrain.rl.prompts.batch_columns`)

    def __call__(self, ro: Rollouts) -> tuple[RLBatch, dict[str, float]]:
        batch = build_rl_batch(ro, np.zeros(len(ro), np.float32), pad_id=self.pad_id, at_least=self.columns)
        mask = batch.loss_mask
        teacher_logp = self.teacher(batch.model_inputs(), last=batch.completion_len)
        log_ratio = (batch.behaviour_logp - teacher_logp) * mask  # the sampler's log q minus the teacher's log p
        kl = float(log_ratio.sum() / max(mask.sum(), 1.0))
        return batch.replace(advantages=(-log_ratio).astype(np.float32)), {"distill/reverse_kl": kl}


def build_on_policy(dcfg) -> RLParts:
    """The RL run's parts for the distillation `dcfg`, with the teacher (a frozen scorer on the trainer's mesh) as
    the batch builder; the output folder's config.yaml is the distillation's."""
    if dcfg.on_policy.rollout.temperature != 1.0:
        raise ConfigError(f"on_policy.rollout.temperature={dcfg.on_policy.rollout.temperature}: on-policy "
                          "distillation samples from the student itself (temperature 1.0)")
    # the tokenizers first: a teacher with another vocabulary fails before the run starts or any weight loads
    s_tok = tok_lib.load(resolve_checkpoint(dcfg.model.path))
    check_same_vocabulary(s_tok, tok_lib.load(teacher_folder(dcfg.teacher)), student=dcfg.model.path,
                          teacher=dcfg.teacher.path)
    parts = build_rl(dcfg.rl_config())
    try:
        if distributed.is_primary():  # the distillation config, not the RL one (multi-host: written once)
            save_config(dcfg, parts.run.out / "config.yaml")
        trainer = parts.run.trainer
        teacher = load_teacher(dcfg.teacher, dcfg.model, parts.tok, trainer.cfg.vocab_size, parts.run.mesh)
        scorer = FrozenScorer(teacher, trainer, parts.cfg.trainer.loss_chunk_size or None)
        return dataclasses.replace(parts, prepare=TeacherAdvantages(scorer, parts.tok.pad_token_id or 0,
                                                                           parts.prepare.columns))
    except BaseException:
        close(parts)
        raise


def run_on_policy(dcfg, *, stop_after: int | None = None):
    """Runs (or resumes) an on-policy distillation (an `RLResult`)."""
    parts = build_on_policy(dcfg)
    return run_rl(parts.cfg, stop_after=stop_after, parts=parts)
