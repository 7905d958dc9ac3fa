"""The Ray fleet end to end on a tiny model: equivalence with the synchronous loop, segment swaps, elastic placement
and faults (bad config, unreachable cluster, dead workers, hanging rewards). Preemption (chaos) and the two-node
cluster are in `test_fleet_processes.py`, a module of their own so that two test workers share the fleet's time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import groupby
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from posttrain.config import ConfigError, from_dict, load_config, to_dict
from posttrain.rl.config import RLConfig
from posttrain.rl.fleet.cluster import FleetError
from posttrain.rl.fleet.elastic import node_room, placements, worker_needs
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rl.sources import DynamicSampling, GroupIntake
from posttrain.rollout.prompts import PromptSet

from fleet_helpers import (_env, _free_port, _ray_pids, _start, _steps_done, _wait_for, ledger, metric_rows,  # noqa: F401
                           toy)


@pytest.mark.slow
def test_one_worker_at_staleness_zero_reproduces_the_synchronous_loop(toy):
    steps = 3
    sync = run_rl(load_rl_config(None, toy("sync", f"trainer.max_steps={steps}")))
    fleet = run_rl(load_rl_config(None, toy("fleet", f"trainer.max_steps={steps}", "fleet.workers=1",
                                            "fleet.max_staleness=0")))
    assert len(sync.history) == len(fleet.history) == steps
    for a, b in zip(sync.history, fleet.history):
        np.testing.assert_allclose(b["reward/mean"], a["reward/mean"], atol=1e-5)
        np.testing.assert_allclose(b["loss"], a["loss"], atol=1e-5)
        np.testing.assert_allclose(b["pg_loss"], a["pg_loss"], atol=1e-5)
        assert b["fleet/staleness_max"] == 0 and b["fleet/publish_mb"] > 0
    assert any(a["reward/mean"] > 0 for a in sync.history)  # the comparison is not of zeros
    untimed = [[{k: v for k, v in r.items() if k != "time"} for r in ledger(toy.dir / d)] for d in ("sync", "fleet")]
    assert untimed[0] == untimed[1]


def test_fleet_config_errors_name_the_key(toy):
    for override, key in (("fleet.workers=0", "fleet.workers"), ("fleet.max_staleness=-1", "fleet.max_staleness"),
                          ("fleet.publish_every=3", "fleet.publish_every"), ("fleet.swap=token", "fleet.swap"),
                          ("fleet.segment_steps=-1", "fleet.segment_steps")):
        with pytest.raises(ConfigError, match=key):
            load_rl_config(None, toy("bad", override))


@pytest.mark.parametrize("value,fixed,bounds", [("4", 4, (4, 4)), ("2..8", "2..8", (2, 8)), ("1 .. 1", "1..1", (1, 1))])
def test_fleet_workers_is_a_count_or_a_range(value, fixed, bounds):
    fc = load_config(RLConfig, None, [f"fleet.workers={value}"]).fleet
    assert (fc.workers, (fc.min_workers, fc.max_workers), fc.elastic) == (fixed, bounds, isinstance(fixed, str))
    assert fc.enabled and load_config(RLConfig, None, []).fleet.enabled is False
    assert from_dict(RLConfig, to_dict(load_config(RLConfig, None, [f"fleet.workers={value}"]))).fleet.workers == fixed


@pytest.mark.parametrize("value", ["0", "3..2", "0..2", "2-8", "two", "2..", "2.5", "true"])
def test_fleet_workers_anything_else_is_a_one_line_error_with_the_forms(value):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, [f"fleet.workers={value}"])
    assert "fleet.workers" in str(e.value) and "MIN..MAX" in str(e.value) and "\n" not in str(e.value)


def test_elastic_placements_fill_the_nodes_with_most_room_up_to_the_count():
    overrides = ["fleet.workers=1..8", "fleet.worker_cpus=2", "fleet.worker_resources={rollout: 1}"]
    fc = load_config(RLConfig, None, overrides).fleet
    needs = worker_needs(fc)
    assert needs == {"CPU": 2.0, "rollout": 1.0}
    nodes = {"head": {"CPU": 8.0}, "a": {"CPU": 8.0, "rollout": 4.0}, "b": {"CPU": 3.0, "rollout": 2.0},
             "c": {"CPU": 0.6, "rollout": 1.0}}
    assert node_room(nodes["a"], needs, 99) == 4 and node_room(nodes["b"], needs, 99) == 1
    assert node_room({"CPU": 0.3}, {"CPU": 0.1}, 99) == 3 and node_room({}, {}, 5) == 5
    assert sorted(placements(nodes, needs, Counter(), 8)) == ["a"] * 4 + ["b"]
    assert placements(nodes, needs, Counter(a=3), 2) == ["b", "a"]  # ties: the node with fewer workers first
    assert placements(nodes, needs, Counter(a=4, b=1), 3) == []  # full
    assert placements(nodes, needs, Counter(), 3, excluded={"a"}) == ["b"]
    assert sorted(placements({"x": {}, "y": {}}, {}, Counter(), 4)) == ["x", "x", "y", "y"]  # no needs: spread


class _FakeRay:
    """Just enough of Ray for `FleetSource`'s membership: live nodes (id -> resources), actors, kills."""

    class exceptions:  # noqa: N801 - Ray's name
        RayError = RuntimeError

    def __init__(self, nodes: dict):
        self.alive, self.killed = nodes, []

    def nodes(self):
        return [{"NodeID": n, "Alive": True, "Resources": r} for n, r in self.alive.items()]

    def kill(self, handle, no_restart=True):
        self.killed.append(handle.name)


class _FakeWorkerClass:
    def options(self, **options):
        self.node = options["scheduling_strategy"].node_id
        return self

    def remote(self, name, ps, **sections):
        return SimpleNamespace(name=name, node=self.node, ready=SimpleNamespace(remote=lambda: object()))


def _elastic_source(tmp_path, nodes: dict, *overrides):
    """A `FleetSource` over a fake Ray (no cluster): its sizing, drop rule and stop, as the source runs them."""
    from posttrain.rl.fleet.pool import WorkerSpec
    from posttrain.rl.fleet.source import FleetSource

    cfg = load_config(RLConfig, None, ["fleet.worker_cpus=0", "fleet.worker_resources={rollout: 1}", *overrides])
    saved = []
    intake = GroupIntake(SimpleNamespace(fail=lambda lease, why: None), DynamicSampling(False, 0), lambda ro: {})
    src = FleetSource(_FakeRay(nodes), intake, cfg.fleet, WorkerSpec(_FakeWorkerClass(), {}, {}, None), PromptSet(()),
                      events=tmp_path / "fleet_workers.jsonl", save=saved.append,
                      batch_prompts=cfg.rollout.batch_prompts)
    return src, saved


def _serve_all(pool) -> None:
    """Every worker in the pool serving (as if its probe had answered), in start order."""
    for i, rec in enumerate(pool.live().values()):
        rec.info, rec.up_seq = {"node": rec.node}, i


def test_elastic_fleet_grows_with_nodes_drops_failing_workers_and_stops_below_its_minimum(tmp_path):
    """The elastic source's bookkeeping over a fake Ray; the loopback test below runs it on a real cluster."""
    a, b, c = ("a" * 56, "b" * 56, "c" * 56)  # node ids
    src, saved = _elastic_source(tmp_path, {a: {"rollout": 1.0}, b: {"rollout": 2.0}}, "fleet.workers=2..4",
                                 "fleet.max_restarts=1", "fleet.stall_timeout_s=5")
    pool = src.pool

    def nodes_held():
        return sorted(rec.node for rec in pool.live().values())

    assert nodes_held() == [a, b, b] and pool.target == 3
    src.ray.alive[c] = {"rollout": 5.0}  # a node joins: MAX caps the fleet
    pool.resize()
    assert nodes_held() == [a, b, b, c] and pool.target == 4
    _serve_all(pool)
    del src.ray.alive[b]  # a node leaves: its workers are dropped, and the room left fills the fleet up to MAX
    pool.resize()
    assert nodes_held() == [a, c, c, c] and len(pool.dropped()) == len(src.ray.killed) == 2
    worker_a = next(n for n, rec in pool.live().items() if rec.node == a)
    pool.down(worker_a, "died")  # 1 failure: max_restarts=1 allows it
    assert worker_a in pool.live()
    pool.failed(worker_a, "not answering")  # 2 > 1: dropped, and no new worker on its node
    pool.resize()
    assert worker_a not in pool.live() and a in pool.bad_nodes and a not in nodes_held()
    for rec in pool.records.values():
        rec.info = None
    src.stall.delivered = True
    src._check_stall(7)  # below the minimum since now: not for stall_timeout_s yet
    src.stall.short_since -= 10
    with pytest.raises(FleetError, match=r"fewer than 2 rollout workers \(fleet.workers=2..4\) served for 5 s") as e:
        src._check_stall(7)
    assert f"{worker_a}: dropped (2 failures, more than fleet.max_restarts=1" in str(e.value) and saved == [6]
    kinds = [json.loads(x)["event"] for x in (tmp_path / "fleet_workers.jsonl").read_text().splitlines()]
    assert kinds == ["dropped", "dropped", "down", "dropped"], kinds


@pytest.mark.slow
def test_segment_swaps_give_tokens_newer_weights_within_the_bound_and_train_every_group_once(toy):
    """fleet.swap=segment (partial rollouts): one worker whose generation (128 tokens, no stop, one decode step
    per segment) outlasts a trainer step once both are compiled, so publishes land mid-lease and the worker
    takes them between segments (the first steps' groups were generated during the trainer's compiles)."""
    bound, steps = 1, 6
    res = run_rl(load_rl_config(None, toy("segment", f"trainer.max_steps={steps}", "fleet.workers=1",
                                           f"fleet.max_staleness={bound}", "fleet.swap=segment",
                                           "fleet.segment_steps=1", "rollout.max_new_tokens=128",
                                           "rollout.stop_token_ids=[]")))
    assert res.steps == steps
    rows = ledger(toy.dir / "segment")
    uids = [u for r in rows for u in r["uids"]]
    assert len(uids) == len(set(uids)) == 4 * steps, "every group trained once"
    assert max(r["staleness_max"] for r in rows) <= bound  # on version_first
    m = metric_rows(toy.dir / "segment")
    assert sum(r["fleet/swaps_mid_lease"] for r in m.values()) >= 1
    spans = [r for r in rows if r["version_max"] > r["version_min"]]
    assert spans and any(m[r["step"]]["fleet/version_span_mean"] > 0 for r in spans)  # version_first < version_last
    # a sample's later tokens lag less than its first one; never more than the bound
    assert all(r["fleet/token_staleness_mean"] <= r["fleet/staleness_mean"] for r in m.values())
    assert any(r["fleet/token_staleness_mean"] < r["fleet/staleness_mean"] for r in m.values())
    assert any(0 < r["fleet/fresh_token_fraction"] < 1 for r in m.values())  # a lease that took newer weights
    assert sum(r["fleet/leases"] for r in m.values()) >= steps  # one worker, one lease of 4 groups per step at most


@pytest.mark.slow
def test_unreachable_cluster_is_a_clear_error_within_30s(toy):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "rl", *toy(
        "unreachable", "fleet.workers=1", f"fleet.ray_address=127.0.0.1:{_free_port()}", "fleet.connect_timeout_s=5")],
        env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30 + 20  # the run's own set-up comes on top
    assert "fleet.ray_address=127.0.0.1" in proc.stderr and "ray start --head" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_all_workers_dead_stops_with_a_checkpoint_and_names_them(toy):
    """An elastic fleet of one (fleet.workers=1..1, the fixed count's stop is the same): the killed worker is
    dropped (fleet.max_restarts=0), none replaces it on its node, and below the minimum the run stops."""
    out = toy.dir / "dead"
    proc = _start(toy("dead", "trainer.max_steps=50", "fleet.workers=1..1", "fleet.max_restarts=0",
                      "fleet.stall_timeout_s=20"))
    _wait_for(lambda: _steps_done(out) >= 2, 240, "two steps", proc)
    for pid in _ray_pids("ray::RolloutWorker", sessions=[proc.pid]):
        os.kill(pid, signal.SIGKILL)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and "Traceback" not in log, log
    assert "workers down: worker-0: dropped (1 failure, more than fleet.max_restarts=0" in log, log
    assert any(p.name.isdigit() for p in (out / "checkpoints").iterdir())
    events = [json.loads(x)["event"] for x in (out / "fleet_workers.jsonl").read_text().splitlines()]
    assert events == ["up", "down", "dropped"], events


@pytest.mark.slow
def test_a_hanging_reward_in_a_worker_is_timed_out_and_counted(toy):
    out = toy.dir / "hang"
    res = run_rl(load_rl_config(None, toy(
        "hang", "trainer.max_steps=2", "fleet.workers=1", "rewards.timeout_s=1", "rewards.num_workers=1",
        "lora.enabled=true", "rewards.max_failed_steps=0", f"rewards.functions=[{{name: '{toy.dir / 'reward.py'}:hangs'}}]")))
    assert res.steps == 2
    rows = metric_rows(out).values()
    assert sum(r.get("reward/hangs/timeouts", 0) for r in rows) > 0
    # with LoRA only the adapters travel: 0.074 MB here against 0.43 MB for every weight of the tiny model
    assert all(0 < r["fleet/publish_mb"] < 0.1 for r in rows)


SLOW_GUESS = '''
import os
import time
from itertools import groupby
from pathlib import Path

from posttrain.agent.envs.guess_number import GuessNumber


def _rollout_worker() -> int:
    """The rollout worker this trajectory belongs to: its environment runs in a worker process of its own, started
    by the rollout worker's fork server (so the rollout worker is the parent of this process's parent)."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


class SlowGuess(GuessNumber):
    """GuessNumber whose turns take a while, each leaving a mark named by the rollout worker it runs for and the
    time, so a test can kill a worker between two turns of a trajectory."""

    def step(self, text):
        marks = Path(__file__).parent / "turns"
        marks.mkdir(exist_ok=True)
        (marks / f"{_rollout_worker()}-{time.time_ns()}").touch()
        time.sleep(0.25)
        return super().step(text)
'''


def _mid_trajectory_worker(marks: Path, sessions) -> int | None:
    """A rollout worker of the run that is inside an environment turn right now (its mark under 0.1 s old)."""
    busy = set(_ray_pids("ray::RolloutWorker.rollout", True, sessions))
    now = time.time_ns()
    for m in sorted(marks.iterdir(), key=lambda p: -int(p.name.split("-")[1])) if marks.exists() else []:
        pid, t = map(int, m.name.split("-"))
        if now - t < 100_000_000 and pid in busy:
            return pid
    return None


@pytest.mark.slow
def test_multi_turn_fleet_worker_killed_mid_trajectory(toy):
    """Multi-turn rollouts on the fleet (the guess-the-number game, run by each worker's own agent): a worker
    SIGKILLed between two turns of a trajectory has its groups re-queued, every group is trained exactly
    once, and the trajectories' loss masks are 1 exactly on sampled tokens (the appended tokens decode to the
    environment's observations); agent metrics are logged."""
    from posttrain.models.tiny import resolve_model_path
    from posttrain.models.tokenizer import load as load_tokenizer

    (toy.dir / "slow_guess.py").write_text(SLOW_GUESS)
    with open(toy.dir / "guess.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": "guess", "secret": 10 + i, "max_guesses": 4}) + "\n")
    out, steps = toy.dir / "agent", 3
    proc = _start(toy("agent", f"trainer.max_steps={steps}", f"data.train={toy.dir / 'guess.jsonl'}",
                      "rollout.batch_prompts=2", "rollout.group_size=2",
                      f"rollout.stop_token_ids=[{', '.join(str(i) for i in range(2, 60))}]",
                      f"rollout.environment={toy.dir / 'slow_guess.py'}:SlowGuess", "rollout.max_turns=4",
                      "rollout.max_total_tokens=160", "rewards.functions=[]", "rewards.correctness=environment",
                      "eval.log_samples=4", "fleet.workers=1", "fleet.max_staleness=1", "fleet.lease_groups=1",
                      "fleet.max_restarts=-1", "fleet.stall_timeout_s=120"))
    pid = _wait_for(lambda: _mid_trajectory_worker(toy.dir / "turns", [proc.pid]), 240, "a worker mid-trajectory",
                    proc)
    os.kill(pid, signal.SIGKILL)
    log = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, log
    rows = ledger(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    uids = [u for r in rows for u in r["uids"]]
    assert len(uids) == len(set(uids)) == 2 * steps, "no prompt group trained twice"
    m = metric_rows(out)
    assert max(r.get("fleet/requeued/worker_died", 0) for r in m.values()) >= 1  # the kill hit a lease in flight
    assert all(k in m[steps] for k in ("agent/turns_mean", "agent/truncated_frac", "reward/environment"))
    tok = load_tokenizer(resolve_model_path("tiny:llama"))
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 4 * steps and sum(t["turns"] > 1 for t in trajs) >= 2, [t["turns"] for t in trajs]
    for t in trajs:
        mask, ids = t["loss_mask"], t["token_ids"]
        assert len(mask) == len(ids) == len(t["logprobs"]) and mask[0] == 1 and set(mask) <= {0, 1}
        observations = [x["content"] for x in t["messages"][1:] if x["role"] == "user"]
        appended = [[i for i, k in g] for k, g in groupby(zip(ids, mask), key=lambda x: x[1]) if k == 0]
        assert len(appended) == len(observations) == t["turns"] - 1
        for a, o in zip(appended, observations):
            assert tok.decode(a, skip_special_tokens=False).removeprefix("<eos>") == f"<|user|>{o}<eos><|assistant|>"
    _wait_for(lambda: not _ray_pids("ray::RolloutWorker", sessions=[proc.pid]), 5, "no worker to outlive the run")
