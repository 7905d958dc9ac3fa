"""Gemma 3's multimodal projector: SigLIP patch features -> `mm_tokens_per_image` embeddings of the text width.

`Gemma3Projector(features [N, num_patches, vision_hidden])` -> [N, mm_tokens_per_image, text_hidden]:
average pooling of the patch grid (patches_per_side / tokens_per_side patches per side, no overlap), a
"soft embedding" RMSNorm with Gemma's (1 + w) weight and the vision tower's `layer_norm_eps`, then a linear
projection (no bias; HF's `mm_input_projection_weight` is stored [vision_hidden, text_hidden], as our kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.models.layers import Linear, RMSNorm, dtype_of


class Gemma3Projector(nnx.Module):
    """avg-pool to tokens_per_side^2 tokens, RMSNorm(1 + w), linear to the text hidden size."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        vc = cfg.vision
        self.vc = vc
        self.cfg = cfg
        norm_cfg = cfg.replace(rms_norm_eps=vc.layer_norm_eps, norm_offset=True)
        self.mm_soft_emb_norm = RMSNorm(vc.hidden_size, cfg=norm_cfg)
        self.mm_input_projection = Linear((vc.hidden_size,), (cfg.hidden_size,), ("embed",), ("embed",),
                                          bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, features: jax.Array) -> jax.Array:
        vc = self.vc
        n, _, d = features.shape
        s, t = vc.patches_per_side, vc.tokens_per_side
        k = s // t
        grid = features.reshape(n, t, k, t, k, d).astype(jnp.float32)
        pooled = jnp.mean(grid, axis=(2, 4)).reshape(n, t * t, d).astype(features.dtype)
        x = self.mm_soft_emb_norm(pooled)
        return self.mm_input_projection(x).astype(dtype_of(self.cfg.compute_dtype))
