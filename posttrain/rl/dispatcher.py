"""The dispatcher: hands out prompt groups under leases and accounts for every group exactly once.

A *group* is one prompt and its G samples, named by a *uid*: its position in the run's prompt stream
(`PromptStream`: epoch e is a permutation of the records fixed by (seed, e), so uid u is a fixed record
whatever happens to the run). Each uid is in exactly one state:

    queued -> leased(worker, lease id, deadline) -> ready(result) -> taken (in a trainer step) -> done
       ^            | expired / worker died / failed      | too stale at consumption
       +------------+-------------------------------------+        (re-queued, generated again)

or dropped with a reason (no learning signal under dynamic sampling, skipped by curation). Done and
dropped groups are not stored: every uid below `next_uid` that is in no other state is finished, and the
trained ones are logged by the loop. A result is accepted only for its current lease: a result of an
expired lease or a retried task (Ray may run a call twice) is counted as a duplicate and ignored, so no
group is trained twice; a group leaves `taken` only when the trainer commits the step that trained it.

Staleness (policy versions: version v = the weights after v trainer steps). A group consumed at step s
(which updates version s - 1) and generated with version w has staleness s - 1 - w, w being the version of
its oldest token (`version_first`: with partial rollouts, `fleet.swap=segment`, later tokens of a sample may
come from newer weights, which only lowers their own lag). It is bounded twice:
at admission, groups are leased only while every group already leased or ready could still be consumed
within `max_staleness` versions of the published weights (so `max_staleness: 0` leases one batch after
each publish: synchronous RL), and at consumption, where a group over the bound goes back to the queue.

Curation (RLAX, `posttrain.rl.curation`): with `curation_window` k > 0, each record's pass rates of its last k
trained groups are kept; a fresh uid whose record was solved always (or never) in all of its last k attempts is
dropped with that reason instead of being leased. When a whole pass of the stream finds every record curated (a
small or too easy / too hard prompt set), nothing is left to lease: rather than wait forever, the
dispatcher leases records again whatever their history (counted in `curation/exhausted_passes` and
`curation/leased_curated`, said once in one line) until a trained group takes a record out of curation.

Everything here is plain Python (no Ray, no JAX), so the same object serves the in-process source and the
fleet, and its state (`state_dict`) goes into the trainer's checkpoint as JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from posttrain.rl.curation import Curation
from posttrain.rollout.rollouts import Rollouts

if TYPE_CHECKING:  # the config sections `of` reads (their module loads JAX; this one stays plain)
    from posttrain.rl.config import CurationConfig, FleetConfig, PromptData, RolloutConfig

__all__ = ["PromptStream", "Lease", "Dispatcher"]


class PromptStream:
    """Deterministic prompt order: uid u is record `perm(seed, u // n)[u % n]` (identity without shuffle)."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        if n < 1:
            raise ValueError("the prompt set is empty")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perm_epoch, self._perm = -1, None

    def record(self, uid: int) -> int:
        epoch, pos = divmod(uid, self.n)
        if epoch != self._perm_epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                          else np.arange(self.n))
            self._perm_epoch = epoch
        return int(self._perm[pos])


@dataclasses.dataclass
class Lease:
    id: int
    worker: str
    uids: list[int]
    records: list[int]
    issued: float
    deadline: float


class Dispatcher:
    """Leases, results and exactly-once accounting of prompt groups (see the module docstring).

    Args:
      num_records, seed, shuffle: the prompt stream.
      batch_groups: groups per trainer step (B).
      max_staleness: the staleness bound in versions (>= 0).
      lease_timeout_s: a lease not completed by then goes back to the queue (`expire`).
      curation_window, skip_always_solved, skip_never_solved: curation (0 = off).
      clock: time source (tests pass a fake one).
      say: where the one-line notice that every record is curated goes (default: stderr).
    """

    @classmethod
    def of(cls, num_records: int, data: PromptData, rollout: RolloutConfig, fleet: FleetConfig,
           curation: CurationConfig) -> Dispatcher:
        """The dispatcher of an RL run's config sections: the data stream (`data`), B groups a step (`rollout`),
        the staleness bound and leases (`fleet`; staleness 0 in-process) and curation (`curation`)."""
        return cls(num_records, seed=data.seed, shuffle=data.shuffle, batch_groups=rollout.batch_prompts,
                   max_staleness=fleet.max_staleness if fleet.enabled else 0, lease_timeout_s=fleet.lease_timeout_s,
                   curation_window=curation.window, skip_always_solved=curation.skip_always_solved,
                   skip_never_solved=curation.skip_never_solved)

    def __init__(self, num_records: int, *, seed: int = 0, shuffle: bool = True, batch_groups: int,
                 max_staleness: int = 0, lease_timeout_s: float = 600.0, curation_window: int = 0,
                 skip_always_solved: bool = True, skip_never_solved: bool = True,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] | None = None):
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.stream = PromptStream(num_records, seed, shuffle)
        self.batch_groups = int(batch_groups)
        self.max_staleness = int(max_staleness)
        self.lease_timeout_s = float(lease_timeout_s)
        self.clock = clock
        self.curation = Curation(curation_window, skip_always_solved, skip_never_solved,
                                 say or (lambda text: print(text, file=sys.stderr, flush=True)))
        self.next_uid = 0
        self.queue: list[int] = []  # re-queued uids, leased again first (lowest uid first)
        self.leases: dict[int, Lease] = {}
        self.leased: dict[int, int] = {}  # uid -> lease id
        self.ready: dict[int, Any] = {}  # uid -> result (a one-group `Rollouts`)
        self.taken: dict[int, Any] = {}  # uid -> result, in the step being trained
        self.counts: collections.Counter = collections.Counter()
        self._lease_ids = itertools.count(1)

    @property
    def pass_history(self) -> dict[int, list[float]]:
        """Record -> pass rates of its last k trained groups (curation)."""
        return self.curation.history

    @property
    def curation_exhausted(self) -> bool:
        """Every record is curated: they are leased anyway (see the module docstring)."""
        return self.curation.exhausted

    def _curated(self, record: int) -> str | None:
        return self.curation.reason(record)

    # ------------------------------------------------------------------ admission and leases
    @property
    def outstanding(self) -> int:
        """Groups leased, ready or taken (handed out and not yet finished)."""
        return len(self.leased) + len(self.ready) + len(self.taken)

    def admissible(self, trainer_version: int, published_version: int) -> int:
        """How many more groups may be leased now without breaking the staleness bound at consumption.

        A group leased now is generated with a version >= `published_version` and consumed after the
        `outstanding` groups ahead of it, at step >= trainer_version + 1 + outstanding // B, so its
        staleness is at most (trainer_version - published_version) + outstanding // B."""
        room = self.max_staleness - (trainer_version - published_version)
        return max(0, self.batch_groups * (room + 1) - self.outstanding)

    def _fresh(self) -> tuple[int, int] | None:
        skipped = 0
        while True:
            uid = self.next_uid
            self.next_uid += 1
            record = self.stream.record(uid)
            reason = self._curated(record)
            # n skips in a row: check the whole set (any 2n consecutive uids hold a full pass of the stream)
            if reason and not self.curation_exhausted and skipped and skipped % self.stream.n == 0:
                self.curation.check_exhausted(self.stream.n, self.counts)
            if reason is None:
                return uid, record
            if self.curation_exhausted:
                self.counts["curation/leased_curated"] += 1
                return uid, record
            self.counts[f"dropped/{reason}"] += 1
            skipped += 1

    def lease(self, worker: str, k: int) -> Lease | None:
        """Leases up to k groups (re-queued ones first) to `worker`; None when k < 1."""
        if k < 1:
            return None
        uids, records = [], []
        self.queue.sort()
        while len(uids) < k and self.queue:
            u = self.queue.pop(0)
            uids.append(u)
            records.append(self.stream.record(u))
        while len(uids) < k:
            u, r = self._fresh()
            uids.append(u)
            records.append(r)
        now = self.clock()
        lease = Lease(next(self._lease_ids), worker, uids, records, now, now + self.lease_timeout_s)
        self.leases[lease.id] = lease
        for u in uids:
            self.leased[u] = lease.id
        self.counts["leased"] += len(uids)
        return lease

    def _requeue(self, uids, reason: str) -> None:
        for u in uids:
            self.leased.pop(u, None)
            self.queue.append(u)
        self.counts[f"requeued/{reason}"] += len(uids)

    def fail(self, lease_id: int, reason: str) -> list[int]:
        """The lease's worker died or its call failed: its groups go back to the queue."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return []
        self._requeue(lease.uids, reason)
        return lease.uids

    def expire(self) -> list[Lease]:
        """Leases past their deadline go back to the queue; returns them (their workers are suspect)."""
        now = self.clock()
        out = [ls for ls in self.leases.values() if ls.deadline <= now]
        for ls in out:
            self.fail(ls.id, "expired")
        return out

    def complete(self, lease_id: int, groups: list) -> int:
        """Results of a lease (one-group `Rollouts`, each with `uid`); returns how many were accepted.
        A result for a lease that is no longer current is a duplicate and is ignored."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            self.counts["duplicates"] += len(groups)
            return 0
        by_uid = {g.uid[0]: g for g in groups}
        missing = [u for u in lease.uids if u not in by_uid]
        for u in lease.uids:
            self.leased.pop(u, None)
            if u in by_uid:
                self.ready[u] = by_uid[u]
        if missing:
            self._requeue(missing, "missing")
        self.counts["completed"] += len(lease.uids) - len(missing)
        return len(lease.uids) - len(missing)

    def ready_group(self, uid: int):
        """The ready result of `uid` (a one-group `Rollouts`), or None when it is not ready."""
        return self.ready.get(uid)

    def drop(self, uid: int, reason: str) -> None:
        """A ready group that will not be trained (e.g. no learning signal), with its reason."""
        self.ready.pop(uid)
        self.counts[f"dropped/{reason}"] += 1

    # ------------------------------------------------------------------ consumption
    def take(self, step: int, k: int | None = None) -> list | None:
        """The k (default B) lowest-uid ready groups for trainer step `step` (1-based), or None while fewer
        are ready. A ready group over the staleness bound for this step goes back to the queue first."""
        k = self.batch_groups if k is None else k
        for u in sorted(self.ready):
            if (step - 1) - self.ready[u].version_first_min() > self.max_staleness:
                self.ready.pop(u)
                self._requeue([u], "stale")
        if len(self.ready) < k:
            return None
        uids = sorted(self.ready)[:k]
        out = []
        for u in uids:
            self.taken[u] = self.ready.pop(u)
            out.append(self.taken[u])
        return out

    def commit(self, pass_rates: dict[int, float] | None = None) -> list[int]:
        """The taken groups were trained (the step's update is applied): they are done. `pass_rates` (uid ->
        fraction of correct samples) feed curation. Returns the committed uids."""
        uids = sorted(self.taken)
        for u in uids:
            g = self.taken.pop(u)
            if pass_rates and u in pass_rates:
                self.curation.add(int(g.record_index[0]), pass_rates[u])
        self.counts["trained"] += len(uids)
        return uids

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict[str, float]:
        """The groups ready, leased and queued now, and the running counts a step logs: re-queues, drops and
        duplicates (`fleet/...`) and curation's (`curation/...`)."""
        out = {"fleet/ready_groups": float(len(self.ready)), "fleet/leased_groups": float(len(self.leased)),
               "fleet/queued_groups": float(len(self.queue))}
        for k, v in self.counts.items():
            if k.startswith(("requeued/", "dropped/")) or k == "duplicates":
                out[f"fleet/{k}"] = float(v)
            elif k.startswith("curation/"):
                out[k] = float(v)
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """JSON-able state: a checkpoint holds it with the trainer's. Leased and taken groups are saved as
        queued and ready: a restored run has no live leases."""
        ready = {**self.ready, **self.taken}
        return {
            "next_uid": self.next_uid,
            "queue": sorted(set(self.queue) | set(self.leased)),
            "ready": {str(u): Rollouts.to_json(g) for u, g in sorted(ready.items())},
            "counts": dict(self.counts),
            "pass_history": {str(r): h for r, h in self.pass_history.items()},
            "curation_exhausted": self.curation_exhausted,
        }

    def load_state_dict(self, state: dict) -> None:
        self.next_uid = int(state["next_uid"])
        self.queue = [int(u) for u in state["queue"]]
        self.leases, self.leased, self.taken = {}, {}, {}
        self.ready = {int(u): Rollouts.from_json(g) for u, g in state["ready"].items()}
        self.counts = collections.Counter(state.get("counts", {}))
        self.curation.history = {int(r): list(h) for r, h in state.get("pass_history", {}).items()}
        self.curation.exhausted = bool(state.get("curation_exhausted", False))
