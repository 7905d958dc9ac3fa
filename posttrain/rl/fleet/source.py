"""The fleet as a rollout source: the trainer's side of asynchronous RL on Ray.

    trainer process(es)                               Ray actors
      publish(params, v) --- chunks of its blocks ---> ParameterServer (versions, object store)
                                                           ^ latest()  (pulled at the start of a lease; with
                                                           |  fleet.swap=segment also between decode segments)
      dispatcher.lease(k) --- rollout(lease) ---------> RolloutWorker 1..W (own devices, Sampler, rewards)
      dispatcher.complete <-- scored groups + versions -+
      next(step) -> B groups within the staleness bound; commit(rollouts) after the update

In parts: the workers are the pool's (`pool.WorkerPool`: lifecycle, health, elasticity, one record per worker),
the leases in flight the lease book's (`leases.LeaseBook`, over the run's `Dispatcher`: leases, re-queues,
exactly-once), the step's throughput figures the meter's (`meter.FleetMeter`), and when the fleet has stalled
the stall watch's (`stall.StallWatch`). This source connects to Ray, publishes the weights, runs the loop that
serves the parts, and stops the run when the fleet stalls.

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

An elastic fleet (`fleet.workers: MIN..MAX`, `posttrain.rl.fleet.elastic`): every few seconds the pool looks
at Ray's live nodes and starts workers, each pinned to its node, where nodes offer room for them, up to MAX
(a node joining mid-run gets workers within seconds). A worker whose node left, or that failed more than
`fleet.max_restarts` times (went down or did not answer a probe), is dropped (event "dropped"; its leases
re-queued; no new workers on a node where one failed that often); the run goes on with the rest, and stops
as above (checkpoint, the workers named) when fewer than MIN serve for `fleet.stall_timeout_s`.
Worker results carry timings, from which the step's metrics come (pull seconds, busy fraction,
samples/s, weight swaps within leases); the trainer side measures publish seconds and bytes.

The source gets only what it uses: the `GroupIntake` over the run's dispatcher, the fleet section, the train
prompts (a lease's `Prompt` items go to its worker), the config sections a worker is built from
(`worker_sections`), where worker events go, and how to save a checkpoint. `FleetSource.start` connects to Ray
first; the constructor itself takes a Ray module (tests pass a fake one).

A multi-process trainer (JAX multi-controller): process 0 is the one Ray driver that runs the dispatcher
and this source; every process publishes its own blocks of the weights (`publish_part`), and the others
(`posttrain.rl.fleet.follower.FleetFollower`) join the same Ray instance only for that, and read each
step's batch (or the error that stops the run) from what process 0 leaves in JAX's coordination service.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import ml_dtypes

from posttrain import distributed
from posttrain.algorithms.registry import GRPOFamily
from posttrain.rl.config import PromptData, RLConfig
from posttrain.rl.fleet.cluster import FleetError, connect, disconnect, require_ray
from posttrain.rl.fleet.leases import LeaseBook
from posttrain.rl.fleet.meter import FleetMeter
from posttrain.rl.fleet.param_server import NAME, ParameterServer
from posttrain.rl.fleet.pool import WorkerPool, WorkerSpec, pinned
from posttrain.rl.fleet.shards import put_chunks
from posttrain.rl.fleet.stall import StallWatch
from posttrain.rl.fleet.worker import RolloutWorker
from posttrain.rl.sources import GroupIntake
from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.rollouts import Rollouts

__all__ = ["FleetSource", "worker_sections"]

JOIN_GRACE_S = 120.0  # how long a trainer process may be unresponsive while it starts or joins Ray
RAY_KEY = "posttrain/fleet/ray"  # where process 0 tells the other trainer processes how to reach Ray
BATCH_KEY = "posttrain/fleet/batch"  # + /STEP: a step's batch (or the error that stops the run), from process 0


def wire_dtype(fc):
    return ml_dtypes.bfloat16 if fc.transfer_dtype == "bfloat16" else None


def publish_part(ray, ps, params, version: int, fc) -> tuple[bool, int]:
    """This trainer process's blocks of the weights, published as `version` (see `posttrain.rl.fleet.shards`):
    (whether the version is complete, bytes this process put)."""
    refs, nbytes = put_chunks(ray, params, wire_dtype(fc))
    done = ray.get(ps.add.remote(version, jax.process_index(), jax.process_count(), refs, nbytes))
    return bool(done), nbytes


def worker_sections(cfg: RLConfig, preset: GRPOFamily, data: PromptData) -> dict:
    """The plain, picklable config sections a `RolloutWorker` is built from: the trainer's `model` and `lora`,
    `rollout`, `rewards`, the typed algorithm `preset`, the run's `seed`, the `data` section with the prompt field
    the records were read with, `fleet`, and whether to record the experts routed to (`learner.routing_replay`)."""
    return dict(model=cfg.model, lora=cfg.lora, rollout=cfg.rollout, rewards=cfg.rewards, preset=preset,
                seed=cfg.trainer.seed, data=data, fleet=cfg.fleet, record_experts=cfg.learner.routing_replay)


class FleetSource:
    """The source over the worker pool (`pool`), the lease book (`book`), the step's figures (`meter`) and the
    stall watch (`stall`): it publishes weights, runs the loop that serves them all, and stops the run (with the
    other trainer processes, after `save(step)`) when the fleet stalls. `ps`: the parameter server (the spec's); `started`:
    what `connect` answered (for `disconnect`)."""

    def __init__(self, ray, intake: GroupIntake, fc, spec: WorkerSpec, prompts: PromptSet, *, events: Path,
                 save: Callable[[int], None], batch_prompts: int, started=None):
        self.ray, self.intake, self.fc, self.prompts = ray, intake, fc, prompts
        self.save, self.batch_prompts, self.started, self.ps = save, batch_prompts, started, spec.ps
        self.version: int | None = None  # the latest published version
        self._stopped = False
        self.book = LeaseBook(ray, intake.dispatcher, self._send)
        self.meter = FleetMeter()
        self.stall = StallWatch(fc)
        self.pool = WorkerPool(ray, fc, spec, events, self.book.release)
        self.pool.start()  # the first workers (an elastic fleet's: where the nodes have room now)

    @classmethod
    def start(cls, intake: GroupIntake, fc, prompts: PromptSet, sections: dict, **kw) -> FleetSource:
        """Connects to Ray (or starts it), starts the parameter server on this node, tells the other trainer
        processes where Ray is, and starts the fleet of workers built from `sections` (`worker_sections`)."""
        ray = require_ray()
        namespace = f"posttrain-{os.getpid()}-{time.time_ns()}"
        with distributed.busy(fc.connect_timeout_s + JOIN_GRACE_S):  # Ray's start-up may hold the GIL for seconds
            started = connect(fc, num_cpus_needed=fc.max_workers * fc.worker_cpus, namespace=namespace)
            ps = ray.remote(num_cpus=0)(ParameterServer).options(  # on the trainer's node: rollout nodes may leave
                name=NAME, scheduling_strategy=pinned(ray.get_runtime_context().get_node_id())
            ).remote(fc.keep_versions)
            ray.get(ps.latest_version.remote())  # up before the other trainer processes look it up
        distributed.post_json(RAY_KEY, {"address": ray.get_runtime_context().gcs_address, "namespace": namespace})
        worker_cls = ray.remote(concurrency_groups={"health": 1})(RolloutWorker)
        options = dict(num_cpus=fc.worker_cpus, num_gpus=fc.worker_gpus or None, max_task_retries=0,
                       resources=dict(fc.worker_resources) or None, max_restarts=fc.max_restarts)
        return cls(ray, intake, fc, WorkerSpec(worker_cls, options, sections, ps), prompts, started=started, **kw)

    def _send(self, name: str, lease):
        """Starts a worker's rollout call for `lease` (its groups' `Prompt` items); its Ray reference."""
        return self.pool.handle(name).rollout.remote(lease.id, lease.uids, self.prompts.select(lease.records))

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
        self.meter.publish = (time.perf_counter() - t0, self.ray.get(self.ps.info.remote())["bytes"][version])

    # ------------------------------------------------------------------ batches (and acks) for every process
    def next(self, step: int) -> Rollouts:
        """The step's groups; on a multi-process trainer also left for the other processes (`FleetFollower`),
        as JSON, which every process then trains on (process 0 too: the same numbers everywhere)."""
        try:
            ro = self.intake.take(step, self._produce)
        except FleetError as e:
            self._stop_others(step, str(e))
            raise
        if jax.process_count() == 1:
            return ro
        wire = ro.to_json()
        distributed.post_json(f"{BATCH_KEY}/{step}", {"rollouts": wire})
        distributed.drop_posted(f"{BATCH_KEY}/{step - 1}")  # every process trained step - 1: it read that one
        return Rollouts.from_json(json.loads(json.dumps(wire)))

    def commit(self, rollouts: Rollouts) -> list[int]:
        return self.intake.commit(rollouts)

    def _stop_others(self, step: int, message: str, save: int | None = None) -> None:
        if not self._stopped:
            self._stopped = True
            distributed.post_json(f"{BATCH_KEY}/{step}", {"error": message, "save": save})

    # ------------------------------------------------------------------ work
    def _hand_out(self, step: int) -> None:
        pool = self.pool
        size = self.fc.lease_groups or math.ceil(self.batch_prompts / max(pool.size, 1))
        self.book.hand_out(step - 1, self.version, pool.serving(), size)

    def _on_result(self, ref) -> None:
        res = self.book.collect(ref, self.pool.down)
        if res is None:
            return
        self.stall.delivered = True
        self.intake.complete(res["lease"], res["rollouts"])
        self.stall.progress()
        self.meter.add(res)

    def _produce(self, step: int) -> None:
        ray, pool, book = self.ray, self.pool, self.book
        for lease in self.intake.dispatcher.expire():  # past its deadline: the groups re-queued, the worker restarted
            pool.restart(lease.worker, "lease expired")
        pool.tend()
        self._hand_out(step)
        refs = [*book.inflight, *pool.probes, *pool.heartbeats]
        done, _ = ray.wait(refs, num_returns=1, timeout=1.0) if refs else ([], [])
        if not refs:
            time.sleep(0.2)
        for ref in done:
            if ref in book.inflight:
                self._on_result(ref)
            elif ref in pool.probes:
                if pool.on_probe(ref):
                    self.stall.progress()  # a worker (re)joining is progress too
            else:
                pool.on_heartbeat(ref)
        self._check_stall(step)

    def _check_stall(self, step: int) -> None:
        """Stops the run (after a checkpoint, naming the workers down) when the fleet stalled (`StallWatch`)."""
        what = self.stall.check(self.pool.serving())
        if what is None:
            return
        down = self.pool.down_report()
        message = (f"{what}; workers down: {', '.join(down) or 'none down'}. A checkpoint of step {step - 1} was "
                   f"saved: rerun the command to resume.")
        self._stop_others(step, message, save=step - 1)  # every trainer process saves (a collective)
        self.save(step - 1)
        raise FleetError(message)

    # ------------------------------------------------------------------ metrics and shutdown
    def metrics(self, step: int, rollouts) -> dict[str, float]:
        out = self.intake.figures(step, rollouts)
        out.update(self.meter.figures(self.pool.size))
        out.update(self.pool.figures())
        return out

    def close(self) -> None:
        """Asks the serving workers to close (their agents' tool processes), waits a few seconds, kills the actors
        and the parameter server, and leaves (or stops) Ray."""
        self.pool.close()
        try:
            self.ray.kill(self.ps)
        except Exception:  # noqa: BLE001 - already gone; nothing to release
            pass
        with distributed.busy(JOIN_GRACE_S):
            disconnect(self.started)
