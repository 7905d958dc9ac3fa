"""Image tokens in the text sequence: where the image embeddings go and which tokens see each other.

A Gemma 3 prompt holds, per image, `boi`, `mm_tokens_per_image` placeholders (`image_token_id`) and `eoi`
(the processor's expansion of `<start_of_image>`). Images are matched to placeholder runs in order: row by
row, left to right, as transformers' `masked_scatter` does; the i-th placeholder of the batch (flattened
row-major) takes row i of the image embeddings [N * mm_tokens_per_image, D]. Extra images beyond the
placeholders (padding images that keep shapes static) are computed and ignored.

Attention: a run of consecutive placeholders (one image) attends bidirectionally within itself; everything else
stays causal, with padding and sliding windows applied as for text (transformers' `token_type_ids` blocks:
sliding = AND(window, OR(causal, same image)), full = OR(causal, same image)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.models.vision_config import VisionConfig


def image_blocks(input_ids: jax.Array, vc: VisionConfig) -> jax.Array:
    """int32 [B, T]: the index (within its row) of the image a placeholder token belongs to; -1 for other tokens."""
    is_image = input_ids == vc.image_token_id
    prev = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = (is_image & ~prev).astype(jnp.int32)
    return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1)


def same_image(q_blocks: jax.Array, k_blocks: jax.Array) -> jax.Array:
    """bool [B, Tq, Tk]: query and key are placeholders of the same image."""
    return (q_blocks[:, :, None] == k_blocks[:, None, :]) & (q_blocks[:, :, None] >= 0)


def merge_image_embeddings(x: jax.Array, input_ids: jax.Array, image_embeds: jax.Array,
                           vc: VisionConfig) -> jax.Array:
    """x [B, T, D] with the placeholders' rows replaced by image_embeds [N, mm_tokens_per_image, D], in order."""
    b, t, d = x.shape
    is_image = (input_ids == vc.image_token_id).reshape(-1)
    feats = image_embeds.reshape(-1, image_embeds.shape[-1]).astype(x.dtype)
    idx = jnp.clip(jnp.cumsum(is_image.astype(jnp.int32)) - 1, 0, feats.shape[0] - 1)
    merged = jnp.where(is_image[:, None], jnp.take(feats, idx, axis=0), x.reshape(-1, d))
    return merged.reshape(b, t, d)


def cache_blocks(blocks: jax.Array, positions: jax.Array, max_len: int) -> jax.Array:
    """int32 [B, max_len]: the image index of the call's placeholders at the cache positions they are written
    to, -1 elsewhere (the keys a prefill's image tokens may also see ahead of them)."""
    b = jnp.arange(blocks.shape[0])[:, None]
    pos = jnp.clip(positions, 0, max_len - 1)
    return jnp.full((blocks.shape[0], max_len), -1, jnp.int32).at[b, pos].set(blocks)


def count_placeholders(input_ids, vc: VisionConfig) -> int:
    """Number of images the placeholders of `input_ids` (host array) stand for; a run whose length is not
    `mm_tokens_per_image` is an error (a truncated image)."""
    import numpy as np

    is_image = np.asarray(input_ids) == vc.image_token_id  # `image_blocks` on the host: no device programs
    starts = is_image & ~np.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    blocks = np.where(is_image, np.cumsum(starts, axis=1) - 1, -1)
    n = 0
    for row in blocks:
        for k in range(int(row.max()) + 1 if row.size else 0):
            size = int((row == k).sum())
            if size != vc.mm_tokens_per_image:
                raise ValueError(f"an image has {size} placeholder tokens; the model expects "
                                 f"{vc.mm_tokens_per_image} (was the sequence truncated inside an image?)")
            n += 1
    return n
