"""Typed config of an RL run (`posttrain rl CONFIG.yaml key=value ...`): the shared run sections (`RunConfig`)
plus prompts, rollouts, the algorithm, the learner, rewards, evaluation, curation and the fleet.

The algorithm section starts from a named preset (`grpo`, `dr_grpo`, `dapo`, `gspo`, `rloo`: typed classes in
`posttrain.algorithms.registry`, which hold the defaults) and any field set to a value overrides the preset's.
How a rollout batch is trained on (epochs, minibatches, old log-probs, off-policy correction) is the learner's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, Literal

from posttrain.config import at_least
from posttrain.tools.python_sandbox import SandboxConfig
from posttrain.training.config import OptimConfig, RunConfig, TrainerConfig


@dataclasses.dataclass
class PromptData:
    """Prompt sets: `train` and optional held-out `eval` (JSONL/JSON/Parquet/datasets, or
    `reasoning_gym:TASK?size=N&seed=S`), with field names.

    Every other column (e.g. `answer`) is passed to the rewards as a keyword argument.
    prompt_field: the column holding the prompt; left at `prompt` and absent from the first record, the first of
      question, problem, messages it has (as `posttrain eval`); with `rollout.environment`, none is needed
      (the environment's `reset` makes the conversation).
    chat: render prompts with the tokenizer's chat template (a `messages` list always is).
    """

    train: str = ""
    eval: str | None = None
    prompt_field: str = "prompt"
    chat: bool = False
    system_prompt: str | None = None
    shuffle: bool = True
    seed: int = 0
    max_prompt_tokens: int = 512
    eval_limit: int = 0  # 0 = every held-out prompt


@dataclasses.dataclass
class RolloutConfig:
    """Sampling of the G completions per prompt (G = group_size).

    Multi-turn rollouts (`posttrain.agent`), on when `tools` or `environment` is set: `tools` are references
    like reward functions (`calculator`, `posttrain.tools:calculator`, `my_tools.py:search`); `environment` a
    class (`my_env.py:Wordle`) whose public typed methods are tools too. `tool_format`: how the model writes
    calls (hermes `<tool_call>`, llama3 JSON, mistral `[TOOL_CALLS]`). Limits per trajectory: `max_turns`
    assistant turns, `max_tool_calls` calls in all, `max_tool_output_tokens` per result (cut with a marker),
    `tool_timeout_s` per call; `tool_workers` processes run the calls; `sandbox`: where the built-in `python`
    tool runs model-written code (`posttrain.tools.python_sandbox.SandboxConfig`: the kernel's namespaces by
    default, a SandboxFusion service, or an explicitly unsafe plain process). `max_new_tokens` is then each turn's
    budget, and `max_total_tokens` the trajectory's after the prompt, sampled and appended tokens together
    (0: max_turns x max_new_tokens); an append past it ends the trajectory as `truncated`.
    An environment's `reset`, `step`, `reward` and tool methods get `tool_timeout_s` too; one that times out,
    raises or returns the wrong type ends its trajectory (`agent/env_errors`), and when more than
    `max_env_error_fraction` of one step's trajectories end so, the run stops with an error (1: never).
    """

    batch_prompts: int = 8
    group_size: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_slots: int = 0  # concurrent sequences in the sampler (0 = all of a step's rollouts)
    stop_token_ids: list[int] | None = None
    tools: list[str] = dataclasses.field(default_factory=list)
    environment: str | None = None
    tool_format: Literal["hermes", "llama3", "mistral"] = "hermes"
    max_turns: int = 8
    max_tool_calls: int = 16
    max_tool_output_tokens: int = 512
    tool_timeout_s: float = 10.0
    tool_workers: int = 4
    max_total_tokens: int = 0
    max_env_error_fraction: float = 0.5
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or bool(self.environment)

    @property
    def completion_budget(self) -> int:
        """Tokens after the prompt at most: max_new_tokens, or a multi-turn trajectory's total."""
        if not self.multi_turn:
            return self.max_new_tokens
        return self.max_total_tokens or self.max_turns * self.max_new_tokens

    def __post_init__(self):
        at_least("rollout.max_turns", self.max_turns, 1)
        at_least("rollout.max_tool_calls", self.max_tool_calls, 0)
        at_least("rollout.max_tool_output_tokens", self.max_tool_output_tokens, 1)
        at_least("rollout.tool_workers", self.tool_workers, 1)
        at_least("rollout.max_total_tokens", self.max_total_tokens, 0, "0 = max_turns x max_new_tokens")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.tool_timeout_s must be > 0, found {self.tool_timeout_s}")
        if not 0 <= self.max_env_error_fraction <= 1:
            raise ValueError("rollout.max_env_error_fraction must be between 0 and 1 (1: never stop), found "
                             f"{self.max_env_error_fraction}")


@dataclasses.dataclass
class LearnerConfig:
    """How a rollout batch is trained on (`posttrain.rl.learner`).

    ppo_epochs x minibatches: optimizer steps per rollout batch (minibatches per epoch).
    old_logprobs: the proximal (old) log-probs are the sampler's, or recomputed by the trainer before the update.
    is_level, is_cap: off-policy correction (`posttrain.algorithms.policy.truncated_is_weights`): the loss's
      proximal log-probs are the trainer's (recomputed whenever the policy moved since sampling, or always with
      old_logprobs=recompute), and each token (or sequence) is weighted by min(pi_old / pi_sampler, is_cap);
      none = off.
    max_resample_rounds: dynamic sampling: extra sampling rounds to fill the batch, at most.
    pack: pack each minibatch's prompt+completion sequences into rows (segment ids, positions per sequence;
      attention never crosses sequences) instead of padding every sequence to the longest, for the update and
      the old/reference log-probs alike (`posttrain.rl.packing`); the loss and its gradient are the same.
    share_prompts: pack (as `pack`), and let a row hold one prompt and several of its completions, so that the
      group's shared prompt goes through the layers once a row instead of once a sequence; per batch, the packer
      takes whichever layout computes least (`posttrain.rl.packing.pack_cheapest`: a longer row pays more
      attention). The loss and its gradient are the padded batch's. None (the default): on, unless the prompts
      carry images (those train on padded batches); `false` with `pack: false` gives padded batches.
    """

    ppo_epochs: int = 1
    minibatches: int = 1
    old_logprobs: Literal["sampler", "recompute"] = "sampler"
    is_level: Literal["token", "sequence", "none"] = "token"
    is_cap: float = 2.0
    max_resample_rounds: int = 3
    pack: bool = False
    share_prompts: bool | None = None

    def __post_init__(self):
        at_least("learner.ppo_epochs", self.ppo_epochs, 1)
        at_least("learner.minibatches", self.minibatches, 1)
        at_least("learner.max_resample_rounds", self.max_resample_rounds, 0)


@dataclasses.dataclass
class AlgorithmConfig:
    """The GRPO-family algorithm: a preset plus overrides (None = keep the preset's value)."""

    # keys that were here and live elsewhere now: an old config naming one gets a ConfigError naming the new key
    MOVED_KEYS: ClassVar[dict[str, str]] = {f.name: f"learner.{f.name}" for f in dataclasses.fields(LearnerConfig)}

    preset: Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"] = "grpo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] | None = None
    ratio_level: Literal["token", "sequence"] | None = None
    epsilon_low: float | None = None
    epsilon_high: float | None = None
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] | None = None
    beta: float | None = None
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    dynamic_sampling: bool | None = None
    overlong_filtering: bool | None = None
    overlong_penalty: bool | None = None

    def resolved(self):
        """The typed preset (`posttrain.algorithms.registry.GRPOFamily`, the one source of the defaults) with
        every field set here applied."""
        # lazy: algorithms/ loads JAX; the config classes import without it
        from posttrain.algorithms.registry import get_preset

        settings = dataclasses.asdict(self)
        name = settings.pop("preset")
        return get_preset(name, **{k: v for k, v in settings.items() if v is not None})


@dataclasses.dataclass
class RewardConfig:
    """One reward: a built-in name (`math_answer`, `format`, `overlong_penalty`, `reasoning_gym`), `module:function`
    or `file.py:function`."""

    name: str = "math_answer"
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RewardsSection:
    functions: list[RewardConfig] = dataclasses.field(default_factory=lambda: [RewardConfig()])
    correctness: str | None = "math_answer"  # the reward whose 1.0 means "correct" (accuracy metrics)
    timeout_s: float = 10.0
    failure_value: float = 0.0
    num_workers: int = 2
    max_failed_steps: int = 3  # stop when a reward fails on every completion this many scoring calls in a row (0: never)


@dataclasses.dataclass
class EvalConfig:
    every: int = 0  # steps between held-out evaluations (0 = only at the start and end)
    at_start: bool = True
    k: int = 0  # pass@k with n_samples draws (0 = greedy pass@1 only)
    n_samples: int = 0
    temperature: float = 1.0
    log_samples: int = 4  # completions written to samples.jsonl per evaluation and logged as text


@dataclasses.dataclass
class CurationConfig:
    """Skip prompts that no longer teach anything (RLAX): a prompt whose last `window` trained groups were all
    solved (or all unsolved) is not sampled again. window 0 = off."""

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
    lease_groups: prompt groups per worker request (0 = batch_prompts / workers, rounded up).
    transfer_dtype: "bfloat16" halves the published weights (floating arrays) on the wire.
    ray_address: None starts a local Ray; "auto" or HOST:PORT joins a running cluster (`ray start`).
    worker_resources: Ray resources each worker asks for besides its CPUs/GPUs (e.g. {"rollout": 1}).
    stall_timeout_s: no result from any worker for this long stops the run (after a checkpoint);
      start_timeout_s applies instead until the first result arrives (model loads and compiles).
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
    """A GRPO-family RL run: everything `posttrain rl CONFIG.yaml` needs (the shared sections: `RunConfig`)."""

    output_dir: str = "outputs/rl"
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-6, decay="constant"))
    trainer: TrainerConfig = dataclasses.field(default_factory=lambda: TrainerConfig(log_every=1, save_every=50))
    data: PromptData = dataclasses.field(default_factory=PromptData)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    rewards: RewardsSection = dataclasses.field(default_factory=RewardsSection)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    curation: CurationConfig = dataclasses.field(default_factory=CurationConfig)
    fleet: FleetConfig = dataclasses.field(default_factory=FleetConfig)
