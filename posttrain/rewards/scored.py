"""What a reward may return besides a plain list of numbers: `Scored`, the values with counts of its own (logged
as `reward/<name>/<count>`, summed over chunks and groups) and one line about the completions it could not score.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Scored"]


@dataclasses.dataclass
class Scored:
    """A reward call's answer: `values` (one per completion; None: this completion could not be scored, it gets
    `rewards.failure_value` and counts in `reward/<name>/failures`), `counts` (name -> int, logged as
    `reward/<name>/<count name>`; names ending in `failures`, `timeouts` or `skipped` are summed when groups are
    merged), and `error`: one line about the failed completions (None: none failed)."""

    values: list[float | None]
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    error: str | None = None
