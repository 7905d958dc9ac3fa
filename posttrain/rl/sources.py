"""Rollout sources: where a trainer step's B scored prompt groups come from.

Every source hands out groups through the run's `Dispatcher` (leases, staleness bound, exactly-once
accounting) and shares the loop's interface:

    publish(params, version)   the trainer's weights after `version` steps (copied, never referenced)
    next(step) -> Rollouts     B groups for trainer step `step`, within the staleness bound
    commit(rollouts)           the step's update is applied: its groups are done
    metrics() -> dict          the source's own figures for this step (staleness, queue, throughput)
    close()

`InProcessSource` samples on the trainer's own devices, synchronously (staleness 0): the classic loop.
The Ray fleet (`posttrain.rl.fleet.FleetSource`) is the asynchronous one. Dynamic sampling (DAPO) lives
here, in `_complete`: a group whose rewards are all equal carries no learning signal and is dropped with
that reason, up to `learner.max_resample_rounds` x B drops per step, after which such groups are trained as they
are (so a step always gets B groups and the compiled step its usual shapes).
"""

from __future__ import annotations

import time

import numpy as np

from posttrain.algorithms import dapo
from posttrain.rollout.rollouts import Rollouts, generate_rollouts

__all__ = ["RolloutSource", "InProcessSource"]


class RolloutSource:
    """The shared part of every source: completing leases (with dynamic sampling), taking and committing."""

    def __init__(self, run):
        self.run = run
        self.dispatcher = run.dispatcher
        self.version: int | None = None  # the latest published version
        self._drops = 0
        self._t_wait = 0.0

    # subclasses: publish(params, version), _produce(step), metrics(), close()
    def _complete(self, lease_id: int, rollouts: Rollouts) -> int:
        d, run = self.dispatcher, self.run
        accepted = d.complete(lease_id, rollouts.groups())
        if run.dynamic_sampling:
            for uid in sorted(set(rollouts.uid)):
                g = d.ready.get(uid)
                if g is None or self._drops >= run.max_drops_per_step:
                    continue
                if not bool(dapo.groups_with_signal(g.rewards, g.group_size)[0]):
                    d.drop(uid, "no_signal")
                    self._drops += 1
        return accepted

    def next(self, step: int) -> Rollouts:
        self._drops = 0
        t0 = time.perf_counter()
        while (groups := self.dispatcher.take(step)) is None:
            self._produce(step)
        self._t_wait = time.perf_counter() - t0
        return Rollouts.concat(groups)

    def commit(self, rollouts: Rollouts) -> list[int]:
        return self.dispatcher.commit(self.run.pass_rates(rollouts))

    def base_metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        staleness = (step - 1) - np.asarray(rollouts.version_first)
        token_lag = (step - 1) - rollouts.sampled_token_versions()
        d = self.dispatcher
        out = {
            "fleet/staleness_mean": float(staleness.mean()),
            "fleet/staleness_max": float(staleness.max()),
            # per sampled token (lower than the groups' with fleet.swap=segment), and the versions a sample spans
            "fleet/token_staleness_mean": float(token_lag.mean()) if token_lag.size else 0.0,
            "fleet/fresh_token_fraction": float((token_lag == 0).mean()) if token_lag.size else 1.0,  # lag 0
            "fleet/version_span_mean": float(np.mean(np.subtract(rollouts.version_last, rollouts.version_first))),
            "fleet/ready_groups": float(len(d.ready)),
            "fleet/leased_groups": float(len(d.leased)),
            "fleet/queued_groups": float(len(d.queue)),
            "fleet/wait_s": self._t_wait,
            "groups/dropped_no_signal": float(self._drops),  # this step's, under dynamic sampling
        }
        for k, v in d.counts.items():
            if k.startswith(("requeued/", "dropped/")) or k == "duplicates":
                out[f"fleet/{k}"] = float(v)
            elif k.startswith("curation/"):
                out[k] = float(v)
        return out


class InProcessSource(RolloutSource):
    """Synchronous RL: the trainer's devices sample the B groups of each step with the latest weights."""

    def __init__(self, run):
        super().__init__(run)
        self.sampler = run.local_sampler()
        self._t_generate = 0.0

    def publish(self, params, version: int) -> None:
        self.sampler.load_weights(params, version)
        self.version = version

    def _produce(self, step: int) -> None:
        d, run = self.dispatcher, self.run
        lease = d.lease("local", max(1, d.admissible(step - 1, self.version)))
        t0 = time.perf_counter()
        items = run.lease_items(lease)
        ro = generate_rollouts(self.sampler, *items, run.sampling_params, run.runner, uids=lease.uids,
                               agent=run.agent, images=run.lease_images(lease))
        self._t_generate += time.perf_counter() - t0
        self._complete(lease.id, ro)

    def metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        out = self.base_metrics(step, rollouts)
        out["time/generate_s"], self._t_generate = self._t_generate, 0.0
        return out

    def close(self) -> None:
        pass
