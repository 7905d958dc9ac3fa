"""Pins of the fleet's accounting and weights (issue 41), without Ray: staleness is a group's FIRST token's version
(a group generated from version 0 to 3 is too stale at step 5 with max_staleness 1, and goes back to the queue);
a dropped worker's in-flight leases are failed to the dispatcher and their prompts leased again; a weight published
in three or more blocks, arriving shuffled, is assembled exactly."""

from __future__ import annotations

import random
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from posttrain.config import load_config
from posttrain.rl.config import RLConfig
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rl.fleet.shards import assemble, to_wire
from posttrain.rollout.rollouts import Rollouts
from posttrain.rl.sources import DynamicSampling, GroupIntake
from posttrain.rollout.prompts import PromptSet


def _group(uid: int, version_first: list[int], version_last: list[int]) -> Rollouts:
    """A one-group `Rollouts` (G = len(version_first)) with the given per-sample versions."""
    g = len(version_first)
    return Rollouts(group_size=g, record_index=[uid] * g, prompt_ids=[[5, 6]] * g, completion_ids=[[7, 8, 9]] * g,
                    logprobs=[[-1.0] * 3] * g, finish_reasons=["stop"] * g, texts=[""] * g, prompts_text=[""] * g,
                    rewards=np.zeros(g, np.float32), per_reward={}, reward_stats={}, uid=[uid] * g,
                    version_first=list(version_first), version_last=list(version_last))


def test_staleness_is_the_first_tokens_version():
    d = Dispatcher(8, shuffle=False, batch_groups=1, max_staleness=1)
    lease = d.lease("w", 3)
    assert lease.uids == [0, 1, 2]
    d.complete(lease.id, [_group(0, [0, 0], [3, 3]),  # generated from version 0 to 3: staleness 4 at step 5
                          _group(1, [3, 2], [3, 3]),  # one sample started at version 2: staleness 2
                          _group(2, [3, 3], [3, 3])])  # staleness 1 = max_staleness: trained
    [taken] = d.take(5)
    assert taken.uid == [2, 2]
    assert sorted(d.queue) == [0, 1] and d.counts["requeued/stale"] == 2 and not d.ready
    assert d.lease("w", 2).uids == [0, 1]  # generated again
    # the bound itself: a group whose first token is exactly max_staleness behind is trained, one more is not
    d = Dispatcher(8, shuffle=False, batch_groups=1, max_staleness=2)
    lease = d.lease("w", 2)
    d.complete(lease.id, [_group(0, [1], [3]), _group(1, [0], [3])])
    assert d.take(4)[0].uid == [0] and d.queue == [1]


# ---------------------------------------------------------------------- a dropped worker's leases
class _RecordingDispatcher(Dispatcher):
    """The real dispatcher, recording every `fail`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed: list[tuple[int, str]] = []

    def fail(self, lease_id: int, reason: str) -> list[int]:
        self.failed.append((lease_id, reason))
        return super().fail(lease_id, reason)


class _FakeRay:
    """Just enough of Ray for `FleetSource`'s membership: live nodes (id -> resources) and kills."""

    def __init__(self, nodes: dict):
        self.alive, self.killed = nodes, []

    def nodes(self):
        return [{"NodeID": n, "Alive": True, "Resources": r} for n, r in self.alive.items()]

    def kill(self, handle, no_restart=True):
        self.killed.append(handle.name)


class _FakeWorkerClass:
    """Workers whose calls are never answered (the leases stay in flight); `calls` records each rollout call."""

    def __init__(self):
        self.calls = []

    def options(self, **options):
        self.node = options["scheduling_strategy"].node_id
        return self

    def remote(self, name, ps, **sections):
        def rollout(lease_id, uids, *items):
            self.calls.append((name, lease_id, list(uids)))
            return object()

        return SimpleNamespace(name=name, node=self.node, ready=SimpleNamespace(remote=object),
                               rollout=SimpleNamespace(remote=rollout))


def test_a_dropped_workers_leases_are_failed_and_their_prompts_come_back(tmp_path):
    from posttrain.rl.fleet.pool import WorkerSpec
    from posttrain.rl.fleet.source import FleetSource

    a, b = "a" * 56, "b" * 56  # node ids
    cfg = load_config(RLConfig, None, ["fleet.workers=1..2", "fleet.worker_cpus=0", "fleet.worker_resources={rollout: 1}",
                                       "fleet.lease_groups=1", "fleet.max_staleness=1", "rollout.batch_prompts=2"])
    d = _RecordingDispatcher(16, shuffle=False, batch_groups=2, max_staleness=1)
    workers = _FakeWorkerClass()
    prompts = PromptSet.of([{"prompt": str(i)} for i in range(16)], [[1]] * 16)
    src = FleetSource(_FakeRay({a: {"rollout": 1.0}, b: {"rollout": 1.0}}),
                      GroupIntake(d, DynamicSampling(False, 0), lambda ro: {}), cfg.fleet,
                      WorkerSpec(workers, {}, {}, None), prompts, events=tmp_path / "fleet_workers.jsonl",
                      save=lambda step: None, batch_prompts=cfg.rollout.batch_prompts)
    pool = src.pool
    on_b = next(n for n, rec in pool.live().items() if rec.node == b)
    for i, rec in enumerate(pool.live().values()):  # every worker serving, in start order
        rec.info, rec.up_seq = {"node": rec.node}, i
    src.version = 0
    src._hand_out(1)  # two leases in flight per worker, one group each
    held = {name: [(lease, uids) for n, lease, uids in workers.calls if n == name] for name in pool.live()}
    assert len(held[on_b]) == 2 and all(len(v) == 2 for v in held.values())
    lost = sorted(u for _, uids in held[on_b] for u in uids)
    kept = sorted(u for n, v in held.items() if n != on_b for _, uids in v for u in uids)
    assert d.failed == []
    del src.ray.alive[b]  # its node leaves: the worker is dropped
    pool.resize()
    assert on_b in pool.dropped() and on_b not in pool.live() and src.ray.killed == [on_b]
    assert sorted(d.failed) == sorted((lease, "worker_dropped") for lease, _ in held[on_b])
    assert sorted(d.queue) == lost and sorted(d.leased) == kept and d.counts["requeued/worker_dropped"] == 2
    assert all(owner != on_b for _, owner in src.book.inflight.values()) and len(src.book.inflight) == 2
    assert d.lease("w", 2).uids == lost  # the prompts come back first


# ---------------------------------------------------------------------- weights from shuffled blocks
def _blocks(path: str, full: np.ndarray, cuts: list[list[int]], wire: bool = False) -> list[tuple]:
    """Chunk entries (path, shape, index, block, dtype) of `full` cut at `cuts` (per axis, the inner bounds)."""
    bounds = [list(zip([0, *c], [*c, s])) for c, s in zip(cuts, full.shape)]
    out = []
    for index in np.array(np.meshgrid(*[np.arange(len(b)) for b in bounds], indexing="ij")).reshape(len(cuts), -1).T:
        idx = tuple(bounds[ax][k] for ax, k in enumerate(index))
        block = np.ascontiguousarray(full[tuple(slice(lo, hi) for lo, hi in idx)])
        out.append((path, full.shape, idx, *(to_wire(block) if wire else (block, ""))))
    return out


def test_assemble_three_or_more_shuffled_blocks_exactly():
    rng = np.random.default_rng(0)
    grid = rng.normal(size=(7, 10)).astype(np.float32)  # 3 x 3 blocks of uneven sizes
    rows = rng.normal(size=(9, 4)).astype(np.float32)  # 3 blocks along the first axis
    cols = rng.normal(size=(2, 12)).astype(np.float32)  # 4 blocks along the last axis
    vec = np.arange(5, dtype=np.int32)
    bf16 = rng.normal(size=(6, 3)).astype(ml_dtypes.bfloat16)  # on the wire as uint16, 3 blocks
    entries = (_blocks("grid", grid, [[2, 5], [3, 4]]) + _blocks("rows", rows, [[3, 6]]) +
               _blocks("cols", cols, [[], [1, 5, 11]]) + _blocks("vec", vec, [[]]) +
               _blocks("bf16", bf16, [[1, 4], []], wire=True))
    assert len(entries) == 9 + 3 + 4 + 1 + 3
    random.Random(3).shuffle(entries)
    chunks = [entries[k::3] for k in range(3)]  # three trainer processes' chunks
    got = assemble(chunks)
    assert sorted(got) == ["bf16", "cols", "grid", "rows", "vec"]
    for name, want in (("grid", grid), ("rows", rows), ("cols", cols), ("vec", vec), ("bf16", bf16)):
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    with pytest.raises(ValueError, match="'grid': the published blocks cover 58 of 70"):
        assemble([[e for e in entries if not (e[0] == "grid" and e[2] == ((5, 7), (4, 10)))]])
