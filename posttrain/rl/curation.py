"""Curation (RLAX): each record's pass rates over its last k trained groups (`curation.window` k > 0), and which
records they curate: solved always (or never) in all of its last k attempts. The dispatcher drops a fresh uid
of a curated record with that reason instead of leasing it; when a whole pass of the stream finds every record
curated, it leases them anyway (`exhausted`, said once in one line) until a trained group takes a record out
of curation. Plain Python, like the dispatcher whose checkpoint holds the histories."""

from __future__ import annotations

from typing import Callable

__all__ = ["Curation"]


class Curation:
    """Records' pass-rate histories and the curation rule (module docstring); `window` 0: off."""

    def __init__(self, window: int, skip_always_solved: bool, skip_never_solved: bool, say: Callable[[str], None]):
        self.window = int(window)
        self.skip_always_solved, self.skip_never_solved = skip_always_solved, skip_never_solved
        self.say = say
        self.history: dict[int, list[float]] = {}  # record -> pass rates of its last k trained groups
        self.exhausted = False  # every record is curated: lease them anyway

    def reason(self, record: int) -> str | None:
        """Why `record` is curated (the dropped group's reason), or None."""
        h = self.history.get(record)
        if not self.window or h is None or len(h) < self.window:
            return None
        if self.skip_always_solved and min(h) >= 1.0:
            return "curated_always_solved"
        if self.skip_never_solved and max(h) <= 0.0:
            return "curated_never_solved"
        return None

    def add(self, record: int, rate: float) -> None:
        """A trained group's pass rate; a record out of curation ends an exhausted spell."""
        if not self.window:
            return
        h = self.history.setdefault(record, [])
        h.append(float(rate))
        del h[: -self.window]
        if self.reason(record) is None:
            self.exhausted = False  # a record to train again: curation skips the others

    def check_exhausted(self, num_records: int, counts) -> None:
        """After a pass of skips: when every record is curated, lease them anyway (counted, said once)."""
        if any(self.reason(r) is None for r in range(num_records)):
            return
        self.exhausted = True
        first = not counts["curation/exhausted_passes"]
        counts["curation/exhausted_passes"] += 1
        if first:
            self.say(f"curation: all {num_records} training records are curated (solved in all or none of their "
                     f"last {self.window} trained groups); sampling them again, counted in "
                     "curation/exhausted_passes. Use more prompts, a longer curation.window, or curation.window=0")
