"""DAPO soft overlong punishment reward (Yu et al. 2025, "DAPO", Eq. 13).

With the maximum generation length ``L_max`` and a punishment cache ``L_cache``::

    R(y) = 0                                   if |y| <= L_max - L_cache
         = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
         = -1                                  if |y| > L_max

``|y|`` is the completion's token count, supplied by the RL loop as the ``completion_lengths``
field (list[int]) because rewards only see text.
"""

from __future__ import annotations

__all__ = ["soft_overlong_punishment", "OverlongPenalty", "overlong_penalty"]


def soft_overlong_punishment(length: int, max_length: int, cache_length: int) -> float:
    """The pure DAPO formula above for one completion of ``length`` tokens."""
    if cache_length <= 0 or cache_length > max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    threshold = max_length - cache_length
    if length <= threshold:
        return 0.0
    if length <= max_length:
        return (threshold - length) / cache_length
    return -1.0


class OverlongPenalty:
    """Reward callable ``(prompts, completions, completion_lengths, **fields) -> list[float]``.

    A top-level class (not a closure) so it pickles into reward worker processes.
    """

    required_fields = ("completion_lengths",)

    def __init__(self, max_length: int, cache_length: int):
        soft_overlong_punishment(0, max_length, cache_length)  # validate arguments early
        self.max_length = int(max_length)
        self.cache_length = int(cache_length)

    def __call__(self, prompts, completions, completion_lengths, **fields) -> list[float]:
        if len(completion_lengths) != len(completions):
            raise ValueError(
                f"overlong_penalty: {len(completion_lengths)} lengths for {len(completions)} completions"
            )
        return [soft_overlong_punishment(int(n), self.max_length, self.cache_length) for n in completion_lengths]

    def __repr__(self) -> str:
        return f"OverlongPenalty(max_length={self.max_length}, cache_length={self.cache_length})"


def overlong_penalty(max_length: int, cache_length: int) -> OverlongPenalty:
    """Factory: the soft overlong punishment reward for ``L_max=max_length``, ``L_cache=cache_length``."""
    return OverlongPenalty(max_length, cache_length)


# Tells the reward runner that keyword arguments configure the factory (not each call).
overlong_penalty.is_reward_factory = True
