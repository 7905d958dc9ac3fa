"""The fleet's throughput figures for each trainer step: publish seconds and bytes, and from the workers' results
(their timings) pull seconds, leases delivered, weight swaps within leases, busy fraction and samples/s."""

from __future__ import annotations

import collections
import time

__all__ = ["FleetMeter"]


class FleetMeter:
    """Sums over a step's window (reset by `figures`) and the busy seconds since the start."""

    def __init__(self):
        self.window = collections.Counter()  # per-step sums: samples, pull_s, results, swaps, swap_s
        self.t_window = time.monotonic()
        self.publish = (0.0, 0)  # seconds and bytes of the last publish
        self.busy_total, self.t_start = 0.0, time.monotonic()

    def add(self, res: dict) -> None:
        """A worker's result (its rollouts and timings)."""
        w = self.window
        w["samples"] += len(res["rollouts"])
        self.busy_total += res["seconds"]
        w["pull_s"] += res["pull_s"]
        w["results"] += 1
        w["swaps"] += res["swaps"]
        w["swap_s"] += res["swap_s"]

    def figures(self, workers: int) -> dict[str, float]:
        """This window's figures (`workers`: the fleet's size now); starts the next window."""
        w, now = self.window, time.monotonic()
        wall = max(now - self.t_window, 1e-9)
        out = {
            "fleet/publish_s": self.publish[0],
            "fleet/publish_mb": self.publish[1] / 2**20,
            "fleet/pull_s": w["pull_s"] / max(w["results"], 1),
            "fleet/leases": float(w["results"]),  # leases delivered in this step's window
            "fleet/swaps_mid_lease": float(w["swaps"]),  # fleet.swap=segment: weights taken between segments
            "fleet/swap_s": w["swap_s"] / max(w["swaps"], 1),
            # since the start: a result's seconds may predate a step's window (workers run ahead)
            "fleet/busy_fraction": self.busy_total / ((now - self.t_start) * max(workers, 1)),
            "fleet/samples_per_s": w["samples"] / wall,
        }
        self.window, self.t_window = collections.Counter(), now
        return out
