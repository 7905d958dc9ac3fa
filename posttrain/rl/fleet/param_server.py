"""The parameter server: a long-lived Ray actor that owns the published weights, by policy version.

The trainer publishes `{path: numpy array}` (all trained weights, or only the LoRA adapters; optionally
bfloat16 on the wire) every `fleet.publish_every` steps. The server `ray.put`s them itself, so the objects
belong to it, not to the trainer (objects die with their owner), and readers on a node share one copy in
the object store. It keeps the last `keep` versions. Publishing a version again is a no-op and pulling is
read-only, so a call Ray retries changes nothing.
"""

from __future__ import annotations

import time

import numpy as np
import ray

__all__ = ["ParameterServer"]


class ParameterServer:
    def __init__(self, keep: int = 2):
        self.keep = int(keep)
        self.versions: dict[int, object] = {}  # version -> ObjectRef of the weights dict
        self.nbytes: dict[int, int] = {}
        self.published_at: dict[int, float] = {}

    def publish(self, version: int, weights: dict) -> bool:
        """Stores `weights` as `version` (False when it was already there)."""
        version = int(version)
        if version in self.versions:
            return False
        self.versions[version] = ray.put(weights)
        self.nbytes[version] = int(sum(np.asarray(x).nbytes for x in weights.values()))
        self.published_at[version] = time.time()
        for v in sorted(self.versions)[: -self.keep]:
            del self.versions[v], self.nbytes[v], self.published_at[v]
        return True

    def latest_version(self) -> int:
        return max(self.versions) if self.versions else -1

    def latest(self) -> tuple[int, list]:
        """(version, [ObjectRef]) of the newest weights (wrapped in a list so Ray passes the reference on)."""
        if not self.versions:
            return -1, []
        v = max(self.versions)
        return v, [self.versions[v]]

    def info(self) -> dict:
        return {"versions": sorted(self.versions), "bytes": dict(self.nbytes)}
