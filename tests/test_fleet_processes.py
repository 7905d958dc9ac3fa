"""The Ray fleet against process deaths: rollout workers and the trainer SIGKILLed mid-run (chaos: nothing lost,
nothing trained twice), and a two-node Ray cluster on loopback that grows and shrinks with its nodes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleet_helpers import (_env, _free_port, _ray_pids, _start, _steps_done, _wait_for, ledger, metric_rows,  # noqa: F401
                           toy)


@pytest.mark.slow
def test_chaos_workers_and_trainer_killed_nothing_lost_nothing_twice(toy):
    """SIGKILL rollout workers 3 times and the trainer twice (once mid-checkpoint); rerun as a user would."""
    out = toy.dir / "chaos"
    bound = 1
    args = toy("chaos", "trainer.max_steps=12", "trainer.save_every=2", "fleet.workers=2",
               f"fleet.max_staleness={bound}", "fleet.lease_groups=1", "fleet.max_restarts=-1",
               "fleet.stall_timeout_s=120", f"rewards.functions=[{{name: '{toy.dir / 'reward.py'}:slow_count_a'}}]")
    killed_workers = 0
    proc = _start(args)
    runs = [proc.pid]  # the sessions of the three trainer runs
    # worker kills: one as soon as one is up and idle (before or between leases), two in the middle of a lease
    for at_step, title, exact in ((0, "ray::RolloutWorker", True), (2, "ray::RolloutWorker.rollout", True),
                                  (4, "ray::RolloutWorker.rollout", True)):
        pids = _wait_for(lambda: _steps_done(out) >= at_step and _ray_pids(title, exact, runs), 240,
                         f"{title} at {at_step}", proc)
        os.kill(pids[0], signal.SIGKILL)
        killed_workers += 1
    # trainer kill 1: while a checkpoint is being written (an Orbax temporary folder exists)
    ckpts = out / "checkpoints"
    _wait_for(lambda: ckpts.exists() and any(".orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())
              and _steps_done(out) >= 6, 240, "a checkpoint in progress", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc = _start(args)
    runs.append(proc.pid)
    _wait_for(lambda: _steps_done(out) >= 8 and _ray_pids("ray::RolloutWorker", sessions=[proc.pid]), 240,
              "step 8 after resume", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # trainer kill 2: between checkpoints
    proc.wait()
    proc = _start(args)
    runs.append(proc.pid)
    log = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, log
    rows = ledger(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    uids = [u for r in rows for u in r["uids"]]
    assert len(uids) == len(set(uids)) == 48, "no prompt group trained twice"
    # nothing lost: every group handed out was trained or is still outstanding in the last checkpoint (a step
    # takes the lowest-uid groups that are ready, so a slow group's later neighbours may be trained before it)
    last = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    meta = json.loads((out / "checkpoints" / str(last) / "meta" / "metadata").read_text())  # Orbax's JSON item
    final = meta["data_state"]["dispatcher"]
    outstanding = {*final["queue"], *map(int, final["ready"])}
    assert last == 12 and not outstanding & set(uids), (last, outstanding)
    assert set(uids) | outstanding == set(range(final["next_uid"])), "every prompt group trained or still queued"
    record_of = {u: r for row in rows for u, r in zip(row["uids"], row["records"])}
    for epoch in range(3):  # uids 16e..16e+15 are epoch e: each epoch trains each of the 16 prompts once
        got = [record_of[u] for u in range(16 * epoch, 16 * (epoch + 1)) if u in record_of]
        assert len(set(got)) == len(got) >= 16 - len(outstanding) and set(got) <= set(range(16)), (epoch, got)
    assert max(r["staleness_max"] for r in rows) <= bound
    mins = [r["version_min"] for r in rows]
    assert mins == sorted(mins), "versions never go backwards"
    m = metric_rows(out)
    assert max(r.get("fleet/requeued/worker_died", 0) for r in m.values()) >= 1  # a kill hit a lease in flight
    workers = [json.loads(x) for x in (out / "fleet_workers.jsonl").read_text().splitlines()]
    assert len(workers) >= 2 * 3 + killed_workers - 2  # every (re)start of a worker, over three trainer runs
    _wait_for(lambda: not _ray_pids("ray::RolloutWorker", sessions=runs), 5, "no worker to outlive the run by 5 s")


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (a loopback Ray node started by `_ray_node`: its raylet, agents and
    workers, and the head's GCS)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[3]) == sid and rest[0] != "Z":
            out.append(int(d))
    return out


def _ray_node(args: list[str], env: dict) -> int:
    """`ray start ARGS` in a session of its own, whose id (returned) names that node's processes. The `ray` script
    of this Python's environment (another one on PATH would start a cluster of another Ray version)."""
    here = Path(sys.executable).parent / "ray"
    ray = str(here) if here.exists() else "ray"
    p = subprocess.Popen([ray, "start", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
                          '--resources={"rollout": 1}', *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 0, log
    return p.pid


def _stop_node(sid: int) -> None:
    """What `ray stop` does, for one node of a loopback cluster only (`ray stop` would end every node on the
    machine): SIGTERM to its processes (the raylet leaves the cluster at once), SIGKILL to what remains."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session(sid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if _wait_for(lambda: not _session(sid), 10, "the node's processes to end", ok=True):
            return


@pytest.mark.slow
def test_two_node_cluster_on_loopback_grows_and_shrinks_with_its_nodes(toy):
    """An elastic fleet (fleet.workers=1..2) on a 2-node loopback cluster, each node offering one `rollout`: a
    worker on each node; the second node stopped mid-run (its worker dropped; the run goes on with the other)
    and started again (a new worker there); every group trained once; bfloat16 weights on the wire."""
    port, out, hold = _free_port(), toy.dir / "elastic", toy.dir / "hold"
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = _env(RAY_TMPDIR=ray_tmp)
    nodes, proc = [], None
    joins = out / "fleet_workers.jsonl"
    events = lambda: [json.loads(x) for x in joins.read_text().splitlines()] if joins.exists() else []  # noqa: E731
    try:
        nodes.append(_ray_node(["--head", f"--port={port}", "--include-dashboard=false"], env))
        hold.touch()  # no step ends (its rewards wait) until both nodes serve: under load the run could end first
        proc = _start(toy("elastic", "trainer.max_steps=7", "fleet.workers=1..2", f"fleet.ray_address=127.0.0.1:{port}",
                          "fleet.worker_cpus=0", "fleet.worker_resources={rollout: 1}", "fleet.max_staleness=0",
                          "fleet.lease_groups=1", "fleet.transfer_dtype=bfloat16",
                          f"rewards.functions=[{{name: '{toy.dir / 'reward.py'}:held_count_a'}}]"), RAY_TMPDIR=ray_tmp)
        nodes.append(_ray_node([f"--address=127.0.0.1:{port}"], env))
        ups = _wait_for(lambda: len({e["node"] for e in events() if e["event"] == "up"}) == 2 and events(), 240,
                        "a worker up on each node", proc)
        second = next(e for e in ups if e["event"] == "up" and e["pid"] in _session(nodes[1]))
        # the node stops mid-lease: its worker is scoring a group (held). Not its process title: a heartbeat (its
        # own thread) resets the title to idle while the lease goes on
        _wait_for(lambda: (toy.dir / f"held.{second['pid']}").exists(), 120, "a lease on the second node's worker",
                  proc)
        _stop_node(nodes[1])
        _wait_for(lambda: any(e["event"] == "dropped" and e["name"] == second["name"] for e in events()), 30,
                  "the stopped node's worker to be dropped", proc)
        steps = _steps_done(out)
        hold.unlink()
        _wait_for(lambda: _steps_done(out) > steps, 60, "a step with the node gone", proc)
        hold.touch()
        nodes[1] = _ray_node([f"--address=127.0.0.1:{port}"], env)
        _wait_for(lambda: len({e["node"] for e in events() if e["event"] == "up"}) == 3, 60,
                  "a worker on the node that came back", proc)
        hold.unlink()
        log = proc.communicate(timeout=240)[0]
        assert proc.returncode == 0, log
    finally:
        hold.unlink(missing_ok=True)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for sid in reversed(nodes):
            _stop_node(sid)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    uids = [u for r in ledger(out) for u in r["uids"]]
    assert [r["step"] for r in ledger(out)] == list(range(1, 8)) and sorted(uids) == list(range(4 * 7)), uids
    seen = events()
    assert [e["event"] for e in seen if e["name"] == second["name"]][-1] == "dropped", seen
    assert "its node left" in next(e["reason"] for e in seen if e["event"] == "dropped"), seen
    rows = metric_rows(out).values()
    assert {r["fleet/workers_up"] for r in rows} == {1.0, 2.0} and max(r["fleet/workers_dropped"] for r in rows) == 1
    assert any(r.get("fleet/requeued/worker_died", 0) + r.get("fleet/requeued/worker_dropped", 0) for r in rows)
    assert all(abs(r["fleet/publish_mb"] - 0.427 / 2) < 0.01 for r in rows)  # bfloat16 on the wire: half the bytes
