"""Image prompts for the evaluator: a sampler that hands every prompt's images to the vision-language model's
prefill (`Sampler.generate_with_images`), so `evaluate` runs unchanged on image prompts (rewards on the text)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["ImagePromptSampler"]


class ImagePromptSampler:
    """Wraps a `Sampler`: `generate(prompt_ids, ...)` takes the prompts in the order of `images` (prompt p's
    pixel arrays [C, H, W]), as the evaluator passes them (every prompt, once per call)."""

    def __init__(self, sampler, images: Sequence[Sequence[np.ndarray]]):
        self.sampler = sampler
        self.images = [list(x) for x in images]

    def generate(self, prompt_token_ids, params=None, **kwargs) -> list[Any]:
        if len(prompt_token_ids) != len(self.images):
            raise ValueError(f"{len(prompt_token_ids)} prompts for the images of {len(self.images)}: image prompts "
                             "are generated all together, in order")
        return self.sampler.generate_with_images(prompt_token_ids, self.images, params, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)
