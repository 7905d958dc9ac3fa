"""The fleet on trainer processes other than process 0 (a multi-process trainer, JAX multi-controller).

Process 0 runs the Ray driver's side of the fleet (`FleetSource`: dispatcher, workers, acks). Every other
process joins the same Ray instance only to publish its own blocks of the weights to the parameter server
(found by name in the run's namespace), and gets each step's batch from process 0 through JAX's
coordination service (`distributed.wait_json`): the same groups, in the same order, so every process trains
on the same numbers. When process 0 stops the run (no worker delivers, rollouts keep failing), the others
get its error instead of a batch, save the same checkpoint with it when it does (a collective), and stop
with the same line.

`check_hosts` runs first on every process: without `fleet.ray_address` process 0 starts Ray on its own host,
which the other processes can join only from that host.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from posttrain import distributed
from posttrain.config import ConfigError
from posttrain.rl.fleet.cluster import FleetError, join, require_ray
from posttrain.rl.fleet.param_server import NAME
from posttrain.rl.fleet.source import BATCH_KEY, JOIN_GRACE_S, RAY_KEY, publish_part
from posttrain.rollout.rollouts import Rollouts

__all__ = ["FleetFollower", "check_hosts"]


def check_hosts(fc) -> None:
    """Every trainer process (a collective): a local Ray instance (no `fleet.ray_address`) serves a trainer whose
    processes share one host only; otherwise a `ConfigError` on every process, with the reason."""
    if jax.process_count() == 1 or fc.ray_address is not None:
        return
    mine = np.asarray([zlib.crc32(socket.gethostname().encode())], np.uint32)
    hosts = np.asarray(multihost_utils.process_allgather(mine)).ravel()
    if len(set(hosts.tolist())) > 1:
        raise ConfigError(f"fleet.workers with a trainer on {len(set(hosts.tolist()))} hosts needs fleet.ray_address: "
                          "every trainer process publishes its own blocks of the weights to Ray, so every trainer "
                          "host must be a node of one Ray cluster (`ray start` on each; see "
                          "docs/tutorials/rl-fleet.md)")


class FleetFollower:
    """A trainer process other than 0: publishes its blocks, trains on process 0's batches (module docstring).
    `save(step)`: a checkpoint of `step`, on disk when it returns (when process 0 stopped the run after one)."""

    def __init__(self, fc, save: Callable[[int], None]):
        self.ray = require_ray()
        self.fc, self.save = fc, save
        self.version: int | None = None  # the latest published version
        self._t_wait = 0.0
        where = distributed.wait_json(RAY_KEY)
        with distributed.busy(self.fc.connect_timeout_s + JOIN_GRACE_S):  # joining Ray may hold the GIL for seconds
            join(where["address"], where["namespace"])
            try:
                self.ps = self.ray.get_actor(NAME)
            except ValueError as e:
                raise FleetError(f"this trainer process finds no parameter server in Ray ({e})") from None
        self._publish = (0.0, 0)

    def publish(self, params, version: int) -> None:
        if self.version is not None and version % self.fc.publish_every:
            return
        t0 = time.perf_counter()
        _, nbytes = publish_part(self.ray, self.ps, params, version, self.fc)
        self.version = version
        self._publish = (time.perf_counter() - t0, nbytes)

    def next(self, step: int) -> Rollouts:
        t0 = time.perf_counter()
        msg = distributed.wait_json(f"{BATCH_KEY}/{step}")
        self._t_wait = time.perf_counter() - t0
        if "error" in msg:
            if msg.get("save") is not None:
                self.save(int(msg["save"]))
            raise FleetError(msg["error"])
        return Rollouts.from_json(msg["rollouts"])

    def commit(self, rollouts: Rollouts) -> list[int]:
        """Process 0 acknowledges the groups to its dispatcher; here they are only this step's uids."""
        return sorted({int(u) for u in rollouts.uid})

    def metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        return {"fleet/publish_s": self._publish[0], "fleet/publish_mb": self._publish[1] / 2**20,
                "fleet/wait_s": self._t_wait}

    def close(self) -> None:
        if self.ray.is_initialized():
            with distributed.busy(JOIN_GRACE_S):
                self.ray.shutdown()  # leaves the instance; process 0 (which started or joined it) ends its part
