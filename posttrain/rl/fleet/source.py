"""The fleet as a rollout source: the trainer's side of asynchronous RL on Ray.

    trainer process(es)                               Ray actors
      publish(params, v) --- chunks of its blocks ---> ParameterServer (versions, object store)
                                                           ^ latest()  (pulled at the start of a lease; with
                                                           |  fleet.swap=segment also between decode segments)
      dispatcher.lease(k) --- rollout(lease) ---------> RolloutWorker 1..W (own devices, Sampler, rewards)
      dispatcher.complete <-- scored groups + versions -+
      next(step) -> B groups within the staleness bound; commit(rollouts) after the update

Each worker holds at most two leases (one generating, one queued behind it), so it never waits for the
trainer while the staleness bound allows more work; the dispatcher's admission keeps what is leased
within `fleet.max_staleness` versions of the published weights. A worker that dies (its calls fail
with `RayActorError`) gets its leases re-queued and is probed until Ray has restarted it; a lease past
its deadline is re-queued and its worker killed (Ray restarts it), and so is a worker that answers no
heartbeat (sent every few seconds, answered from a second thread even mid-generation) within
`fleet.heartbeat_timeout_s`, or stays that long pulling weights. If no worker delivers anything for
`fleet.stall_timeout_s` (`fleet.start_timeout_s` until the first result: model loads and compiles; a
worker coming up counts as progress), the run saves a checkpoint and stops with an error naming the workers that are
down. `fleet_workers.jsonl` records each worker coming up (again) (event "up": name, pid, host, Ray node)
and going down (event "down", with the reason).

An elastic fleet (`fleet.workers: MIN..MAX`, `posttrain.rl.fleet.elastic`): every few seconds the source looks
at Ray's live nodes and starts workers, each pinned to its node, where nodes offer room for them, up to MAX
(a node joining mid-run gets workers within seconds). A worker whose node left, or that failed more than
`fleet.max_restarts` times (went down or did not answer a probe), is dropped (event "dropped"; its leases
re-queued; no new workers on a node where one failed that often); the run goes on with the rest, and stops
as above (checkpoint, the workers named) when fewer than MIN serve for `fleet.stall_timeout_s`.
Worker results carry timings, from which the step's metrics come (pull seconds, busy fraction,
samples/s, weight swaps within leases); the trainer side measures publish seconds and bytes.

A multi-process trainer (JAX multi-controller): process 0 is the one Ray driver that runs the dispatcher
and this source; every process publishes its own blocks of the weights (`publish_part`), and the others
(`posttrain.rl.fleet.follower.FleetFollower`) join the same Ray instance only for that, and read each
step's batch (or the error that stops the run) from what process 0 leaves in JAX's coordination service.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time

import jax
import ml_dtypes

from posttrain import distributed
from posttrain.rl.fleet.cluster import FleetError, connect, disconnect, require_ray
from posttrain.rl.fleet.elastic import live_nodes, placements, worker_needs
from posttrain.rl.fleet.param_server import NAME, ParameterServer
from posttrain.rl.fleet.shards import put_chunks
from posttrain.rl.fleet.worker import RolloutWorker
from posttrain.rl.rollout import Rollouts
from posttrain.rl.sources import RolloutSource

__all__ = ["FleetSource"]

PIPELINE = 2  # leases in flight per worker
PROBE_RETRY_S = 2.0
SIZING_S = 2.0  # between looks at the Ray nodes (an elastic fleet)
HEARTBEAT_S = 5.0  # between heartbeats to each serving worker
MAX_TASK_ERRORS = 3  # failed rollout calls (not deaths) in a row before the run stops with the error
JOIN_GRACE_S = 120.0  # how long a trainer process may be unresponsive while it starts or joins Ray
RAY_KEY = "posttrain/fleet/ray"  # where process 0 tells the other trainer processes how to reach Ray
CLOSE_WAIT_S = 5.0  # how long the workers get to close their agents at the end of the run
BATCH_KEY = "posttrain/fleet/batch"  # + /STEP: a step's batch (or the error that stops the run), from process 0


def wire_dtype(fc):
    return ml_dtypes.bfloat16 if fc.transfer_dtype == "bfloat16" else None


def publish_part(ray, ps, params, version: int, fc) -> tuple[bool, int]:
    """This trainer process's blocks of the weights, published as `version` (see `posttrain.rl.fleet.shards`):
    (whether the version is complete, bytes this process put)."""
    refs, nbytes = put_chunks(ray, params, wire_dtype(fc))
    done = ray.get(ps.add.remote(version, jax.process_index(), jax.process_count(), refs, nbytes))
    return bool(done), nbytes


def _pinned(node: str):
    """Ray's placement on `node` and nowhere else (see `posttrain.rl.fleet.elastic` for why)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy, like Ray itself (require_ray)

    return NodeAffinitySchedulingStrategy(node, soft=False)


class FleetSource(RolloutSource):
    def __init__(self, run):
        super().__init__(run)
        ray = self.ray = require_ray()
        self.fc = fc = run.cfg.fleet
        namespace = f"posttrain-{os.getpid()}-{time.time_ns()}"
        with distributed.busy(fc.connect_timeout_s + JOIN_GRACE_S):  # Ray's start-up may hold the GIL for seconds
            self.started = connect(fc, num_cpus_needed=fc.max_workers * fc.worker_cpus, namespace=namespace)
            self.ps = ray.remote(num_cpus=0)(ParameterServer).options(  # on the trainer's node: rollout nodes may leave
                name=NAME, scheduling_strategy=_pinned(ray.get_runtime_context().get_node_id())
            ).remote(fc.keep_versions)
            self.ray.get(self.ps.latest_version.remote())  # up before the other trainer processes look it up
        distributed.post_json(RAY_KEY, {"address": ray.get_runtime_context().gcs_address, "namespace": namespace})
        self.worker_cls = ray.remote(concurrency_groups={"health": 1})(RolloutWorker)
        self.worker_options = dict(num_cpus=fc.worker_cpus, num_gpus=fc.worker_gpus or None, max_task_retries=0,
                                   resources=dict(fc.worker_resources) or None, max_restarts=fc.max_restarts)
        cfg = run.cfg
        data = getattr(run, "prompt_data", cfg.data)  # the prompt field the run's records were read with
        self.sections = dict(model=cfg.model, lora=cfg.lora, rollout=cfg.rollout, rewards=cfg.rewards,
                             preset=run.preset, seed=cfg.trainer.seed, data=data, fleet=fc)
        self._start_fleet()

    def _start_fleet(self) -> None:
        """The bookkeeping of workers, leases and timings, and the first workers (an elastic fleet's: where the
        nodes have room now)."""
        fc = self.fc
        self.workers: dict = {}  # name -> actor handle of every worker in the fleet (dropped ones leave it)
        self.up: dict[str, dict] = {}  # name -> ready() info of workers known to be serving
        self.probes: dict = {}  # ref -> worker name
        self.probe_due: dict[str, float] = {}  # worker -> when to probe again after a failed probe
        self.node_of: dict[str, str] = {}  # an elastic worker -> the node it is pinned to
        self.dropped: dict[str, str] = {}  # worker -> why it was dropped (an elastic fleet)
        self.failures = collections.Counter()  # worker -> times down or not answering a probe (the drop rule)
        self.bad_nodes: set[str] = set()  # nodes where a worker was dropped for failing: no new workers there
        self.needs, self.next_sizing, self.target = worker_needs(fc), 0.0, fc.max_workers
        self.short_since: float | None = None  # since when fewer than the minimum of workers serve
        self.last_error: dict[str, str] = {}
        self.inflight: dict = {}  # ref -> (lease id, worker name)
        self.heartbeats: dict = {}  # ref -> (worker name, sent at)
        self.next_heartbeat = time.monotonic() + HEARTBEAT_S
        self.last_result = time.monotonic()
        self.delivered = False  # until the first result, start_timeout_s applies (model load, compiles)
        self.task_errors = 0
        self.restarts = collections.Counter()
        self._window = collections.Counter()  # per-step sums: samples, pull_s, results
        self._t_window = time.monotonic()
        self._publish = (0.0, 0)  # seconds and bytes of the last publish
        self._busy_total, self._t_start = 0.0, time.monotonic()
        if fc.elastic:
            self._resize()
        else:
            for _ in range(fc.workers):
                self._add_worker()

    # ------------------------------------------------------------------ weights
    def publish(self, params, version: int) -> None:
        """Every `fleet.publish_every` versions, and always the first (a fresh or resumed run's weights)."""
        if self.version is not None and version % self.fc.publish_every:
            return
        t0 = time.perf_counter()
        done, nbytes = publish_part(self.ray, self.ps, params, version, self.fc)
        while not done:  # the other trainer processes' blocks (a process that died is the watchdog's)
            time.sleep(0.01)
            done = self.ray.get(self.ps.complete.remote(version))
        self.version = version
        self._publish = (time.perf_counter() - t0, self.ray.get(self.ps.info.remote())["bytes"][version])

    # ------------------------------------------------------------------ batches (and acks) for every process
    def next(self, step: int) -> Rollouts:
        """The step's groups; on a multi-process trainer also left for the other processes (`FleetFollower`),
        as JSON, which every process then trains on (process 0 too: the same numbers everywhere)."""
        try:
            ro = super().next(step)
        except FleetError as e:
            self._stop_others(step, str(e))
            raise
        if jax.process_count() == 1:
            return ro
        wire = ro.to_json()
        distributed.post_json(f"{BATCH_KEY}/{step}", {"rollouts": wire})
        distributed.drop_posted(f"{BATCH_KEY}/{step - 1}")  # every process trained step - 1: it read that one
        return Rollouts.from_json(json.loads(json.dumps(wire)))

    def _stop_others(self, step: int, message: str, save: int | None = None) -> None:
        if not getattr(self, "_stopped", False):
            self._stopped = True
            distributed.post_json(f"{BATCH_KEY}/{step}", {"error": message, "save": save})

    # ------------------------------------------------------------------ membership
    def _add_worker(self, node: str | None = None) -> None:
        """A new worker `worker-<i>` (pinned to `node` when given: an elastic fleet's), probed until it is up."""
        name = f"worker-{len(self.workers) + len(self.dropped)}"
        pinned = {} if node is None else {"scheduling_strategy": _pinned(node)}
        cls = self.worker_cls.options(**self.worker_options, **pinned)
        self.workers[name] = handle = cls.remote(name, self.ps, **self.sections)
        if node is not None:
            self.node_of[name] = node
        self.probes[handle.ready.remote()] = name

    def _resize(self) -> None:
        """An elastic fleet's look at the Ray nodes (module docstring): drops the workers of nodes that left and
        starts workers where live nodes have room, up to MAX."""
        self.next_sizing = time.monotonic() + SIZING_S
        nodes = live_nodes(self.ray)
        for name, node in list(self.node_of.items()):
            if node not in nodes:
                self._drop(name, "its node left the cluster")
        held = collections.Counter(self.node_of.values())
        room = len(placements(nodes, self.needs, collections.Counter(), self.fc.max_workers, self.bad_nodes))
        self.target = max(room, len(self.workers))
        for node in placements(nodes, self.needs, held, self.fc.max_workers - len(self.workers), self.bad_nodes):
            self._add_worker(node)

    def _drop(self, name: str, why: str) -> None:
        """An elastic worker leaves the fleet for good: killed, its leases re-queued, never probed again."""
        handle, node = self.workers.pop(name), self.node_of.pop(name, None)
        try:
            self.ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its node: nothing to end
            pass
        for ref, (lease_id, owner) in list(self.inflight.items()):
            if owner == name:
                del self.inflight[ref]
                self.dispatcher.fail(lease_id, "worker_dropped")
        for ref in [r for r, n in self.probes.items() if n == name]:
            del self.probes[ref]
        for ref in [r for r, (n, _) in self.heartbeats.items() if n == name]:
            del self.heartbeats[ref]
        self.up.pop(name, None)
        self.probe_due.pop(name, None)
        self.dropped[name] = why
        self._log_event("dropped", name, node, reason=why)

    def _failed(self, name: str, why: str) -> None:
        """A worker went down or did not answer a probe. The drop rule of an elastic fleet: more failures than
        `fleet.max_restarts` (-1: never) drop the worker; and since a failure may be its node leaving (whose
        workers `_resize` drops), the nodes are looked at again at once."""
        n = self.failures[name] = self.failures[name] + 1
        self.last_error[name] = why
        if not self.fc.elastic:
            return
        self.next_sizing = 0.0
        if 0 <= self.fc.max_restarts < n:
            self.bad_nodes.add(self.node_of.get(name))
            self._drop(name, f"{n} failure{'s' * (n > 1)}, more than fleet.max_restarts={self.fc.max_restarts}; "
                             f"the last: {why}")

    def _log_event(self, event: str, name: str, node: str | None, **fields) -> None:
        with open(self.run.out / "fleet_workers.jsonl", "a", encoding="utf-8") as f:  # who ran where, and when
            f.write(json.dumps({"event": event, "time": time.time(), "name": name, "node": node, **fields}) + "\n")

    # ------------------------------------------------------------------ work
    def _hand_out(self, step: int) -> None:
        d, run = self.dispatcher, self.run
        busy = collections.Counter(name for _, name in self.inflight.values())
        size = self.fc.lease_groups or math.ceil(run.cfg.rollout.batch_prompts / max(len(self.workers), 1))
        for name in sorted(self.up, key=lambda n: busy[n]):
            while busy[name] < PIPELINE:
                k = min(size, d.admissible(step - 1, self.version))
                if k < 1:
                    return
                lease = d.lease(name, k)
                ref = self.workers[name].rollout.remote(lease.id, lease.uids, *run.lease_items(lease))
                self.inflight[ref] = (lease.id, name)
                busy[name] += 1

    def _worker_down(self, name: str, why: str) -> None:
        info = self.up.pop(name, None)
        if info is not None:
            self.restarts[name] += 1
            self._log_event("down", name, info.get("node"), reason=why, restarts=self.restarts[name])
        self._failed(name, why)
        if name in self.workers and name not in self.probes.values() and name not in self.probe_due:
            self.probes[self.workers[name].ready.remote()] = name

    def _on_result(self, ref) -> None:
        ray = self.ray
        lease_id, name = self.inflight.pop(ref)
        try:
            res = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as e:  # the latter: node gone
            self.dispatcher.fail(lease_id, "worker_died")
            self._worker_down(name, f"died ({type(e).__name__})")
            return
        except ray.exceptions.RayTaskError as e:
            self.dispatcher.fail(lease_id, "task_error")
            self.task_errors += 1
            if self.task_errors >= MAX_TASK_ERRORS:
                raise FleetError(f"rollouts keep failing on the workers; the last error ({name}):\n{e}") from None
            return
        self.task_errors = 0
        self.delivered = True
        self._complete(res["lease"], res["rollouts"])
        self.last_result = time.monotonic()
        w = self._window
        w["samples"] += len(res["rollouts"])
        self._busy_total += res["seconds"]
        w["pull_s"] += res["pull_s"]
        w["results"] += 1
        w["swaps"] += res["swaps"]
        w["swap_s"] += res["swap_s"]

    def _restart(self, name: str, why: str) -> None:
        """A stuck worker: its leases go back to the queue and Ray restarts it."""
        if name not in self.workers:  # dropped already
            return
        self.ray.kill(self.workers[name], no_restart=False)
        for ref, (lease_id, owner) in list(self.inflight.items()):
            if owner == name:
                del self.inflight[ref]
                self.dispatcher.fail(lease_id, "worker_stuck")
        self._worker_down(name, why)

    def _check_health(self) -> None:
        """Heartbeats (answered from the worker's second thread, so also mid-generation) and their deadlines:
        no answer within fleet.heartbeat_timeout_s, or pulling weights for longer than that, is a stuck worker."""
        now, limit = time.monotonic(), self.fc.heartbeat_timeout_s
        for ref, (name, sent) in list(self.heartbeats.items()):
            if now - sent > limit:
                del self.heartbeats[ref]
                self._restart(name, f"no heartbeat for {limit:g} s")
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_S
            waiting = {n for n, _ in self.heartbeats.values()}
            for name in self.up:
                if name not in waiting:
                    ref = self.workers[name].heartbeat.options(concurrency_group="health").remote()
                    self.heartbeats[ref] = (name, now)

    def _on_heartbeat(self, ref) -> None:
        name, _ = self.heartbeats.pop(ref)
        try:
            beat = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            return  # the worker died; its calls fail and say so
        if beat["state"] == "pulling" and time.time() - beat["since"] > self.fc.heartbeat_timeout_s:
            self._restart(name, "stuck pulling weights")

    def _on_probe(self, ref) -> None:
        name = self.probes.pop(ref)
        try:
            self.up[name] = info = self.ray.get(ref)
            self.last_error.pop(name, None)
            self.last_result = time.monotonic()  # a worker (re)joining is progress too
            self._log_event("up", name, info["node"], restarts=self.restarts[name],
                            **{k: v for k, v in info.items() if k not in ("name", "node")})
        except self.ray.exceptions.RayError as e:
            self._failed(name, f"not answering ({type(e).__name__})")
            if name in self.workers:
                self.probe_due[name] = time.monotonic() + PROBE_RETRY_S

    def _produce(self, step: int) -> None:
        ray, d = self.ray, self.dispatcher
        for lease in d.expire():  # past its deadline: the groups are re-queued, the worker restarted
            self._restart(lease.worker, "lease expired")
        self._check_health()
        now = time.monotonic()
        if self.fc.elastic and now >= self.next_sizing:
            self._resize()
        for name, due in list(self.probe_due.items()):
            if due <= now:
                del self.probe_due[name]
                self.probes[self.workers[name].ready.remote()] = name
        self._hand_out(step)
        refs = [*self.inflight, *self.probes, *self.heartbeats]
        done, _ = ray.wait(refs, num_returns=1, timeout=1.0) if refs else ([], [])
        if not refs:
            time.sleep(0.2)
        for ref in done:
            if ref in self.inflight:
                self._on_result(ref)
            elif ref in self.probes:
                self._on_probe(ref)
            else:
                self._on_heartbeat(ref)
        self._check_stall(step)

    def _check_stall(self, step: int) -> None:
        """Stops the run (after a checkpoint, naming the workers down) when no worker delivered anything for the
        stall timeout, or (an elastic fleet) fewer than its minimum served for that long."""
        fc, now = self.fc, time.monotonic()
        limit = fc.stall_timeout_s if self.delivered else max(fc.stall_timeout_s, fc.start_timeout_s)
        key = "stall_timeout_s" if self.delivered else "start_timeout_s"
        short = fc.elastic and len(self.up) < fc.min_workers
        self.short_since = (self.short_since or now) if short else None
        if now - self.last_result > limit:
            what = f"no rollout worker delivered anything for {limit:g} s (fleet.{key})"
        elif short and now - self.short_since > limit:
            what = (f"fewer than {fc.min_workers} rollout workers (fleet.workers={fc.workers}) served for {limit:g} s "
                    f"(fleet.{key}); serving: {', '.join(sorted(self.up)) or 'none'}")
        else:
            return
        down = [f"{n}: {self.last_error.get(n, 'no result')}" for n in sorted(self.workers) if n not in self.up]
        down += [f"{n}: dropped ({why})" for n, why in sorted(self.dropped.items())]
        message = (f"{what}; workers down: {', '.join(down) or 'none down'}. A checkpoint of step {step - 1} was "
                   f"saved: rerun the command to resume.")
        self._stop_others(step, message, save=step - 1)  # every trainer process saves (a collective)
        self.run.save(step - 1)
        self.run.ckpt.wait()
        raise FleetError(message)

    # ------------------------------------------------------------------ metrics and shutdown
    def metrics(self, step: int, rollouts) -> dict[str, float]:
        out = self.base_metrics(step, rollouts)
        w, now = self._window, time.monotonic()
        wall = max(now - self._t_window, 1e-9)
        out.update({
            "fleet/publish_s": self._publish[0],
            "fleet/publish_mb": self._publish[1] / 2**20,
            "fleet/pull_s": w["pull_s"] / max(w["results"], 1),
            "fleet/leases": float(w["results"]),  # leases delivered in this step's window
            "fleet/swaps_mid_lease": float(w["swaps"]),  # fleet.swap=segment: weights taken between segments
            "fleet/swap_s": w["swap_s"] / max(w["swaps"], 1),
            # since the start: a result's seconds may predate a step's window (workers run ahead)
            "fleet/busy_fraction": self._busy_total / ((now - self._t_start) * max(len(self.workers), 1)),
            "fleet/samples_per_s": w["samples"] / wall,
            "fleet/workers_up": float(len(self.up)),
            "fleet/workers_target": float(self.target),  # what the nodes hold, up to MAX (elastic); N (fixed)
            "fleet/workers_dropped": float(len(self.dropped)),
            "fleet/worker_restarts": float(sum(self.restarts.values())),
        })
        self._window, self._t_window = collections.Counter(), now
        return out

    def close(self) -> None:
        """Asks the serving workers to close (their agents' tool processes), waits a few seconds, kills the actors."""
        closing = [self.workers[n].close.options(concurrency_group="health").remote() for n in self.up]
        if closing:
            try:
                self.ray.wait(closing, num_returns=len(closing), timeout=CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - a worker gone already: the kill below is all that is left
                pass
        for h in [*self.workers.values(), self.ps]:
            try:
                self.ray.kill(h)
            except Exception:  # noqa: BLE001 - already gone; nothing to release
                pass
        with distributed.busy(JOIN_GRACE_S):
            disconnect(self.started)
