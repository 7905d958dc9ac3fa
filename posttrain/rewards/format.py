"""Format reward: 1.0 when a completion matches a configurable regex (default: a
``<think>...</think>`` block followed by an ``<answer>...</answer>`` block), else 0.0."""

from __future__ import annotations

import functools
import re

__all__ = ["DEFAULT_FORMAT_PATTERN", "format_reward", "matches_format"]

DEFAULT_FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str, flags: int) -> re.Pattern:
    return re.compile(pattern, flags)


def matches_format(completion: str, pattern: str = DEFAULT_FORMAT_PATTERN, flags: int = re.DOTALL, strip: bool = True) -> bool:
    """True when ``re.match(pattern, completion, flags)`` succeeds (after ``strip()`` if ``strip``)."""
    if not isinstance(completion, str):
        return False
    text = completion.strip() if strip else completion
    return _compiled(pattern, int(flags)).match(text) is not None


def format_reward(
    prompts: list[str],
    completions: list[str],
    *,
    pattern: str = DEFAULT_FORMAT_PATTERN,
    flags: int = re.DOTALL,
    strip: bool = True,
    **fields,
) -> list[float]:
    """Reward: 1.0 per completion matching ``pattern`` (``re.match`` with ``flags``; the
    pattern should anchor with ``^``/``$`` to require the whole text), else 0.0.

    Configure it per run with ``RewardSpec("format", kwargs={"pattern": r"..."})`` or
    ``functools.partial(format_reward, pattern=...)``.
    """
    return [1.0 if matches_format(c, pattern, flags, strip) else 0.0 for c in completions]
