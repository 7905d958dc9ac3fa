"""Gemma 3 vision-language model against transformers' Gemma3ForConditionalGeneration: float32 logits with one and
several images per sequence, left padding, text only; cached prefill; export round trip with AutoProcessor."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import VLM_MM_TOKENS, save_hf_vlm

from posttrain.models import KVCache, Transformer, from_pretrained, save_pretrained
from posttrain.models.tiny_vlm import BOI, EOI, IMAGE, VLM_SPECIAL_TOKENS

TOL = 1e-4
# a torch VLM and several compiled programs: ~60 s on 2 busy cores; numbers against transformers: compiled as
# users' runs are (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.full_optimization]


@nnx.jit
def _forward(model, ids, mask, pixels=None, embeds=None):
    return model(ids, attention_mask=mask, pixel_values=pixels, image_embeds=embeds)
IMG, BOI_ID, EOI_ID = (VLM_SPECIAL_TOKENS.index(t) for t in (IMAGE, BOI, EOI))


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    return save_hf_vlm(tmp_path_factory.mktemp("hf-vlm"))


@pytest.fixture(scope="module")
def hf_vlm(vlm_folder):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(vlm_folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def vlm(vlm_folder):
    return from_pretrained(vlm_folder)


def _image():
    return [BOI_ID] + [IMG] * VLM_MM_TOKENS + [EOI_ID]


def _batch(seed=0):
    """Row 0: left-padded, text + one image + text; row 1: two images (one at the very start), text between."""
    rng = np.random.default_rng(seed)
    text = lambda n: list(rng.integers(9, 100, size=n))  # noqa: E731 - ordinary character ids
    row0 = [2] + text(3) + _image() + text(4)
    row1 = [2] + _image() + text(2) + _image() + text(3)
    width = max(len(row0), len(row1)) + 2
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for r, row in enumerate((row0, row1)):
        ids[r, width - len(row):] = row
        mask[r, width - len(row):] = 1
    pixels = rng.uniform(-1, 1, size=(3, 3, 24, 24)).astype(np.float32)
    return ids, mask, pixels


def _hf_logits(hf, ids, mask, pixels=None):
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    kw = {}
    if pixels is not None:
        kw = dict(pixel_values=torch.tensor(pixels), token_type_ids=torch.tensor((ids == IMG).astype(np.int64)))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos), **kw)
    return out.logits.float().numpy()


def _max_diff(a, b, mask):
    real = mask.astype(bool)
    return float(np.abs(np.asarray(a)[real] - np.asarray(b)[real]).max())


def test_config_read_from_checkpoint(vlm):
    vc = vlm.cfg.vision
    assert (vc.image_token_id, vc.boi_token_id, vc.eoi_token_id) == (IMG, BOI_ID, EOI_ID)
    assert vc.mm_tokens_per_image == VLM_MM_TOKENS and vc.image_size == 24 and vc.patch_size == 4
    assert vc.num_layers == 2 and vc.hidden_size == 32
    assert set(vc.processor_files) == {"preprocessor_config.json", "processor_config.json"}


def test_image_logits_match_transformers(hf_vlm, vlm):
    """One image in a left-padded row and two in the other; 9 image tokens against a sliding window of 6;
    precomputed image embeddings give the same logits as pixel values."""
    ids, mask, pixels = _batch()
    ref = _hf_logits(hf_vlm, ids, mask, pixels)
    ours = _forward(vlm, ids, mask, pixels)
    assert np.asarray(ours).dtype == np.float32
    assert _max_diff(ours, ref, mask) <= TOL
    embeds = nnx.jit(lambda m, p: m.image_embeddings(p))(vlm, pixels)
    assert embeds.shape == (3, VLM_MM_TOKENS, vlm.cfg.hidden_size)
    assert _max_diff(_forward(vlm, ids, mask, None, embeds), ref, mask) <= TOL


def test_text_only_logits_match_transformers(hf_vlm, vlm):
    rng = np.random.default_rng(4)
    ids = rng.integers(9, 100, size=(2, 12))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    ids[mask == 0] = 0
    assert _max_diff(_forward(vlm, ids, mask), _hf_logits(hf_vlm, ids, mask), mask) <= TOL


def test_images_change_the_logits_and_attend_bidirectionally(vlm):
    """Deliberate breaks the parity test would catch: other pixels change the text after the image; and the
    first image token sees the last one (bidirectional), so its logits depend on later image embeddings."""
    ids, mask, pixels = _batch()
    base = np.asarray(_forward(vlm, ids, mask, pixels))
    other = pixels.copy()
    other[0] = -other[0]
    changed = np.asarray(_forward(vlm, ids, mask, other))
    first = int(np.argmax(ids[0] == IMG))
    last = first + VLM_MM_TOKENS - 1
    assert np.abs(changed[0, last + 2] - base[0, last + 2]).max() > 1e-3  # the text after the image sees it
    embeds = np.array(nnx.jit(lambda m, p: m.image_embeddings(p))(vlm, pixels))
    embeds[0, -1] += 1.0  # only the last token of image 0
    moved = np.asarray(_forward(vlm, ids, mask, None, embeds))
    assert np.abs(moved[0, first] - base[0, first]).max() > 1e-4
    np.testing.assert_array_equal(moved[1], base[1])  # row 1's images are untouched


def test_text_only_call_is_the_text_program(vlm):
    """No pixel values: the jaxpr is the text model's (no vision tower, no image mask); with them it is not."""
    text = nnx.eval_shape(lambda: Transformer(vlm.cfg.replace(vision=None), rngs=nnx.Rngs(0)))
    ids = jax.ShapeDtypeStruct((2, 8), np.int32)

    def prims(model, *args, **kw):
        graphdef, state = nnx.split(model)
        fn = lambda st, x, *a: nnx.merge(graphdef, st)(x, **dict(zip(kw, a)))  # noqa: E731
        return [e.primitive.name for e in jax.make_jaxpr(fn)(state, ids, *kw.values()).jaxpr.eqns]

    assert prims(vlm) == prims(text)
    assert len(prims(vlm, pixel_values=jax.ShapeDtypeStruct((1, 3, 24, 24), np.float32))) > len(prims(vlm))


def test_cached_prefill_with_images_matches_uncached(vlm):
    """The sampler's prefill (a KV cache) sees the images as the uncached forward does."""
    ids, mask, pixels = _batch(seed=1)
    full = np.asarray(_forward(vlm, ids, mask, pixels))
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    cache = KVCache.create(vlm.cfg, ids.shape[0], 64)
    logits, cache = nnx.jit(lambda m, c: m(ids, attention_mask=mask, positions=pos, cache=c, pixel_values=pixels))(
        vlm, cache)
    assert _max_diff(logits, full, mask) <= 1e-5


def test_export_reloads_in_transformers_with_processor(vlm_folder, vlm, tmp_path):
    import transformers
    from PIL import Image

    from posttrain.models import tokenizer as tok_lib

    out = save_pretrained(vlm, tmp_path / "export", tokenizer=tok_lib.load(vlm_folder), shard_bytes=60_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    proc = transformers.AutoProcessor.from_pretrained(out)
    assert type(proc).__name__ == "Gemma3Processor"
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 255, (30, 20, 3), dtype=np.uint8)) for _ in range(2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = proc(text=[prompt, "a <start_of_image> b"], images=[[images[0]], [images[1]]], padding=True,
                 return_tensors="np", padding_side="left")
    ids, mask, pixels = batch["input_ids"], batch["attention_mask"], batch["pixel_values"]
    assert (ids == IMG).sum() == 2 * VLM_MM_TOKENS and pixels.shape == (2, 3, 24, 24)
    ref = _hf_logits(hf, ids, mask, pixels)
    ours = np.asarray(_forward(vlm, ids, mask, pixels))
    assert _max_diff(ours, ref, mask) <= TOL
    np.testing.assert_array_equal(np.asarray(_forward(from_pretrained(out), ids, mask, pixels)), ours)


def test_bfloat16_unrolled_remat_close_to_float32(vlm_folder, vlm):
    """bf16 parameters and compute, layers unrolled (vision tower too), remat on: close to float32."""
    ids, mask, pixels = _batch()
    f32 = np.asarray(_forward(vlm, ids, mask, pixels))
    other = from_pretrained(vlm_folder, dtype="bfloat16", remat="full", scan_layers=False)
    bf16 = np.asarray(_forward(other, ids, mask, pixels))
    real = mask.astype(bool)
    rel = np.linalg.norm(bf16[real] - f32[real]) / np.linalg.norm(f32[real])
    assert bf16.dtype == np.float32 and np.isfinite(bf16).all()
    assert 1e-3 < rel < 5e-2


def test_greedy_generation_with_images_matches_transformers(hf_vlm, vlm):
    """The sampler's prefill takes a prompt's images: greedy tokens equal transformers' `generate`; a text
    prompt next to it in the same call stays text only; wrong image counts are errors."""
    from posttrain.sampling import Sampler, SamplingParams

    ids, mask, pixels = _batch(seed=2)
    prompts = [list(ids[r][mask[r] > 0]) for r in range(2)]
    text_prompt = [2, 40, 41, 42]
    sampler = Sampler(vlm, max_slots=4, max_len=64)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[])
    outs = sampler.generate([prompts[0], text_prompt, prompts[1]], params,
                            images=[[pixels[0]], [], list(pixels[1:])])
    for out, prompt, pix in ((outs[0], prompts[0], pixels[:1]), (outs[2], prompts[1], pixels[1:]),
                             (outs[1], text_prompt, None)):
        p = torch.tensor([prompt])
        kw = {} if pix is None else dict(pixel_values=torch.tensor(pix), token_type_ids=(p == IMG).long())
        with torch.no_grad():
            ref = hf_vlm.generate(input_ids=p, attention_mask=torch.ones_like(p), max_new_tokens=6, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, **kw)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    with pytest.raises(ValueError, match="prompt 0 has 1 image"):
        sampler.generate([prompts[0]], params, images=[[]])
