"""The worker pool: the fleet's rollout workers, one state record each (lifecycle, health, elasticity).

A worker is started and probed (`ready()`) until it answers; it then serves until it goes down (a failed call,
a lease past its deadline, no heartbeat within `fleet.heartbeat_timeout_s`, or pulling weights longer than that),
when it is probed again until Ray has restarted it. An elastic fleet (`fleet.workers: MIN..MAX`) looks at Ray's
live nodes every few seconds, starts workers pinned to nodes with room, and drops for good a worker whose node
left or that failed more than `fleet.max_restarts` times. The pool knows nothing of leases: whenever a worker's
work is lost (restarted or dropped) it calls `release(name, reason)`, which the lease book answers.
`fleet_workers.jsonl` gets an event for each worker coming up, going down and being dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import time
from typing import Any, Callable

from posttrain.rl.fleet.elastic import live_nodes, placements, worker_needs

__all__ = ["WorkerPool", "WorkerSpec", "WorkerState", "pinned"]

PROBE_RETRY_S = 2.0
SIZING_S = 2.0  # between looks at the Ray nodes (an elastic fleet)
HEARTBEAT_S = 5.0  # between heartbeats to each serving worker
CLOSE_WAIT_S = 5.0  # how long the workers get to close their agents at the end of the run


def pinned(node: str):
    """Ray's placement on `node` and nowhere else (see `posttrain.rl.fleet.elastic` for why)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy, like Ray itself (require_ray)

    return NodeAffinitySchedulingStrategy(node, soft=False)


@dataclasses.dataclass
class WorkerSpec:
    """How a worker actor is started: the Ray actor class, its options, the run's config sections, the server."""

    cls: Any
    options: dict
    sections: dict
    ps: Any

    def start(self, name: str, node: str | None):
        placement = {} if node is None else {"scheduling_strategy": pinned(node)}
        return self.cls.options(**self.options, **placement).remote(name, self.ps, **self.sections)


@dataclasses.dataclass
class WorkerState:
    """One worker's record. Dropped workers keep theirs (their restarts still count, their reason is reported)."""

    handle: Any
    node: str | None  # the node an elastic worker is pinned to
    info: dict | None = None  # its ready() answer while it serves
    up_seq: int = 0  # when it came up (serving workers are taken in that order)
    failures: int = 0  # times down or not answering a probe (the drop rule)
    restarts: int = 0  # times it went down after serving
    last_error: str | None = None  # why it last failed (cleared when it comes up)
    retry_at: float | None = None  # when to probe again after a failed probe
    dropped: str | None = None  # why it left the fleet for good


class WorkerPool:
    """The workers of the fleet (module docstring). `release(name, reason)`: the worker's leases are lost."""

    def __init__(self, ray, fc, spec: WorkerSpec, events, release: Callable[[str, str], None]):
        self.ray, self.fc, self.spec, self.events, self.release = ray, fc, spec, events, release
        self.records: dict[str, WorkerState] = {}  # name -> record, in the order the workers were started
        self.probes: dict = {}  # ref -> worker name
        self.heartbeats: dict = {}  # ref -> (worker name, sent at)
        self.needs, self.next_sizing, self.target = worker_needs(fc), 0.0, fc.max_workers
        self.bad_nodes: set[str] = set()  # nodes where a worker was dropped for failing: no new workers there
        self.next_heartbeat = time.monotonic() + HEARTBEAT_S
        self._up_order = itertools.count()

    def start(self) -> None:
        """The first workers (an elastic fleet's: where the nodes have room now)."""
        if self.fc.elastic:
            self.resize()
        else:
            for _ in range(self.fc.workers):
                self.add()

    # ------------------------------------------------------------------ views
    def live(self) -> dict[str, WorkerState]:
        """Records of the workers in the fleet (not dropped), in start order."""
        return {n: r for n, r in self.records.items() if r.dropped is None}

    @property
    def size(self) -> int:
        return len(self.live())

    def serving(self) -> list[str]:
        """The workers known to serve, in the order they came up."""
        return sorted((n for n, r in self.records.items() if r.info is not None), key=lambda n: self.records[n].up_seq)

    def handle(self, name: str):
        return self.records[name].handle

    def dropped(self) -> dict[str, str]:
        return {n: r.dropped for n, r in self.records.items() if r.dropped is not None}

    # ------------------------------------------------------------------ membership
    def add(self, node: str | None = None) -> None:
        """A new worker `worker-<i>` (pinned to `node` when given: an elastic fleet's), probed until it is up."""
        name = f"worker-{len(self.records)}"
        handle = self.spec.start(name, node)
        self.records[name] = WorkerState(handle, node)
        self.probes[handle.ready.remote()] = name

    def resize(self) -> None:
        """An elastic fleet's look at the Ray nodes: drops the workers of nodes that left and starts workers where
        live nodes have room, up to MAX."""
        self.next_sizing = time.monotonic() + SIZING_S
        nodes = live_nodes(self.ray)
        for name, rec in self.live().items():
            if rec.node is not None and rec.node not in nodes:
                self.drop(name, "its node left the cluster")
        live, cap = self.live(), self.fc.max_workers
        held = collections.Counter(r.node for r in live.values() if r.node is not None)
        room = len(placements(nodes, self.needs, collections.Counter(), cap, self.bad_nodes))
        self.target = max(room, len(live))
        for node in placements(nodes, self.needs, held, cap - len(live), self.bad_nodes):
            self.add(node)

    def drop(self, name: str, why: str) -> None:
        """An elastic worker leaves the fleet for good: killed, its leases released, never probed again."""
        rec = self.records[name]
        try:
            self.ray.kill(rec.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its node: nothing to end
            pass
        self.release(name, "worker_dropped")
        self._forget_calls(name)
        rec.info, rec.retry_at, rec.dropped = None, None, why
        self._log("dropped", name, rec.node, reason=why)

    def _forget_calls(self, name: str) -> None:
        for ref in [r for r, n in self.probes.items() if n == name]:
            del self.probes[ref]
        for ref in [r for r, (n, _) in self.heartbeats.items() if n == name]:
            del self.heartbeats[ref]

    def failed(self, name: str, why: str) -> None:
        """A worker went down or did not answer a probe. The drop rule of an elastic fleet: more failures than
        `fleet.max_restarts` (-1: never) drop the worker; and since a failure may be its node leaving (whose
        workers `resize` drops), the nodes are looked at again at once."""
        rec = self.records[name]
        rec.failures += 1
        rec.last_error = why
        if not self.fc.elastic:
            return
        self.next_sizing = 0.0
        n, limit = rec.failures, self.fc.max_restarts
        if 0 <= limit < n:
            self.bad_nodes.add(rec.node)
            self.drop(name, f"{n} failure{'s' * (n > 1)}, more than fleet.max_restarts={limit}; the last: {why}")

    def down(self, name: str, why: str) -> None:
        """A serving worker stopped serving (its call failed, or it was restarted): probed until it is back."""
        rec = self.records[name]
        if rec.info is not None:
            node, rec.info = rec.info.get("node"), None
            rec.restarts += 1
            self._log("down", name, node, reason=why, restarts=rec.restarts)
        self.failed(name, why)
        if rec.dropped is None and name not in self.probes.values() and rec.retry_at is None:
            self.probes[rec.handle.ready.remote()] = name

    def restart(self, name: str, why: str) -> None:
        """A stuck worker: its leases are released and Ray restarts it."""
        rec = self.records.get(name)
        if rec is None or rec.dropped is not None:
            return
        self.ray.kill(rec.handle, no_restart=False)
        self.release(name, "worker_stuck")
        self.down(name, why)

    def _log(self, event: str, name: str, node: str | None, **fields) -> None:
        with open(self.events, "a", encoding="utf-8") as f:  # who ran where, and when
            f.write(json.dumps({"event": event, "time": time.time(), "name": name, "node": node, **fields}) + "\n")

    # ------------------------------------------------------------------ probes and health
    def tend(self) -> None:
        """One round of upkeep: heartbeats and their deadlines, an elastic fleet's sizing, probes due again."""
        self.check_health()
        now = time.monotonic()
        if self.fc.elastic and now >= self.next_sizing:
            self.resize()
        due = [(r.retry_at, n) for n, r in self.records.items() if r.retry_at is not None and r.retry_at <= now]
        for _, name in sorted(due, key=lambda t: t[0]):
            rec = self.records[name]
            rec.retry_at = None
            self.probes[rec.handle.ready.remote()] = name

    def check_health(self) -> None:
        """Heartbeats (answered from the worker's second thread, so also mid-generation) and their deadlines:
        no answer within fleet.heartbeat_timeout_s, or pulling weights for longer than that, is a stuck worker."""
        now, limit = time.monotonic(), self.fc.heartbeat_timeout_s
        for ref, (name, sent) in list(self.heartbeats.items()):
            if now - sent > limit:
                del self.heartbeats[ref]
                self.restart(name, f"no heartbeat for {limit:g} s")
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_S
            waiting = {n for n, _ in self.heartbeats.values()}
            for name in self.serving():
                if name not in waiting:
                    ref = self.handle(name).heartbeat.options(concurrency_group="health").remote()
                    self.heartbeats[ref] = (name, now)

    def on_heartbeat(self, ref) -> None:
        name, _ = self.heartbeats.pop(ref)
        try:
            beat = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            return  # the worker died; its calls fail and say so
        if beat["state"] == "pulling" and time.time() - beat["since"] > self.fc.heartbeat_timeout_s:
            self.restart(name, "stuck pulling weights")

    def on_probe(self, ref) -> bool:
        """A probe's answer; True when its worker came up (progress, for the stall check)."""
        name = self.probes.pop(ref)
        rec = self.records[name]
        try:
            info = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            self.failed(name, f"not answering ({type(e).__name__})")
            if rec.dropped is None:
                rec.retry_at = time.monotonic() + PROBE_RETRY_S
            return False
        if rec.info is None:
            rec.up_seq = next(self._up_order)
        rec.info, rec.last_error = info, None
        self._log("up", name, info["node"], restarts=rec.restarts,
                  **{k: v for k, v in info.items() if k not in ("name", "node")})
        return True

    # ------------------------------------------------------------------ reports and shutdown
    def down_report(self) -> list[str]:
        """`name: why` of every worker not serving (the fleet's stop message), dropped ones last."""
        live = self.live()
        out = [f"{n}: {r.last_error or 'no result'}" for n, r in sorted(live.items()) if r.info is None]
        return out + [f"{n}: dropped ({why})" for n, why in sorted(self.dropped().items())]

    def figures(self) -> dict[str, float]:
        return {
            "fleet/workers_up": float(len(self.serving())),
            "fleet/workers_target": float(self.target),  # what the nodes hold, up to MAX (elastic); N (fixed)
            "fleet/workers_dropped": float(len(self.dropped())),
            "fleet/worker_restarts": float(sum(r.restarts for r in self.records.values())),
        }

    def close(self) -> None:
        """Asks the serving workers to close (their agents' tool processes), waits a few seconds, kills the actors."""
        closing = [self.handle(n).close.options(concurrency_group="health").remote() for n in self.serving()]
        if closing:
            try:
                self.ray.wait(closing, num_returns=len(closing), timeout=CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - a worker gone already: the kill below is all that is left
                pass
        for rec in self.live().values():
            try:
                self.ray.kill(rec.handle)
            except Exception:  # noqa: BLE001 - already gone; nothing to release
                pass
