"""When the fleet has stalled: no worker delivered anything for `fleet.stall_timeout_s` (`fleet.start_timeout_s`
until the first result: model loads and compiles; a worker coming up counts as progress), or an elastic fleet
served with fewer than its minimum of workers for that long. The source then saves a checkpoint and stops."""

from __future__ import annotations

import time

__all__ = ["StallWatch"]


class StallWatch:
    def __init__(self, fc):
        self.fc = fc
        self.last_result = time.monotonic()
        self.delivered = False  # until the first result, start_timeout_s applies (model load, compiles)
        self.short_since: float | None = None  # since when fewer than the minimum of workers serve

    def progress(self) -> None:
        """A result arrived or a worker came up."""
        self.last_result = time.monotonic()

    def check(self, serving: list[str]) -> str | None:
        """What stalled (the start of the stop message), or None. `serving`: the workers serving now."""
        fc, now = self.fc, time.monotonic()
        limit = fc.stall_timeout_s if self.delivered else max(fc.stall_timeout_s, fc.start_timeout_s)
        key = "stall_timeout_s" if self.delivered else "start_timeout_s"
        short = fc.elastic and len(serving) < fc.min_workers
        self.short_since = (self.short_since or now) if short else None
        if now - self.last_result > limit:
            return f"no rollout worker delivered anything for {limit:g} s (fleet.{key})"
        if short and now - self.short_since > limit:
            return (f"fewer than {fc.min_workers} rollout workers (fleet.workers={fc.workers}) served for {limit:g} s "
                    f"(fleet.{key}); serving: {', '.join(sorted(serving)) or 'none'}")
        return None
