"""Rollout sources: where a trainer step's B scored prompt groups come from (`RolloutSource`, a typed protocol).

    publish(params, version)   the trainer's weights after `version` steps (copied, never referenced)
    next(step) -> Rollouts     B groups for trainer step `step`, within the staleness bound
    commit(rollouts)           the step's update is applied: its groups are done (their uids returned)
    metrics(step, rollouts)    the source's own figures for this step (staleness, queue, throughput)
    close()

A source gets only the pieces it uses. `InProcessSource` samples on the trainer's own devices, synchronously
(staleness 0): the classic loop. The Ray fleet (`posttrain.rl.fleet.FleetSource`) is the asynchronous one. Both
hand out groups through the run's `Dispatcher` (leases, staleness bound, exactly-once accounting) by way of a
`GroupIntake`, which also does dynamic sampling (DAPO): a group whose rewards are all equal carries no learning
signal and is dropped with that reason, up to `learner.max_resample_rounds` x B drops per step, after which such
groups are trained as they are (so a step always gets B groups and the compiled step its usual shapes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from posttrain.agent.rollout import Agent
from posttrain.algorithms import dapo
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rollout.collect import generate_rollouts
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.rollouts import Rollouts
from posttrain.sampling import SamplingParams

__all__ = ["DynamicSampling", "GroupIntake", "InProcessSource", "RolloutSource"]


class RolloutSource(Protocol):
    """What the loop asks of a rollout source (module docstring)."""

    def publish(self, params, version: int) -> None: ...

    def next(self, step: int) -> Rollouts: ...

    def commit(self, rollouts: Rollouts) -> list[int]: ...

    def metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (the preset's `dynamic_sampling`): groups without signal dropped, `max_drops` per step."""

    enabled: bool
    max_drops: int


class GroupIntake:
    """A source's side of the dispatcher: completes leases (dropping groups without signal under dynamic
    sampling), takes a step's B groups (asking the source to `produce` more until they are ready), commits them
    (`pass_rates(rollouts)`, uid -> fraction correct, feeds curation) and gives the step's figures."""

    def __init__(self, dispatcher: Dispatcher, dynamic: DynamicSampling,
                 pass_rates: Callable[[Rollouts], dict[int, float]]):
        self.dispatcher, self.dynamic, self.pass_rates = dispatcher, dynamic, pass_rates
        self.drops = 0  # this step's groups dropped without signal
        self.wait_s = 0.0  # how long this step waited for its groups

    def complete(self, lease_id: int, rollouts: Rollouts) -> int:
        """A lease's scored groups; returns how many the dispatcher accepted."""
        d = self.dispatcher
        accepted = d.complete(lease_id, rollouts.groups())
        if self.dynamic.enabled:
            for uid in sorted(set(rollouts.uid)):
                g = d.ready_group(uid)
                if g is None or self.drops >= self.dynamic.max_drops:
                    continue
                if not bool(dapo.groups_with_signal(g.rewards, g.group_size)[0]):
                    d.drop(uid, "no_signal")
                    self.drops += 1
        return accepted

    def take(self, step: int, produce: Callable[[int], None]) -> Rollouts:
        """The B groups of trainer step `step`, calling `produce(step)` while fewer are ready."""
        self.drops = 0
        t0 = time.perf_counter()
        while (groups := self.dispatcher.take(step)) is None:
            produce(step)
        self.wait_s = time.perf_counter() - t0
        return Rollouts.concat(groups)

    def commit(self, rollouts: Rollouts) -> list[int]:
        return self.dispatcher.commit(self.pass_rates(rollouts))

    def figures(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        """Staleness per group and per sampled token, the dispatcher's groups and counts, the wait, the drops."""
        staleness = (step - 1) - np.asarray(rollouts.version_first)
        token_lag = (step - 1) - rollouts.sampled_token_versions()
        return {
            "fleet/staleness_mean": float(staleness.mean()),
            "fleet/staleness_max": float(staleness.max()),
            # per sampled token (lower than the groups' with fleet.swap=segment), and the versions a sample spans
            "fleet/token_staleness_mean": float(token_lag.mean()) if token_lag.size else 0.0,
            "fleet/fresh_token_fraction": float((token_lag == 0).mean()) if token_lag.size else 1.0,  # lag 0
            "fleet/version_span_mean": float(np.mean(np.subtract(rollouts.version_last, rollouts.version_first))),
            **self.dispatcher.figures(),
            "fleet/wait_s": self.wait_s,
            "groups/dropped_no_signal": float(self.drops),  # this step's, under dynamic sampling
        }


class InProcessSource:
    """Synchronous RL: the trainer's devices sample the B groups of each step with the latest weights, through the
    run's local `policy` (`record_experts`: with the experts the sampler routed to, for routing replay)."""

    def __init__(self, intake: GroupIntake, policy: Policy, prompts: PromptSet, params: SamplingParams,
                 runner: RewardRunner, agent: Agent | None = None, *, record_experts: bool = False):
        self.intake, self.policy, self.prompts = intake, policy, prompts
        self.params, self.runner, self.agent = params, runner, agent
        self.record_experts = record_experts
        self.version: int | None = None  # the latest published version
        self._t_generate = 0.0

    def publish(self, params, version: int) -> None:
        self.policy.swap_weights(params, version)
        self.version = version

    def next(self, step: int) -> Rollouts:
        return self.intake.take(step, self._produce)

    def _produce(self, step: int) -> None:
        d = self.intake.dispatcher
        lease = d.lease("local", max(1, d.admissible(step - 1, self.version)))
        t0 = time.perf_counter()
        ro = generate_rollouts(self.policy, self.prompts.select(lease.records), self.params, self.runner,
                               uids=lease.uids, agent=self.agent, record_experts=self.record_experts)
        self._t_generate += time.perf_counter() - t0
        self.intake.complete(lease.id, ro)

    def commit(self, rollouts: Rollouts) -> list[int]:
        return self.intake.commit(rollouts)

    def metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        out = self.intake.figures(step, rollouts)
        out["time/generate_s"], self._t_generate = self._t_generate, 0.0
        return out

    def close(self) -> None:
        pass
