"""Packed image batches (`posttrain.rl.packing` on a vision-language `RLBatch`): a packed row's images are its
sequences' own images in row order (a shared prompt's once), prompts share a row only with equal tokens and equal
images, and the packed log-probs of the tiny Gemma 3 VLM equal the padded batch's (1e-5), for sequence rows and
shared-prompt rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from posttrain.models.tiny_vlm import BOI, EOI, IMAGE, VLM_SPECIAL_TOKENS, tiny_vlm_config
from posttrain.rl.batch import build_rl_batch
from posttrain.rl.loss import packed_logprobs, padded_logprobs
from posttrain.rl.packing import pack_rl_batch, pack_shared_prompts, prompt_groups
from posttrain.rollout.rollouts import Rollouts

pytestmark = pytest.mark.full_optimization  # numbers against a reference (the padded batch)

IMG, BOI_ID, EOI_ID = (VLM_SPECIAL_TOKENS.index(t) for t in (IMAGE, BOI, EOI))
CFG = tiny_vlm_config(128, image_size=16, mm_tokens_per_image=4)
N_IMG = CFG.vision.mm_tokens_per_image


def _image():
    return [BOI_ID] + [IMG] * N_IMG + [EOI_ID]


def _batch(seed=0):
    """Four prompts, two samples each: A (one image), B (two images, one at the start), C (A's tokens, another
    image), D (text); completions of varied lengths."""
    rng = np.random.default_rng(seed)
    text = lambda n: rng.integers(9, 100, size=n).tolist()
    pix = lambda: rng.uniform(-1, 1, size=(3, 16, 16)).astype(np.float32)
    a = [2] + text(3) + _image() + text(2)
    prompts = [a, [2] + _image() + text(1) + _image() + text(2), list(a), [2] + text(5)]
    images = [[pix()], [pix(), pix()], [pix()], []]
    rows = [k for k in range(4) for _ in range(2)]
    comps = [text(n) for n in (3, 5, 2, 6, 4, 1, 5, 3)]
    ro = Rollouts(group_size=2, record_index=rows, prompt_ids=[prompts[k] for k in rows], completion_ids=comps,
                  logprobs=[[-1.0] * len(c) for c in comps], finish_reasons=["stop"] * 8, texts=[""] * 8,
                  prompts_text=[""] * 8, rewards=np.zeros(8, np.float32), per_reward={}, reward_stats={})
    return build_rl_batch(ro, np.zeros(8, np.float32), multiple=8, images=[images[k] for k in rows]), images


@pytest.fixture(scope="module")
def model():
    from posttrain.models.transformer import init_model

    return init_model(CFG, seed=0)


def test_rows_hold_their_sequences_images_in_order_and_a_shared_prompt_once():
    batch, images = _batch()
    assert batch.image_counts.tolist() == [1, 1, 2, 2, 1, 1, 0, 0]
    # A and C have the same tokens but different images: different prompts
    assert prompt_groups(batch) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    packed, layout = pack_rl_batch(batch)
    own = {i: images[k] for i, k in enumerate([0, 0, 1, 1, 2, 2, 3, 3])}
    for r in range(len(packed)):
        members = sorted(np.flatnonzero(layout.row == r), key=lambda i: layout.slot[i])
        want = [x for i in members for x in own[i]]
        got = packed.pixel_values[r]
        np.testing.assert_array_equal(got[: len(want)], np.asarray(want).reshape(-1, *got.shape[1:]))
        assert not got[len(want):].any()  # blanks after them
        assert (packed.input_ids[r] == IMG).sum() == N_IMG * len(want)  # one image per placeholder run
    assert layout.sizes == (layout.row_len, layout.slots, layout.proj, packed.pixel_values.shape[1])
    shared, _ = pack_shared_prompts(batch, 2)
    for r, k in enumerate(range(4)):  # one row a group here: its prompt's images, once
        n = len(images[k])
        np.testing.assert_array_equal(shared.pixel_values[r, :n], np.asarray(images[k]).reshape(n, 3, 16, 16))
        assert not shared.pixel_values[r, n:].any()
    # the images a row only grow (`at_least`), as the other sizes
    _, bigger = pack_rl_batch(batch, at_least=(0, 0, 0, 2 * layout.images))
    assert bigger.images == 2 * layout.images
    assert pack_rl_batch(build_rl_batch(_text_only(batch), np.zeros(8)))[1].sizes[3:] == ()  # text: (L, S, M)


def _text_only(batch):
    """The batch's rows as text rollouts (no images)."""
    ids, am = batch.input_ids, batch.attention_mask
    p = ids.shape[1] - batch.completion_len
    return Rollouts(group_size=2, record_index=list(range(8)), prompt_ids=[ids[i, :p][am[i, :p] > 0].tolist()
                                                                           for i in range(8)],
                    completion_ids=[ids[i, p:][am[i, p:] > 0].tolist() for i in range(8)],
                    logprobs=[[-1.0] * int(am[i, p:].sum()) for i in range(8)], finish_reasons=["stop"] * 8,
                    texts=[""] * 8, prompts_text=[""] * 8, rewards=np.zeros(8, np.float32), per_reward={},
                    reward_stats={})


@pytest.mark.parametrize("layout_kind", ["sequences", "shared"])
@pytest.mark.slow
def test_packed_logprobs_equal_the_padded_batch(model, layout_kind):
    import jax

    batch, _ = _batch(seed=1)
    padded, _ = jax.jit(padded_logprobs)(model, batch)
    packed, layout = pack_rl_batch(batch) if layout_kind == "sequences" else pack_shared_prompts(batch, 2)
    got, _ = jax.jit(packed_logprobs)(model, packed)
    got = layout.unpack(np.asarray(got))
    mask = batch.loss_mask > 0
    print(f"{layout_kind}: max |packed - padded| = {np.abs(got[mask] - np.asarray(padded)[mask]).max():.2e}")
    np.testing.assert_allclose(got[mask], np.asarray(padded)[mask], atol=1e-5, rtol=0)
    # without the images the log-probs differ: the check above sees them
    blank = dataclasses.replace(packed, pixel_values=np.zeros_like(packed.pixel_values))
    off, _ = jax.jit(packed_logprobs)(model, blank)
    assert np.abs(layout.unpack(np.asarray(off))[mask] - np.asarray(padded)[mask]).max() > 1e-3
