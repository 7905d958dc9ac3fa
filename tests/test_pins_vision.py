"""Pins of the vision-language path (issue 41): an image in an assistant turn is never a target (its whole block has
loss mask 0); the placeholder merge puts image k's rows on the k-th run of placeholders, in order, with no shift;
the trained variables of a tiny VLM leave its vision tower out (unless asked), fast."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_vlm_data import N_IMG, make_vlm_checkpoint

from posttrain.data import encode_record
from posttrain.data.vlm import VisionSpec
from posttrain.models import tokenizer as tk
from posttrain.models.multimodal import merge_image_embeddings
from posttrain.models.vision_config import VisionConfig


def test_an_image_in_an_assistant_turn_has_loss_mask_0_on_its_block(tmp_path):
    folder = make_vlm_checkpoint(tmp_path / "vlm")
    tok = tk.load(folder)
    spec = VisionSpec.from_checkpoint(folder, tok)
    rec = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Draw it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ab"}, {"type": "image"},
                                          {"type": "text", "text": "cd"}]}],
        "images": ["drawn.png"]}
    ex = encode_record(rec, tok, vision=spec)
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    b = ids.index(spec.boi_id)
    block = slice(b, b + N_IMG + 2)
    assert ids[block] == [spec.boi_id] + [spec.image_id] * N_IMG + [spec.eoi_id]
    assert mask[block] == [0] * (N_IMG + 2)
    # the assistant's own text around it is trained: "ab" before, "cd" and the end of turn after
    assert mask[b - 2: b] == [1, 1] and mask[b + N_IMG + 2: b + N_IMG + 4] == [1, 1]
    assert [t for t, m in zip(ids, mask) if m] == tok.encode("abcd", add_special_tokens=False) + [tok.eos_token_id]
    assert [r.source for r in ex.images] == ["drawn.png"]


def test_merge_puts_each_image_on_its_placeholders_in_order():
    vc = VisionConfig(hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, image_size=8, patch_size=4,
                      mm_tokens_per_image=4, image_token_id=9)
    d, im = 3, 9
    ids = np.array([[1, im, im, im, im, 2, im, im, im, im],
                    [im, im, im, im, 3, 4, 5, 6, 7, 8]])
    x = np.arange(2 * 10 * d, dtype=np.float32).reshape(2, 10, d)
    emb = -(1.0 + np.arange(4 * 4 * d, dtype=np.float32)).reshape(4, 4, d)  # 4 images; the 4th padding
    got = np.asarray(merge_image_embeddings(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(emb), vc))
    want = x.copy()
    want[0, 1:5] = emb[0]  # row 0: images 0 and 1, row 1: image 2 (row by row, left to right); image 3 unused
    want[0, 6:10] = emb[1]
    want[1, 0:4] = emb[2]
    np.testing.assert_array_equal(got, want)


def test_trained_variables_leave_the_vision_tower_out():
    from posttrain.models.tiny_vlm import VLM_SPECIAL_TOKENS, tiny_vlm_config
    from posttrain.models.transformer import init_model
    from posttrain.training.config import ModelSection
    from posttrain.training.run import trained_variables

    net = init_model(tiny_vlm_config(len(VLM_SPECIAL_TOKENS) + 23, image_size=16, mm_tokens_per_image=4), seed=0)

    def paths(model_section):
        state = nnx.split(net, trained_variables(net, model_section), ...)[1]
        return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state)}

    every_param = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(net, nnx.Param))}
    tower = {p for p in every_param if p.startswith("vision_tower.")}
    trained = paths(ModelSection())
    assert tower and trained == every_param - tower  # the projector and the decoder train; nothing of the tower
    assert any(p.startswith("multi_modal_projector.") for p in trained) and any("layers" in p for p in trained)
    assert paths(ModelSection(freeze_vision=False)) == every_param
