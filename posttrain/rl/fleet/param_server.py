"""The parameter server: a long-lived Ray actor that owns the published weights, by policy version.

Every trainer process publishes its own blocks of the trained weights (all of them, or only the LoRA
adapters; optionally bfloat16 on the wire) every `fleet.publish_every` steps, as chunks it `ray.put`s
itself (`posttrain.rl.fleet.shards`): the weights never pass through a call's arguments (which would copy
them into the store a second time, through this actor), and readers on a node share one copy. The
server holds the references, so an object lives while the server keeps its version (and its trainer
process lives: Ray's objects belong to whoever put them; the run stops when a trainer process dies and
publishes afresh when it restarts). `add` records one process's chunk references; a version is complete, and offered
to workers by `latest`, only when every one of the trainer's processes has added its chunks. It keeps the
last `keep` complete versions. Adding a part again is a no-op and reading is read-only, so a call Ray
retries changes nothing.
"""

from __future__ import annotations

import time

__all__ = ["ParameterServer", "NAME"]

NAME = "posttrain-parameter-server"  # the actor's name in the run's Ray namespace (other trainer processes find it)


class ParameterServer:
    def __init__(self, keep: int = 2):
        self.keep = int(keep)
        self.parts: dict[int, dict[int, list]] = {}  # version -> {trainer process: [chunk ObjectRef]}
        self.expected: dict[int, int] = {}  # version -> number of trainer processes
        self.versions: dict[int, list] = {}  # complete version -> every chunk's ObjectRef
        self.nbytes: dict[int, int] = {}
        self.published_at: dict[int, float] = {}

    def add(self, version: int, part: int, parts: int, refs: list, nbytes: int) -> bool:
        """Trainer process `part` of `parts` publishes its chunks of `version` (refs wrapped in a list, so Ray
        hands the references over, not the values); True once the version is complete."""
        version, part = int(version), int(part)
        if version in self.versions:
            return True
        got = self.parts.setdefault(version, {})
        self.expected[version] = int(parts)
        if part not in got:
            got[part] = list(refs)
            self.nbytes[version] = self.nbytes.get(version, 0) + int(nbytes)
        if len(got) < self.expected[version]:
            return False
        self.versions[version] = [r for p in sorted(got) for r in got[p]]
        self.published_at[version] = time.time()
        del self.parts[version], self.expected[version]
        for v in sorted(self.versions)[: -self.keep]:
            del self.versions[v], self.nbytes[v], self.published_at[v]
        for v in [v for v in self.parts if v < max(self.versions)]:  # never to be completed
            del self.parts[v], self.expected[v], self.nbytes[v]
        return True

    def complete(self, version: int) -> bool:
        return int(version) in self.versions

    def latest_version(self) -> int:
        return max(self.versions) if self.versions else -1

    def latest(self) -> tuple[int, list]:
        """(version, [chunk ObjectRefs]) of the newest complete weights."""
        if not self.versions:
            return -1, []
        v = max(self.versions)
        return v, list(self.versions[v])

    def info(self) -> dict:
        return {"versions": sorted(self.versions), "bytes": {v: self.nbytes[v] for v in self.versions}}
