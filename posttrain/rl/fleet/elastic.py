"""Elastic fleet sizing (`fleet.workers: MIN..MAX`): which live Ray nodes have room for more rollout workers.

The fleet source asks every few seconds (`live_nodes`: one `ray.nodes()` call to Ray's GCS, cheap). A node's
room is counted from the resources it offers (`ray start --num-cpus/--num-gpus/--resources`): floor(total /
need) workers for every resource a worker asks for (`fleet.worker_cpus`, `fleet.worker_gpus`,
`fleet.worker_resources`), the fleet being taken as the only user of them. New workers go to the nodes with
the most room left first, until the fleet holds `fleet.workers`' MAX.

Each elastic worker is pinned to the node it was placed on (a hard `NodeAffinitySchedulingStrategy`). Ray
still restarts a pinned worker that crashed on a live node (`fleet.max_restarts`), but when its node leaves,
Ray cannot place it anywhere else: its calls fail at once (`ActorUnschedulableError`), the source drops it
and re-queues its leases, and a node that joins (or comes back: Ray gives it a new node id) gets fresh
workers from the sizing. Unpinned, Ray would restart a lost node's workers wherever resources show up: on
nodes whose room the sizing has already filled (where they wait, pending, counted as workers that are not
there) or in a loop of restarts, and which node holds how many workers could not be known.
"""

from __future__ import annotations

import collections
import math

__all__ = ["worker_needs", "live_nodes", "node_room", "placements"]

EPS = 1e-9  # resource totals are floats: 0.3 / 0.1 must count as 3


def worker_needs(fc) -> dict[str, float]:
    """The Ray resources one worker asks for (those above zero), by Ray's names (`CPU`, `GPU`, custom ones)."""
    needs = {"CPU": fc.worker_cpus, "GPU": fc.worker_gpus, **fc.worker_resources}
    return {k: float(v) for k, v in needs.items() if v > 0}


def live_nodes(ray) -> dict[str, dict[str, float]]:
    """Node id -> total resources of every live node of the cluster."""
    return {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}


def node_room(resources: dict[str, float], needs: dict[str, float], cap: int) -> int:
    """How many workers a node with these total `resources` holds (`cap` when a worker needs nothing)."""
    return min([cap, *(math.floor(resources.get(k, 0.0) / v + EPS) for k, v in needs.items())])


def placements(nodes: dict[str, dict[str, float]], needs: dict[str, float], held: collections.Counter,
               count: int, excluded=frozenset()) -> list[str]:
    """Node ids for up to `count` new workers (one entry per worker), given the workers each node `held`: the
    node with the most room left first (ties: fewer workers held, then the node id); `excluded` nodes none."""
    free = {n: node_room(res, needs, held[n] + count) - held[n] for n, res in nodes.items() if n not in excluded}
    held = collections.Counter({n: held[n] for n in free})
    out = []
    while len(out) < count:
        best = max(free, key=lambda n: (free[n], -held[n], n), default=None)
        if best is None or free[best] < 1:
            break
        out.append(best)
        free[best] -= 1
        held[best] += 1
    return out
