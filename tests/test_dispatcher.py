"""The dispatcher alone: leases, expiry, duplicates, staleness at admission and consumption, curation, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from posttrain.rl.dispatcher import Dispatcher
from posttrain.rollout.rollouts import Rollouts


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def result(uid: int, record: int, version: int, rewards=(1.0, 0.0)) -> Rollouts:
    g = len(rewards)
    return Rollouts(group_size=g, record_index=[record] * g, prompt_ids=[[1, 2]] * g, completion_ids=[[3]] * g,
                    logprobs=[[-0.5]] * g, finish_reasons=["stop"] * g, texts=["a"] * g, prompts_text=["p"] * g,
                    rewards=np.asarray(rewards, np.float32), per_reward={"r": np.asarray(rewards, np.float32)},
                    reward_stats={"reward/r/failures": 0.0}, uid=[uid] * g, version_first=[version] * g,
                    version_last=[version] * g)


def complete(d: Dispatcher, lease, version: int):
    return d.complete(lease.id, [result(u, r, version) for u, r in zip(lease.uids, lease.records)])


def test_exactly_once_through_expiry_duplicates_and_failures():
    clock = Clock()
    d = Dispatcher(6, seed=1, batch_groups=2, max_staleness=1, lease_timeout_s=10.0, clock=clock)
    a = d.lease("w1", 2)
    b = d.lease("w2", 2)
    assert a.uids == [0, 1] and b.uids == [2, 3] and a.records == [d.stream.record(0), d.stream.record(1)]
    clock.t = 11.0
    expired = d.expire()  # both leases are past their deadline
    assert [x.id for x in expired] == [a.id, b.id] and sorted(d.queue) == [0, 1, 2, 3]
    assert complete(d, a, 0) == 0 and d.counts["duplicates"] == 2  # a late result of an expired lease
    c = d.lease("w1", 3)
    assert c.uids == [0, 1, 2]  # re-queued groups first, lowest uid first
    assert complete(d, c, 0) == 3
    assert complete(d, c, 0) == 0  # the same result again (a retried task): ignored
    e = d.lease("w2", 2)
    assert e.uids == [3, 4]
    d.fail(e.id, "worker_died")
    f = d.lease("w1", 2)
    assert f.uids == [3, 4]
    d.complete(f.id, [result(3, f.records[0], 0)])  # uid 4's result is missing: back to the queue
    assert d.queue == [4] and d.counts["requeued/missing"] == 1
    trained = []
    for step in (1, 2):
        got = d.take(step)
        assert [g.uid[0] for g in got] == [0 + 2 * (step - 1), 1 + 2 * (step - 1)]
        trained += d.commit()
    assert trained == [0, 1, 2, 3] and d.take(3) is None
    assert d.counts["trained"] == 4 and d.outstanding == 0


def test_admission_bounds_staleness_and_zero_is_synchronous():
    d = Dispatcher(100, batch_groups=4, max_staleness=0)
    assert d.admissible(trainer_version=0, published_version=0) == 4
    lease = d.lease("w", 4)
    assert d.admissible(0, 0) == 0  # one batch in flight, nothing more until it is trained and published
    complete(d, lease, 0)
    d.take(1)
    d.commit()
    assert d.admissible(1, 0) == 0  # trained but not yet published: still nothing
    assert d.admissible(1, 1) == 4
    d2 = Dispatcher(100, batch_groups=4, max_staleness=2)
    assert d2.admissible(0, 0) == 12
    assert d2.admissible(3, 2) == 8  # the published weights lag one version: one batch less of room


def test_stale_results_are_requeued_at_consumption():
    d = Dispatcher(10, shuffle=False, batch_groups=2, max_staleness=1)
    lease = d.lease("w", 3)
    d.complete(lease.id, [result(0, 0, 0), result(1, 1, 3), result(2, 2, 3)])
    got = d.take(step=5)  # trainer version 4: uid 0 (version 0) is 4 versions old, over the bound of 1
    assert [g.uid[0] for g in got] == [1, 2] and d.queue == [0] and d.counts["requeued/stale"] == 1


def test_no_signal_drop_and_curation():
    d = Dispatcher(3, shuffle=False, batch_groups=1, curation_window=2)
    for step in range(1, 7):  # record 0 always solved, record 1 never, record 2 mixed
        lease = d.lease("w", 1)
        d.complete(lease.id, [result(lease.uids[0], lease.records[0], step - 1)])
        d.take(step)
        rate = {0: 1.0, 1: 0.0, 2: 0.5}[lease.records[0]]
        d.commit({lease.uids[0]: rate})
    leases = [d.lease("w", 1) for _ in range(2)]
    assert [x.records[0] for x in leases] == [2, 2]  # records 0 and 1 are skipped from now on
    assert d.counts["dropped/curated_always_solved"] == 2 and d.counts["dropped/curated_never_solved"] == 2
    d.complete(leases[0].id, [result(leases[0].uids[0], 2, 6)])
    d.drop(leases[0].uids[0], "no_signal")
    assert d.counts["dropped/no_signal"] == 1 and not d.ready


def test_state_round_trips_through_json_and_voids_leases():
    d = Dispatcher(8, seed=3, batch_groups=2, max_staleness=2)
    a, b = d.lease("w1", 2), d.lease("w2", 2)
    complete(d, a, 1)
    state = json.loads(json.dumps(d.state_dict()))
    r = Dispatcher(8, seed=3, batch_groups=2, max_staleness=2)
    r.load_state_dict(state)
    assert r.next_uid == 4 and r.queue == b.uids and sorted(r.ready) == a.uids and not r.leases
    np.testing.assert_array_equal(r.ready[a.uids[0]].rewards, d.ready[a.uids[0]].rewards)
    assert r.ready[a.uids[1]].version_first == [1, 1] and r.ready[a.uids[0]].to_json() == d.ready[a.uids[0]].to_json()
    assert r.complete(b.id, [result(u, 0, 1) for u in b.uids]) == 0  # the old lease died with the old process
    assert r.lease("w", 3).uids == b.uids + [4]


def test_rollouts_groups_and_concat_keep_reward_counts():
    parts = [result(0, 0, 0), result(1, 1, 0)]
    parts[0].reward_stats["reward/r/failures"] = 2.0
    parts[1].reward_stats = {"reward/r/failures": 3.0}
    both = Rollouts.concat(parts)
    assert both.reward_stats["reward/r/failures"] == 5.0 and both.uid == [0, 0, 1, 1]
    split = both.groups()
    assert [g.uid for g in split] == [[0, 0], [1, 1]]
    assert Rollouts.concat(split).reward_stats["reward/r/failures"] == 5.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_staleness"):
        Dispatcher(4, batch_groups=1, max_staleness=-1)
    with pytest.raises(ValueError, match="empty"):
        Dispatcher(0, batch_groups=1)
