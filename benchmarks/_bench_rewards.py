"""The reward of `benchmarks/bench_grpo.py`, shared by both sides (ours loads it as `this_file.py:reward`).

Cheap and deterministic: the fraction of a completion's words `w<i>` whose index i is a multiple of 7.
Anything else in the text (special tokens, empty completions) counts as a non-matching word.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"^w(\d+)$")


def _score(text: str) -> float:
    words = text.split()
    if not words:
        return 0.0
    hits = 0
    for w in words:
        m = _WORD.match(w)
        if m and int(m.group(1)) % 7 == 0:
            hits += 1
    return hits / len(words)


def reward(prompts, completions, **fields) -> list[float]:
    return [_score(c if isinstance(c, str) else str(c)) for c in completions]
