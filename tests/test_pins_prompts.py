"""Pins of the prompts an RL run trains on (issue 48): `data.system_prompt` reaches every prompt rendered with the
chat template, message lists and image prompts alike, not only text; and a batch's images are its own records'
(with shuffled data, each group trains on the images its prompt was sampled with)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from posttrain.algorithms.registry import ADVANTAGES
from posttrain.data.vlm import VisionSpec
from posttrain.models.tiny_vlm import BOI, EOI, IMAGE, VLM_SPECIAL_TOKENS, build_vlm_tokenizer
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rl.batch import GroupAdvantages
from posttrain.rollout.collect import generate_rollouts
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptSet, PromptStyle, encode_prompts
from posttrain.sampling import Completion, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Answer with one number."


def test_data_system_prompt_reaches_message_prompts(tmp_path):
    """`data.system_prompt` as an RL run reads it (`build_rl`): a message list without a system turn gets it first,
    one with its own keeps that one (not a second), and with `data.chat` false a text prompt stays text."""
    from posttrain.rl import steps
    from posttrain.rl.loop import load_rl_config
    from posttrain.rl.setup import build_rl

    user = {"role": "user", "content": "What is 2 times 3?"}
    own = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "What is 1 times 1?"}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": [user], "answer": "6"}, {"prompt": own, "answer": "1"}, {"prompt": "What is 2 times 2?", "answer": "4"})))
    cfg = load_rl_config(ROOT / "configs" / "rl_smoke.yaml", [
        "model.path=tiny:llama", f"output_dir={tmp_path / 'out'}", f"data.train={data}", "data.eval=null",
        "data.chat=false", f"data.system_prompt={SYSTEM}", "rewards.num_workers=0", "trainer.progress=false"])
    parts = build_rl(cfg)
    try:
        ids, tok = [p.ids for p in parts.prompts.train], parts.tok
    finally:
        steps.close(parts)
    rendered = [tok.apply_chat_template(m, add_generation_prompt=True)
                for m in ([{"role": "system", "content": SYSTEM}, user], own)]
    assert ids == [list(rendered[0]), list(rendered[1]), list(tok.encode("What is 2 times 2?"))]
    assert SYSTEM in tok.decode(ids[0]) and SYSTEM not in tok.decode(ids[1])


def _vlm_folder(folder: Path) -> Path:
    """A checkpoint folder as the prompt encoder reads it: the tiny VLM's tokenizer and a Gemma 3 config.json."""
    build_vlm_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": VLM_SPECIAL_TOKENS.index(BOI), "eoi_token_index": VLM_SPECIAL_TOKENS.index(EOI),
        "image_token_index": VLM_SPECIAL_TOKENS.index(IMAGE), "mm_tokens_per_image": 4,
        "text_config": {"model_type": "gemma3_text"},
        "vision_config": {"model_type": "siglip_vision_model", "image_size": 8, "patch_size": 4}}))
    return folder


def test_system_prompt_reaches_image_prompts(tmp_path):
    """An image prompt (a message list with an image part) gets the system prompt as a text prompt does; the
    rendering equals the same record with that system turn written in it, and its image is kept."""
    from posttrain.models import tokenizer as tk

    folder = _vlm_folder(tmp_path / "vlm")
    tok = tk.load(folder)
    vision = VisionSpec.from_checkpoint(folder, tok)
    turn = {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (8, 8), (200, 30, 30))},
                                        {"type": "text", "text": "How many red shapes?"}]}
    records = [{"prompt": [turn]}, {"prompt": [{"role": "system", "content": "Think first."}, turn]}]
    where = lambda i: f"record {i}"  # noqa: E731
    got = encode_prompts(records, tok, PromptStyle(chat=False, system_prompt=SYSTEM), vision=vision, where=where)
    written = encode_prompts([{"prompt": [{"role": "system", "content": SYSTEM}, turn]}, records[1]], tok,
                             PromptStyle(chat=False), vision=vision, where=where)
    assert got.ids == written.ids and SYSTEM in tok.decode(got[0].ids) and SYSTEM not in tok.decode(got[1].ids)
    assert [len(p.images) for p in got] == [1, 1] and got[0].ids.count(vision.image_id) == 4


class _ImageEcho:
    """A stand-in for `Sampler`: each completion of prompt p is 100 + the first pixel of each image the call gave
    for p, then a stop token, so a batch row shows which images its completion was sampled with."""

    def generate(self, prompt_ids, params, *, images=None, **kw):
        out = []
        for p in range(len(prompt_ids)):
            seen = [100 + int(x[0, 0, 0]) for x in images[p]] + [1]
            out += [Completion(prompt_index=p, sample_index=s, token_ids=seen, logprobs=[-1.0] * len(seen),
                               sampling_logprobs=None, finish_reason="stop", text="") for s in range(params.n)]
        return out


def test_rl_batch_images_belong_to_its_records():
    """Shuffled data: a step's groups are records in a drawn order (not their stream positions). Sampled as a step
    samples them and built into the training batch as the run builds it, each row's images are its own record's:
    the ones its prompt tokens belong to and its completion was sampled with, also after a minibatch shuffle."""
    n, groups, group_size = 12, 4, 3
    images = [[np.full((3, 4, 4), r + 1 + 20 * k, np.float32) for k in range(1 + r % 2)] for r in range(n)]
    prompts = PromptSet.of([{"prompt": f"q{r}"} for r in range(n)], [[20 + r, 5, 6][: 1 + r % 3] for r in range(n)],
                           images)
    lease = Dispatcher(n, seed=3, shuffle=True, batch_groups=groups).lease("local", groups)
    assert lease.records != lease.uids  # the shuffle: record indices are not the stream positions
    with RewardRunner([], num_workers=0) as runner:
        ro = generate_rollouts(Policy(None, None, sampler=_ImageEcho()), prompts.select(lease.records),
                               SamplingParams(n=group_size, max_new_tokens=4), runner, uids=lease.uids)
    batch, _ = GroupAdvantages(ADVANTAGES["grpo"], False, prompts, 0)(ro)
    assert len(batch) == groups * group_size and batch.pixel_values.shape[1] == 2
    for b in (batch, batch.rows(np.random.default_rng(0).permutation(len(batch)))):
        ids, p = np.asarray(b.input_ids), b.input_ids.shape[1] - b.completion_len
        for i in range(len(b)):
            r = int(ids[i][b.attention_mask[i] > 0][0]) - 20  # the record whose prompt tokens this row holds
            own, count = np.stack(images[r]), int(b.image_counts[i])
            assert count == len(own)
            np.testing.assert_array_equal(b.pixel_values[i, :count], own)
            assert not b.pixel_values[i, count:].any()
            assert ids[i, p: p + count].tolist() == [100 + int(x[0, 0, 0]) for x in own]  # sampled with them
    assert sorted({int(x) for x in ro.record_index}) == sorted(lease.records)
