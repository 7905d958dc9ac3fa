"""posttrain.sampling: batched generation with a slot-indexed KV cache and continuous batching."""

from posttrain.sampling.engine import ProgramCache, Sampler
from posttrain.sampling.params import Completion, SamplingParams, TurnEnd

__all__ = ["Completion", "ProgramCache", "Sampler", "SamplingParams", "TurnEnd"]
