"""Typed config of an RL run (`posttrain rl CONFIG.yaml key=value ...`): the shared run sections (`RunConfig`)
plus prompts, rollouts, the algorithm, the learner, rewards, evaluation, curation and the fleet.

The algorithm section is the typed preset itself (`posttrain.algorithms.registry.GRPOFamily`): `preset` names one
(`grpo`, `dr_grpo`, `dapo`, `gspo`, `rloo`: classes which hold the defaults) and any other key set overrides that
preset's value. How a rollout batch is trained on (epochs, minibatches, old log-probs, off-policy correction) is
the learner's. The rollout section (`RolloutConfig`, the rollout layer's: `posttrain.rollout.config`, which
`posttrain eval` and `generate` fill too) holds the agent's limits (`posttrain.agent.rollout.AgentLimits`, whose
keys and defaults it takes as they are).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from posttrain.algorithms.correction import RolloutCorrection
from posttrain.algorithms.registry import PRESETS, GRPOFamily
from posttrain.config import at_least
from posttrain.rollout.config import RolloutConfig
from posttrain.training.config import OptimConfig, RunConfig, TrainerConfig


@dataclasses.dataclass
class PromptData:
    """Prompt sets: `train` and optional held-out `eval` (JSONL/JSON/Parquet/datasets, or
    `reasoning_gym:TASK?size=N&seed=S`), with field names.

    Every other column (e.g. `answer`) is passed to the rewards as a keyword argument.
    train: the training prompt set (required).
    eval: the held-out prompt set of the periodic evaluation (the `eval` section); None = none.
    prompt_field: the column holding the prompt; left at `prompt` and absent from the first record, the first of
      question, problem, messages it has (as `posttrain eval`); with `rollout.environment`, none is needed
      (the environment's `reset` makes the conversation).
    chat: render prompts with the tokenizer's chat template (a `messages` list always is).
    system_prompt: a system turn put first in a prompt rendered with the chat template that has none (text with
      `chat`, message lists, image prompts, the first messages of tool rollouts; not an environment's, whose
      `reset` makes the conversation); None = none.
    shuffle: draw the training prompts in a random order, a fresh permutation each pass over the set (false:
      file order).
    seed: seed of that order (sampling draws from `trainer.seed`).
    max_prompt_tokens: a prompt longer than this many tokens (as rendered) is a config error naming its file
      and line.
    eval_limit: evaluate only the first N held-out prompts; 0 = all of them.
    """

    train: str = ""
    eval: str | None = None
    prompt_field: str = "prompt"
    chat: bool = False
    system_prompt: str | None = None
    shuffle: bool = True
    seed: int = 0
    max_prompt_tokens: int = 512
    eval_limit: int = 0


@dataclasses.dataclass
class LearnerConfig(RolloutCorrection):
    """How a rollout batch is trained on (`posttrain.rl.learner`). The rollout correction's keys (`is_level`,
    `is_mode`, `is_cap`, `is_low`, `rejection`, `rejection_low`, `rejection_high`) are
    `posttrain.algorithms.correction.RolloutCorrection`'s, with its defaults: with any of them on, the proximal
    log-probs are the trainer's own, recomputed before every update, and `mismatch_kl` compares them with the
    sampler's.

    ppo_epochs x minibatches: optimizer steps per rollout batch (minibatches per epoch).
    old_logprobs: the proximal (old) log-probs without a rollout correction (is_level=none, rejection=none): the
      sampler's (the PPO ratio is then against the sampler: verl's "bypass" mode, no extra forward pass), or
      recomputed by the trainer before the update. With a correction on they are always recomputed.
    max_resample_rounds: dynamic sampling: extra sampling rounds to fill the batch, at most.
    pack: pack each minibatch's prompt+completion sequences into rows (segment ids, positions per sequence;
      attention never crosses sequences) instead of padding every sequence to the longest, for the update and
      the old/reference log-probs alike (`posttrain.rl.packing`); the loss and its gradient are the same.
    share_prompts: pack (as `pack`), and let a row hold one prompt and several of its completions, so that the
      group's shared prompt goes through the layers once a row instead of once a sequence; per batch, the packer
      takes whichever layout computes least (`posttrain.rl.packing.pack_cheapest`: a longer row pays more
      attention). The loss and its gradient are the padded batch's. None (the default): on, unless the prompts
      carry images (those train on padded batches); `false` with `pack: false` gives padded batches.
    routing_replay: a mixture of experts' routing replay: the sampler records the experts it routed every token to
      (in-process and on the fleet, through multi-turn continuations), and the learner's log-prob recomputation
      and update route each token to them, gate weights from the current router over them
      (`posttrain.models.moe`); logs `moe/router_agreement` (how often the trainer's own router chose the same
      experts, in the same pass). The reference model (beta > 0) does not replay. A dense model: a config error.
    """

    ppo_epochs: int = 1
    minibatches: int = 1
    old_logprobs: Literal["sampler", "recompute"] = "sampler"
    max_resample_rounds: int = 3
    pack: bool = False
    share_prompts: bool | None = None
    routing_replay: bool = False

    def __post_init__(self):
        super().__post_init__()
        at_least("learner.ppo_epochs", self.ppo_epochs, 1)
        at_least("learner.minibatches", self.minibatches, 1)
        at_least("learner.max_resample_rounds", self.max_resample_rounds, 0)


@dataclasses.dataclass
class RewardConfig:
    """One reward: a built-in name (`math_answer`, `format`, `overlong_penalty`, `reasoning_gym`, `judge`),
    `module:function` or `file.py:function`.

    name: which reward: a built-in name (also `exact_answer`), `module:function` or `file.py:function`; a
      completion's reward is the weighted sum over `rewards.functions`.
    weight: this reward's factor in that sum.
    kwargs: settings of a reward factory (e.g. `overlong_penalty`'s max_length and cache_length, the `judge`'s url,
      model, template, score: `posttrain.rewards.judge.JudgeConfig`), or else keyword arguments passed to every
      call.
    """

    name: str = "math_answer"
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RewardsSection:
    """The rewards of the sampled completions (`posttrain.rewards`): their functions, which one says "correct",
    and how failures and time limits are handled.

    functions: the rewards (a list of `name`, `weight`, `kwargs`); a completion's reward is their weighted sum.
    correctness: the reward whose value >= 1 means a correct answer (accuracy, pass@k and maj@k, whose answers
      its extractor reads, and curation's pass rates); None (or a name not among functions): a total reward > 0
      is correct.
    timeout_s: seconds for one reward call on one chunk of (8) completions; past it they get failure_value.
    failure_value: the value a reward gives a completion where it raised, timed out, or returned the wrong
      length, a NaN or a non-number (counted in `reward/<name>/failures`).
    num_workers: processes that run the reward calls; 0 = in this process (its time limit then soft).
    max_failed_steps: stop the run when a reward has failed on every completion in this many scoring calls in
      a row (one call per sampled batch of groups: a lease's); 0 = never.
    """

    functions: list[RewardConfig] = dataclasses.field(default_factory=lambda: [RewardConfig()])
    correctness: str | None = "math_answer"
    timeout_s: float = 10.0
    failure_value: float = 0.0
    num_workers: int = 2
    max_failed_steps: int = 3


@dataclasses.dataclass
class EvalSection:
    """The held-out evaluation of `data.eval` with the trainer's current weights (`posttrain.eval`): greedy
    accuracy (`eval/accuracy`), mean reward and length, and optionally sampled pass@k and maj@k.

    every: trainer steps between held-out evaluations; 0 = only at the start and the end (the last step always
      evaluates).
    at_start: evaluate before the first step of a fresh run (logged as step 0: the baseline).
    k: also sample each problem n = max(n_samples, k) times and report `eval/pass@1_sampled` and, for k > 1,
      `eval/pass@k` and `eval/maj@k` (exact expectations over those n draws); 0 = greedy accuracy only.
    n_samples: draws per problem for pass@k (at least k); ignored when k is 0.
    temperature: sampling temperature of the pass@k draws (the greedy pass is at 0).
    log_samples: greedy completions written to samples.jsonl per evaluation; also how many multi-turn
      trajectories (plus as many the environment failed) go to trajectories.jsonl per logged training step.
    """

    every: int = 0
    at_start: bool = True
    k: int = 0
    n_samples: int = 0
    temperature: float = 1.0
    log_samples: int = 4


@dataclasses.dataclass
class CurationConfig:
    """Skip prompts that no longer teach anything (RLAX): a prompt whose last `window` trained groups were all
    solved (or all unsolved) is not sampled again. window 0 = off.

    window: trained groups of a prompt looked at (its last ones); 0 = curation off. When every prompt is
      curated, they are sampled anyway until one leaves curation (counted in curation/exhausted_passes).
    skip_always_solved: skip a prompt whose every completion was correct (`rewards.correctness`) in each of its
      last `window` groups.
    skip_never_solved: skip a prompt none of whose completions was correct in those groups.
    """

    window: int = 0
    skip_always_solved: bool = True
    skip_never_solved: bool = True

    def __post_init__(self):
        at_least("curation.window", self.window, 0, "0 = off")


_WORKER_RANGE = re.compile(r"\s*(\d+)\s*\.\.\s*(\d+)\s*")


def worker_bounds(workers: int | str | None) -> tuple[int, int]:
    """(MIN, MAX) workers of `fleet.workers` (N: (N, N); "MIN..MAX"; unset: (0, 0)); ValueError naming the key
    and the accepted forms for anything else."""
    if workers is None:
        return 0, 0
    if isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1:
        return workers, workers
    m = _WORKER_RANGE.fullmatch(workers) if isinstance(workers, str) else None
    if m and 1 <= int(m[1]) <= int(m[2]):
        return int(m[1]), int(m[2])
    raise ValueError(f"fleet.workers must be a count N >= 1 (a fixed fleet) or a range MIN..MAX with 1 <= MIN <= MAX "
                     f"(an elastic fleet, e.g. 2..8), found {workers!r}; leave it unset to sample in-process")


@dataclasses.dataclass
class FleetConfig:
    """The asynchronous rollout fleet on Ray (`posttrain.rl.fleet`). `workers` unset = sample in-process.

    workers: N (a fixed fleet: N workers, restarted by Ray up to max_restarts times each) or "MIN..MAX" (an
      elastic fleet: as many workers as the Ray nodes offering worker_cpus/gpus/resources hold, up to MAX; a
      worker that fails more than max_restarts times, or whose node leaves, is dropped; fewer than MIN serving
      for stall_timeout_s stops the run).

    max_staleness: versions a trained group may lag the weights it updates (0 = synchronous RL).
    publish_every: trainer steps between weight publications (at most max_staleness + 1).
    keep_versions: published weight versions the parameter server holds (the newest ones; older ones are
      dropped); workers always pull the newest.
    lease_groups: prompt groups per worker request (0 = batch_prompts / workers, rounded up).
    lease_timeout_s: a lease not completed within this many seconds goes back to the queue and its worker is
      killed (Ray restarts it).
    transfer_dtype: "bfloat16" halves the published weights (floating arrays) on the wire.
    ray_address: None starts a local Ray; "auto" or HOST:PORT joins a running cluster (`ray start`).
    worker_resources: Ray resources each worker asks for besides its CPUs/GPUs (e.g. {"rollout": 1}).
    stall_timeout_s: no result from any worker for this long stops the run (after a checkpoint);
      start_timeout_s applies instead until the first result arrives (model loads and compiles).
    start_timeout_s: that limit until the first result (at least stall_timeout_s).
    max_restarts: restarts Ray makes of each worker (-1: without limit); in an elastic fleet, a worker that
      failed more often than this is dropped and its node gets no new worker.
    worker_cpus, worker_gpus: CPUs and GPUs each worker asks Ray for (fractions share a device; 0 GPUs = none);
      a local Ray started for the run gets at least (most workers) x worker_cpus CPUs.
    connect_timeout_s: seconds to reach the Ray head at a HOST:PORT `ray_address` before that is an error (a
      multi-process trainer's other processes also wait this much longer for one joining Ray).
    heartbeat_timeout_s: a worker that answers no heartbeat for this long (or pulls weights that long) is
      restarted and its leases re-queued.
    swap: when a worker takes newer published weights: "lease" (at the start of each lease) or "segment"
      (partial rollouts: also between decode segments of a lease, so long completions do not pin old weights;
      the KV caches of sequences in flight are kept). Every token carries the version that produced it, and its
      behaviour log-prob is the one it was drawn with; staleness is bounded on a group's first token's version.
    segment_steps: decode steps per segment on the workers (0 = the sampler's 128): with swap=segment, the
      most tokens a sequence decodes before a newer version can reach it.
    """

    workers: int | str | None = None
    max_staleness: int = 1
    publish_every: int = 1
    keep_versions: int = 2
    lease_groups: int = 0
    lease_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 120.0
    stall_timeout_s: float = 300.0
    start_timeout_s: float = 900.0
    max_restarts: int = 5
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    transfer_dtype: Literal["native", "bfloat16"] = "native"
    swap: Literal["lease", "segment"] = "lease"
    segment_steps: int = 0
    ray_address: str | None = None
    connect_timeout_s: float = 30.0

    def __post_init__(self):
        lo, hi = worker_bounds(self.workers)
        if self.elastic:
            self.workers = f"{lo}..{hi}"  # the canonical spelling in the saved config
        at_least("fleet.max_staleness", self.max_staleness, 0, "0 = synchronous")
        if not 1 <= self.publish_every <= self.max_staleness + 1:
            raise ValueError(f"fleet.publish_every must be in [1, fleet.max_staleness + 1 = {self.max_staleness + 1}], "
                             f"found {self.publish_every}")
        at_least("fleet.keep_versions", self.keep_versions, 1)
        at_least("fleet.lease_groups", self.lease_groups, 0)
        at_least("fleet.max_restarts", self.max_restarts, -1)
        at_least("fleet.segment_steps", self.segment_steps, 0, "0 = the sampler's default")

    @property
    def enabled(self) -> bool:
        return self.workers is not None

    @property
    def elastic(self) -> bool:
        """`workers` is a range MIN..MAX (the fleet grows and shrinks with the Ray nodes)."""
        return isinstance(self.workers, str)

    @property
    def min_workers(self) -> int:
        return worker_bounds(self.workers)[0]

    @property
    def max_workers(self) -> int:
        return worker_bounds(self.workers)[1]


@dataclasses.dataclass
class RLConfig(RunConfig):
    """A GRPO-family RL run: everything `posttrain rl CONFIG.yaml` needs (the shared sections: `RunConfig`).

    algorithm: the GRPO-family algorithm (`posttrain.algorithms.registry.GRPOFamily`): `preset` names one (grpo,
      dr_grpo, dapo, gspo, rloo), whose defaults the section's other keys override.
    """

    output_dir: str = "outputs/rl"
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-6, decay="constant"))
    trainer: TrainerConfig = dataclasses.field(default_factory=lambda: TrainerConfig(log_every=1, save_every=50))
    data: PromptData = dataclasses.field(default_factory=PromptData)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    # the typed preset; a default, not a factory: a section given in part starts from its own preset's defaults
    algorithm: GRPOFamily = dataclasses.field(default=PRESETS["grpo"])
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    rewards: RewardsSection = dataclasses.field(default_factory=RewardsSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    curation: CurationConfig = dataclasses.field(default_factory=CurationConfig)
    fleet: FleetConfig = dataclasses.field(default_factory=FleetConfig)

    def __post_init__(self):
        if self.algorithm.advantage == "rloo" and self.rollout.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 for RLOO")


