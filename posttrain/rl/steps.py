"""The RL loop's named steps, as functions of the run's parts (`posttrain.rl.setup.RLParts`) and of its state
(`RLState`: what the steps add to as the run goes: the ledger, the metrics history, the held-out evaluations, and
the policy on the trainer's devices).

`begin` opens the ledger and says what the run is about to do (the set-up restored the latest checkpoint and
opened the logs: `RLParts.start_step`); `check_environment` stops the run when too many trajectories failed;
`after_step` writes the ledger, metrics and samples and runs the periodic held-out evaluation and checkpoint;
`finish` the final evaluation, checkpoint and HF export; `close` releases everything.

Files in `output_dir`: `config.yaml`, `metrics.jsonl`, `tensorboard/`, `samples.jsonl` and `trained.jsonl`
(`posttrain.rl.ledger`), `checkpoints/<step>/` (trainer state + the dispatcher's state with its buffered
rollouts), `hf/`. On resume, records after the restored step are dropped from the JSONL files: those
steps run again. The rollout metrics are `posttrain.rl.metrics`'; the held-out evaluator `posttrain.eval`'s.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import distributed
from posttrain.agent.failures import EnvironmentFailedError
from posttrain.eval.evaluate import evaluate as held_out
from posttrain.rl import checkpoints
from posttrain.rl.ledger import Ledger
from posttrain.rl.prompts import trained_prompt_style
from posttrain.rl.setup import RLParts
from posttrain.rollout.policy import Policy
from posttrain.rollout.rollouts import Rollouts

__all__ = [
    "RLState",
    "after_step",
    "begin",
    "check_environment",
    "close",
    "evaluate",
    "finish",
    "local_policy",
    "save",
]


@dataclasses.dataclass
class RLState:
    """What the steps add to as the run goes (module docstring)."""

    ledger: Ledger | None = None
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    policy: Policy | None = None


@jax.jit
def _copy_tree(tree):
    """A copy of every leaf, in one program (not one per leaf)."""
    return jax.tree.map(jnp.copy, tree)


def local_policy(parts: RLParts, state: RLState) -> Policy:
    """The policy on the trainer's devices (in-process rollouts and held-out evaluation), built once over its own
    copy of the trained weights (`Policy.swap_weights` refreshes them), computing in `rollout.compute_dtype`."""
    if state.policy is None:
        t, ro = parts.run.trainer, parts.cfg.rollout
        model = nnx.merge(t.graphdef, _copy_tree(t.params), t.rest)
        state.policy = Policy(model, parts.tok, folder=parts.run.model_folder(), compute_dtype=ro.compute_dtype,
                              max_slots=ro.slots, program_cache=parts.programs)
    return state.policy


def begin(parts: RLParts, state: RLState) -> int:
    """Opens the ledger and says what the run is about to do; returns the step it starts from (the set-up's
    restored checkpoint's, or 0)."""
    state.ledger = Ledger(parts.run.out, primary=distributed.is_primary())
    parts.run.say(start_line(parts, parts.start_step))
    return parts.start_step


def start_line(parts: RLParts, start: int) -> str:
    """What the run is about to do, in one line (as `posttrain sft` prints): model, trained parameters, algorithm,
    prompts and groups, rollout source, steps."""
    cfg, t = parts.cfg, parts.run.trainer
    ro, fleet = cfg.rollout, cfg.fleet
    source = f"fleet of {fleet.workers} workers" if fleet.enabled else "in-process sampler"
    turns = " | multi-turn (tools)" if parts.agent is not None else ""
    if parts.verifiers is not None:
        turns = f" | {parts.verifiers.name} ({parts.verifiers.ref})"
    return (f"rl: {parts.run.folder} | {t.num_trainable:,} trained parameters{' (LoRA)' if t.has_lora else ''} | "
            f"{cfg.algorithm.preset} | {len(parts.prompts.train)} prompts, {ro.batch_prompts} x {ro.group_size} "
            f"samples a step | {source}{turns} | steps {start}->{cfg.trainer.max_steps}"
            + (f" | resumed from step {start}" if start else ""))


def check_environment(parts: RLParts, state: RLState, step: int, ro: Rollouts) -> None:
    """A step's environment failures: a warning line for each new kind; when more than
    `rollout.max_env_error_fraction` of its trajectories failed, they go to trajectories.jsonl and the run
    stops (`EnvironmentFailedError`: one `error:` line naming the environment class and the first error)."""
    if parts.env_watch is None or not ro.trajectories:
        return
    try:
        parts.env_watch.check(step, ro.trajectories)
    except EnvironmentFailedError:
        state.ledger.record_trajectories(step, "train", ro, parts.cfg.eval.log_samples)
        raise


def save(parts: RLParts, step: int, *, wait: bool = False) -> None:
    """A checkpoint of `step` (`posttrain.rl.checkpoints`: the trainer's state and the dispatcher's; `wait`: until it
    is on disk)."""
    checkpoints.save(parts.run, parts.dispatcher, step, wait=wait)


def evaluate(parts: RLParts, state: RLState, step: int) -> None:
    """Held-out greedy accuracy (and pass@k) with the trainer's current weights (`posttrain.eval`)."""
    if parts.prompts.eval is None:
        return
    cfg, logger = parts.cfg, parts.run.logger
    policy = local_policy(parts, state)
    if policy.version != step:
        policy.swap_weights(parts.run.trainer.params, step)
    t0 = time.perf_counter()
    e = held_out(policy, parts.prompts.eval, parts.runner, correctness=cfg.rewards.correctness,
                 max_new_tokens=cfg.rollout.max_new_tokens, k=cfg.eval.k, n_samples=cfg.eval.n_samples,
                 temperature=cfg.eval.temperature, seed=cfg.trainer.seed + 7919 * step, agent=parts.agent)
    greedy = e.pop("_greedy")
    e.pop("_sampled")
    e["eval/seconds"] = time.perf_counter() - t0
    logger.log(step, e)
    state.evals.append({"step": step, **e})
    state.ledger.record_samples(step, "eval", greedy, cfg.eval.log_samples)
    logger.message(f"step {step}: held-out accuracy {e['eval/accuracy']:.3f}, reward {e['eval/reward_mean']:.3f}")


def after_step(parts: RLParts, state: RLState, step: int, m: dict[str, float], ro: Rollouts,
               trained: list[int]) -> None:
    """Ledger, metrics, samples, periodic evaluation and checkpoint of a finished step."""
    tc, run = parts.cfg.trainer, parts.run
    run.check_finite(step, m, grad_norm=False, log=False)
    state.ledger.record_trained(step, ro, trained)
    state.history.append({"step": step, **m})
    if step % tc.log_every == 0 or step == tc.max_steps:
        run.logger.log(step, m)
        state.ledger.record_samples(step, "train", ro, 1)
        state.ledger.record_trajectories(step, "train", ro, parts.cfg.eval.log_samples)
    run.logger.advance(step)
    every = parts.cfg.eval.every
    if every and step % every == 0 and step < tc.max_steps:
        evaluate(parts, state, step)
    if tc.save_every and step % tc.save_every == 0:
        save(parts, step)


def finish(parts: RLParts, state: RLState, step: int) -> Path | None:
    """Final evaluation and checkpoint; the HF export (LoRA merged)."""
    evaluate(parts, state, step)
    save(parts, step, wait=True)
    return parts.run.export_hf(quiet=True, prompt_style=trained_prompt_style(parts.prompts, parts.agent))


def close(parts: RLParts, state: RLState | None = None) -> None:
    """Closes the ledger, the local policy, the reward runner and the agent, then the run (logs; a pending save,
    bounded; the lock)."""
    try:
        if state is not None and state.ledger is not None:
            state.ledger.close()
        if state is not None and state.policy is not None:
            state.policy.close()
        parts.runner.close()
        if parts.agent is not None:
            parts.agent.close()
        if parts.verifiers is not None:
            parts.verifiers.close()
    finally:
        parts.run.close()
