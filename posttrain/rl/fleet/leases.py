"""The lease book: which rollout call in flight carries which lease, on which worker.

The run's `Dispatcher` is the book's core and keeps the groups' states (queued, leased, ready, taken), the
staleness bound, re-queues and exactly-once accounting: plain Python that the in-process source shares and
that the checkpoint holds. What the fleet adds is here, on the Ray side: leases handed to the serving workers
(at most `PIPELINE` each, one generating and one queued behind it, so a worker never waits for the trainer
while the staleness bound allows more work), a call's result or failure turned into the dispatcher's
`complete` or `fail`, and every lease of a worker failed at once when the pool releases it (restarted or
dropped). Rollout calls that fail (not deaths) `MAX_TASK_ERRORS` times in a row stop the run.
"""

from __future__ import annotations

import collections
from typing import Callable

from posttrain.rl.fleet.cluster import FleetError

__all__ = ["LeaseBook", "PIPELINE", "MAX_TASK_ERRORS"]

PIPELINE = 2  # leases in flight per worker
MAX_TASK_ERRORS = 3  # failed rollout calls (not deaths) in a row before the run stops with the error


class LeaseBook:
    """Leases in flight on the workers, over the run's dispatcher. `send(worker, lease)` starts the rollout call
    and returns its Ray reference."""

    def __init__(self, ray, dispatcher, send: Callable):
        self.ray, self.dispatcher, self.send = ray, dispatcher, send
        self.inflight: dict = {}  # ref -> (lease id, worker name)
        self.task_errors = 0

    def hand_out(self, trainer_version: int, published: int | None, workers: list[str], size: int) -> None:
        """Leases of up to `size` groups to the `workers` (the least busy first), while the staleness bound
        admits groups and a worker has fewer than PIPELINE in flight."""
        d = self.dispatcher
        busy = collections.Counter(name for _, name in self.inflight.values())
        for name in sorted(workers, key=lambda n: busy[n]):
            while busy[name] < PIPELINE:
                k = min(size, d.admissible(trainer_version, published))
                if k < 1:
                    return
                lease = d.lease(name, k)
                self.inflight[self.send(name, lease)] = (lease.id, name)
                busy[name] += 1

    def release(self, worker: str, reason: str) -> None:
        """The worker's leases in flight go back to the queue (it was restarted or dropped)."""
        for ref, (lease_id, owner) in list(self.inflight.items()):
            if owner == worker:
                del self.inflight[ref]
                self.dispatcher.fail(lease_id, reason)

    def collect(self, ref, worker_down: Callable[[str, str], None]) -> dict | None:
        """A rollout call's answer: its result, or None when the call failed (its lease re-queued; a worker that
        died goes to `worker_down(name, why)`)."""
        ray = self.ray
        lease_id, name = self.inflight.pop(ref)
        try:
            res = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as e:  # the latter: node gone
            self.dispatcher.fail(lease_id, "worker_died")
            worker_down(name, f"died ({type(e).__name__})")
            return None
        except ray.exceptions.RayTaskError as e:
            self.dispatcher.fail(lease_id, "task_error")
            self.task_errors += 1
            if self.task_errors >= MAX_TASK_ERRORS:
                raise FleetError(f"rollouts keep failing on the workers; the last error ({name}):\n{e}") from None
            return None
        self.task_errors = 0
        return res
