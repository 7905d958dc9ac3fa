"""The RL loop (GRPO family): rollouts -> batch -> policy update -> acknowledge, publish, log.

The same loop runs synchronous RL (rollouts sampled in-process on the trainer's devices, staleness 0)
and asynchronous RL (a Ray fleet of rollout workers pulling versioned weights from a parameter server,
`fleet.workers=N`): only the rollout source differs (`posttrain.rl.sources`, `posttrain.rl.fleet`).
The pieces are built once by `posttrain.rl.setup.build_rl` (a frozen `RLParts`); the loop below is a short body
of named steps over them (`posttrain.rl.steps`); the prompt groups, their leases and their exactly-once
accounting are the dispatcher's (`posttrain.rl.dispatcher`).

Resume is exact: prompt groups are positions in a stream fixed by the data seed, the dispatcher's state
(queued groups, buffered rollouts) is checkpointed with the trainer's, and a group's samples depend only
on (seed, its uid, the weights), not on which worker or call produced them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import jax

from posttrain.config import load_config
from posttrain.rl import metrics
from posttrain.rl.config import RLConfig
from posttrain.rl.setup import RLParts, build_rl
from posttrain.rl.sources import (
    DynamicSampling,
    GroupIntake,
    InProcessSource,
    RolloutSource,
)
from posttrain.rl.steps import (
    RLState,
    after_step,
    begin,
    check_environment,
    close,
    evaluate,
    finish,
    local_policy,
    save,
)
from posttrain.rl.verifiers_source import VerifiersSource
from posttrain.sampling import ProgramCache

__all__ = ["RLResult", "load_rl_config", "make_source", "run_rl", "train_step"]


@dataclasses.dataclass
class RLResult:
    output_dir: Path
    steps: int
    history: list[dict[str, float]]
    evals: list[dict[str, Any]]
    hf_dir: Path | None


def load_rl_config(path: str | Path | None, overrides=()) -> RLConfig:
    return load_config(RLConfig, path, list(overrides))


def run_rl(cfg: RLConfig, *, stop_after: int | None = None, parts: RLParts | None = None,
           program_cache: ProgramCache | None = None) -> RLResult:
    """Runs (or resumes) an RL job; `stop_after` ends the loop early, as a crash would (for resume tests).
    `parts`: the run of `cfg` already built (e.g. on-policy distillation's, with its own batch builder);
    `program_cache`: the compiled sampler programs of the caller's samplers of this model, to share."""
    parts = parts if parts is not None else build_rl(cfg, program_cache)
    state, source, step, hf_dir = RLState(), None, 0, None
    try:
        step = begin(parts, state)
        source = make_source(parts, state)
        source.publish(parts.run.trainer.params, step)
        if cfg.eval.at_start and step == 0:
            evaluate(parts, state, 0)
        while step < cfg.trainer.max_steps and (stop_after is None or step < stop_after):
            step += 1
            train_step(parts, state, source, step)
        if step >= cfg.trainer.max_steps:
            hf_dir = finish(parts, state, step)
    finally:
        if source is not None:
            source.close()
        close(parts, state)
    return RLResult(parts.run.out, step, state.history, state.evals, hf_dir)


def train_step(parts: RLParts, state: RLState, source: RolloutSource, step: int) -> None:
    """One trainer step: B scored groups from the source, the batch, the update, the acknowledgement and the
    publication of the new weights, then the step's metrics, logs, evaluation and checkpoint."""
    profiler = parts.run.profiler
    profiler.begin(step)  # trainer.profile: "rollout" and "update" are named ranges of the step's trace
    t0 = time.perf_counter()
    with profiler.phase("rollout"):
        rollouts = source.next(step)  # B scored groups, within the staleness bound
    check_environment(parts, state, step, rollouts)  # warnings; too many failed trajectories stop the run
    t1 = time.perf_counter()
    with profiler.phase("update"):
        batch, batch_metrics = parts.prepare(rollouts)  # advantages, masks, behaviour log-probs
        m = parts.learner.update(batch, step)  # ppo_epochs x minibatches (pi_old recomputed: a correction on)
        trained = source.commit(rollouts)  # the groups are trained: acknowledged
        source.publish(parts.run.trainer.params, step)  # the fleet's every publish_every steps
    t2 = time.perf_counter()
    m |= metrics.rollout_metrics(rollouts, parts.cfg.rewards.correctness) | batch_metrics | source.metrics(
        step, rollouts) | {"time/rollout_s": t1 - t0, "time/train_s": t2 - t1,
                           "throughput/tokens_per_s": float(rollouts.completion_lengths().sum()) / max(t2 - t0, 1e-9)}
    after_step(parts, state, step, m, rollouts, trained)  # ledger, logs, held-out eval, checkpoint
    profiler.end(step)


def make_source(parts: RLParts, state: RLState) -> RolloutSource:
    """The in-process sampler, or the Ray fleet when `fleet.workers` is set (on a multi-process trainer, process
    0 drives the fleet and the others follow it: `posttrain.rl.fleet.follower`)."""
    cfg = parts.cfg
    if parts.verifiers is not None:
        return VerifiersSource(group_intake(parts), local_policy(parts, state), parts.verifiers, parts.prompts.train,
                               parts.sampling, slots=cfg.rollout.slots, system_prompt=cfg.data.system_prompt)
    if not cfg.fleet.enabled:
        return InProcessSource(group_intake(parts), local_policy(parts, state), parts.prompts.train, parts.sampling,
                               parts.runner, parts.agent, record_experts=cfg.learner.routing_replay)
    # lazy: posttrain.rl.fleet loads Ray (seconds): only fleet runs need it
    from posttrain.rl.fleet import FleetFollower, FleetSource, check_hosts
    # lazy: posttrain.rl.fleet loads Ray (seconds): only fleet runs need it
    from posttrain.rl.fleet.source import worker_sections

    check_hosts(cfg.fleet)  # a multi-process trainer: where Ray can serve all of its processes
    keep = functools.partial(save, parts, wait=True)  # the checkpoint a stalled fleet leaves
    if jax.process_index() != 0:
        return FleetFollower(cfg.fleet, keep)
    return FleetSource.start(group_intake(parts), cfg.fleet, parts.prompts.train,
                             worker_sections(cfg, parts.preset, parts.prompts.data),
                             events=parts.run.out / "fleet_workers.jsonl", save=keep,
                             batch_prompts=cfg.rollout.batch_prompts)


def group_intake(parts: RLParts) -> GroupIntake:
    """The sources' side of the dispatcher: dynamic sampling per the preset, pass rates for curation."""
    cfg = parts.cfg
    dynamic = DynamicSampling(parts.preset.dynamic_sampling,
                              cfg.learner.max_resample_rounds * cfg.rollout.batch_prompts)
    return GroupIntake(parts.dispatcher, dynamic,
                       functools.partial(metrics.pass_rates, correctness=cfg.rewards.correctness))
