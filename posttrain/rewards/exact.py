"""`exact_answer`: 1.0 when the completion, stripped of surrounding white space, is exactly the gold answer."""

from __future__ import annotations

from typing import Any

__all__ = ["exact_answer"]


def exact_answer(prompts: list[Any], completions: list[str], answer: list[Any], **fields) -> list[float]:
    """Exact match of the stripped completion with str(answer) (the synthetic visual task's check)."""
    return [1.0 if str(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]
