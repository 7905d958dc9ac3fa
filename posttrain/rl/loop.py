"""The RL loop (GRPO family): rollouts -> batch -> policy update -> acknowledge, publish, log.

The same loop runs synchronous RL (rollouts sampled in-process on the trainer's devices, staleness 0)
and asynchronous RL (a Ray fleet of rollout workers pulling versioned weights from a parameter server,
`fleet.workers=N`): only the rollout source differs (`posttrain.rl.sources`, `posttrain.rl.fleet`).
Set-up and the named steps live in `posttrain.rl.setup.RLRun`; the prompt groups, their leases and
their exactly-once accounting in `posttrain.rl.dispatcher`.

Resume is exact: prompt groups are positions in a stream fixed by the data seed, the dispatcher's state
(queued groups, buffered rollouts) is checkpointed with the trainer's, and a group's samples depend only
on (seed, its uid, the weights), not on which worker or call produced them.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from posttrain.config import load_config
from posttrain.rl.config import RLConfig
from posttrain.rl.setup import RLResult, RLRun
from posttrain.rl.sources import InProcessSource
from posttrain.sampling import ProgramCache

__all__ = ["run_rl", "load_rl_config", "make_source", "RLResult"]


def load_rl_config(path: str | Path | None, overrides=()) -> RLConfig:
    return load_config(RLConfig, path, list(overrides))


def make_source(run: RLRun):
    """The in-process sampler, or the Ray fleet when `fleet.workers` is set (on a multi-process trainer, process
    0 drives the fleet and the others follow it: `posttrain.rl.fleet.follower`)."""
    if run.cfg.fleet.enabled:
        # lazy: posttrain.rl.fleet loads Ray (seconds): only fleet runs need it
        from posttrain.rl.fleet import FleetFollower, FleetSource, check_hosts

        check_hosts(run.cfg.fleet)  # a multi-process trainer: where Ray can serve all of its processes
        return FleetSource(run) if jax.process_index() == 0 else FleetFollower(run)
    return InProcessSource(run)


def run_rl(cfg: RLConfig, *, stop_after: int | None = None, run: RLRun | None = None,
           program_cache: ProgramCache | None = None) -> RLResult:
    """Runs (or resumes) an RL job; `stop_after` ends the loop early, as a crash would (for resume tests).
    `run`: an already set-up run of `cfg` (a subclass with its own steps, e.g. on-policy distillation);
    `program_cache`: the compiled sampler programs of the caller's samplers of this model, to share."""
    run = run if run is not None else RLRun(cfg, program_cache)
    source = None
    step = finished = 0
    hf_dir = None
    try:
        step = run.resume()
        profiler = run.run.profiler
        source = make_source(run)
        source.publish(run.trainer.params, step)
        if cfg.eval.at_start and step == 0:
            run.evaluate(0)
        while step < cfg.trainer.max_steps and (stop_after is None or step < stop_after):
            step += 1
            profiler.begin(step)  # trainer.profile: "rollout" and "update" are named ranges of the step's trace
            t0 = time.perf_counter()
            with profiler.phase("rollout"):
                rollouts = source.next(step)  # B scored groups, within the staleness bound
            run.check_environment(step, rollouts)  # warnings; too many failed trajectories stop the run
            t1 = time.perf_counter()
            with profiler.phase("update"):
                batch = run.prepare(rollouts)  # advantages, masks, behaviour log-probs
                moved = min(rollouts.version_first) < step - 1
                metrics = run.learner.update(batch, step, policy_moved=moved)  # ppo_epochs x minibatches
                trained = source.commit(rollouts)  # the groups are trained: acknowledged
                source.publish(run.trainer.params, step)  # the fleet's every publish_every steps
            t2 = time.perf_counter()
            metrics |= run.rollout_metrics(rollouts) | source.metrics(step, rollouts) | {
                "time/rollout_s": t1 - t0, "time/train_s": t2 - t1,
                "throughput/tokens_per_s": float(rollouts.completion_lengths().sum()) / max(t2 - t0, 1e-9)}
            run.after_step(step, metrics, rollouts, trained)  # ledger, logs, held-out eval, checkpoint
            profiler.end(step)
        finished = step >= cfg.trainer.max_steps
        if finished:
            hf_dir = run.finish(step)
    finally:
        if source is not None:
            source.close()
        run.close()
    return RLResult(run.out, step, run.history, run.evals, hf_dir)
