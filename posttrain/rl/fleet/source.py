"""The fleet as a rollout source: the trainer's side of asynchronous RL on Ray.

    trainer process                                   Ray actors
      publish(params, v) --- weights {path: array} --> ParameterServer (versions, object store)
                                                           ^ latest()  (pulled at the start of a lease)
      dispatcher.lease(k) --- rollout(lease) ---------> RolloutWorker 1..W (own devices, Sampler, rewards)
      dispatcher.complete <-- scored groups + versions -+
      next(step) -> B groups within the staleness bound; commit(rollouts) after the update

Each worker holds at most two leases (one generating, one queued behind it), so it never waits for the
trainer while the staleness bound allows more work; the dispatcher's admission keeps what is leased
within `fleet.max_staleness` versions of the published weights. A worker that dies (its calls fail
with `RayActorError`) gets its leases re-queued and is probed until Ray has restarted it; a lease past
its deadline is re-queued and its worker killed (Ray restarts it). If no worker delivers anything for
`fleet.stall_timeout_s`, the run saves a checkpoint and stops with an error naming the workers that are
down. Each worker that comes up (again) is recorded in `fleet_workers.jsonl` (name, pid, host, Ray node).
Worker results carry timings, from which the step's metrics come (pull seconds, busy fraction,
samples/s); the trainer side measures publish seconds and bytes.
"""

from __future__ import annotations

import collections
import json
import math
import time

from posttrain.rl.fleet.cluster import FleetError, connect, disconnect, require_ray
from posttrain.rl.fleet.param_server import ParameterServer
from posttrain.rl.fleet.worker import RolloutWorker
from posttrain.rl.sources import RolloutSource

__all__ = ["FleetSource"]

PIPELINE = 2  # leases in flight per worker
PROBE_RETRY_S = 2.0
MAX_TASK_ERRORS = 3  # failed rollout calls (not deaths) in a row before the run stops with the error


class FleetSource(RolloutSource):
    def __init__(self, run):
        super().__init__(run)
        ray = self.ray = require_ray()
        self.fc = fc = run.cfg.fleet
        self.started = connect(fc, num_cpus_needed=fc.workers * fc.worker_cpus)
        self.ps = ray.remote(num_cpus=0)(ParameterServer).remote(fc.keep_versions)
        worker_cls = ray.remote(concurrency_groups={"health": 1})(RolloutWorker).options(
            num_cpus=fc.worker_cpus, num_gpus=fc.worker_gpus or None, resources=dict(fc.worker_resources) or None,
            max_restarts=fc.max_restarts, max_task_retries=0)
        self.workers = {f"worker-{i}": worker_cls.remote(run.cfg, f"worker-{i}", self.ps) for i in range(fc.workers)}
        self.up: dict[str, dict] = {}  # name -> ready() info of workers known to be serving
        self.probes: dict = {h.ready.remote(): n for n, h in self.workers.items()}  # ref -> worker name
        self.probe_due: dict[str, float] = {}  # worker -> when to probe again after a failed probe
        self.last_error: dict[str, str] = {}
        self.inflight: dict = {}  # ref -> (lease id, worker name)
        self.lease_groups = fc.lease_groups or math.ceil(run.cfg.rollout.batch_prompts / fc.workers)
        self.last_result = time.monotonic()
        self.task_errors = 0
        self.restarts = collections.Counter()
        self._window = collections.Counter()  # per-step sums: samples, tokens, busy_s, pull_s, results
        self._t_window = time.monotonic()
        self._publish = (0.0, 0)  # seconds and bytes of the last publish

    # ------------------------------------------------------------------ weights
    def publish(self, params, version: int) -> None:
        import ml_dtypes

        from posttrain.models.weights import flat_weights, nbytes, to_host

        t0 = time.perf_counter()
        flat = to_host(flat_weights(params), dtype=ml_dtypes.bfloat16 if self.fc.transfer_dtype == "bfloat16" else None)
        self.ray.get(self.ps.publish.remote(version, flat))
        self.version = version
        self._publish = (time.perf_counter() - t0, nbytes(flat))

    # ------------------------------------------------------------------ work
    def _hand_out(self, step: int) -> None:
        d, run = self.dispatcher, self.run
        busy = collections.Counter(name for _, name in self.inflight.values())
        for name in sorted(self.up, key=lambda n: busy[n]):
            while busy[name] < PIPELINE:
                k = min(self.lease_groups, d.admissible(step - 1, self.version))
                if k < 1:
                    return
                lease = d.lease(name, k)
                ref = self.workers[name].rollout.remote(lease.id, lease.uids, *run.lease_items(lease))
                self.inflight[ref] = (lease.id, name)
                busy[name] += 1

    def _worker_down(self, name: str, why: str) -> None:
        if self.up.pop(name, None) is not None:
            self.restarts[name] += 1
        self.last_error[name] = why
        if name not in self.probes.values() and name not in self.probe_due:
            self.probes[self.workers[name].ready.remote()] = name

    def _on_result(self, ref) -> None:
        ray = self.ray
        lease_id, name = self.inflight.pop(ref)
        try:
            res = ray.get(ref)
        except ray.exceptions.RayActorError as e:
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
        self._complete(res["lease"], res["rollouts"])
        self.last_result = time.monotonic()
        w = self._window
        w["samples"] += len(res["rollouts"])
        w["tokens"] += res["tokens"]
        w["busy_s"] += res["seconds"]
        w["pull_s"] += res["pull_s"]
        w["results"] += 1

    def _on_probe(self, ref) -> None:
        name = self.probes.pop(ref)
        try:
            self.up[name] = info = self.ray.get(ref)
            self.last_error.pop(name, None)
            with open(self.run.out / "fleet_workers.jsonl", "a", encoding="utf-8") as f:  # who ran where
                f.write(json.dumps({"time": time.time(), "restarts": self.restarts[name], **info}) + "\n")
        except self.ray.exceptions.RayError as e:
            self.last_error[name] = f"not answering ({type(e).__name__})"
            self.probe_due[name] = time.monotonic() + PROBE_RETRY_S

    def _produce(self, step: int) -> None:
        ray, d = self.ray, self.dispatcher
        for lease in d.expire():  # a stuck worker: its groups are re-queued, the worker restarted
            ray.kill(self.workers[lease.worker], no_restart=False)
            for ref, (lid, _) in list(self.inflight.items()):
                if lid == lease.id:
                    del self.inflight[ref]
            self._worker_down(lease.worker, "lease expired")
        now = time.monotonic()
        for name, due in list(self.probe_due.items()):
            if due <= now:
                del self.probe_due[name]
                self.probes[self.workers[name].ready.remote()] = name
        self._hand_out(step)
        refs = list(self.inflight) + list(self.probes)
        done, _ = ray.wait(refs, num_returns=1, timeout=1.0) if refs else ([], [])
        if not refs:
            time.sleep(0.2)
        for ref in done:
            (self._on_result if ref in self.inflight else self._on_probe)(ref)
        if time.monotonic() - self.last_result > self.fc.stall_timeout_s:
            self.run.save(step - 1)
            self.run.ckpt.wait()
            down = sorted(n for n in self.workers if n not in self.up)
            detail = ", ".join(f"{n}: {self.last_error.get(n, 'no result')}" for n in down) or "none down"
            raise FleetError(f"no rollout worker delivered anything for {self.fc.stall_timeout_s:g} s "
                             f"(fleet.stall_timeout_s); workers down: {detail}. A checkpoint of step {step - 1} "
                             f"was saved: rerun the command to resume.")

    # ------------------------------------------------------------------ metrics and shutdown
    def metrics(self, step: int, rollouts) -> dict[str, float]:
        out = self.base_metrics(step, rollouts)
        w, now = self._window, time.monotonic()
        wall = max(now - self._t_window, 1e-9)
        out.update({
            "fleet/publish_s": self._publish[0],
            "fleet/publish_mb": self._publish[1] / 2**20,
            "fleet/pull_s": w["pull_s"] / max(w["results"], 1),
            "fleet/busy_fraction": w["busy_s"] / (wall * len(self.workers)),
            "fleet/samples_per_s": w["samples"] / wall,
            "fleet/workers_up": float(len(self.up)),
            "fleet/worker_restarts": float(sum(self.restarts.values())),
        })
        self._window, self._t_window = collections.Counter(), now
        return out

    def close(self) -> None:
        for h in [*self.workers.values(), self.ps]:
            try:
                self.ray.kill(h)
            except Exception:  # noqa: BLE001 - already gone; nothing to release
                pass
        disconnect(self.started)
