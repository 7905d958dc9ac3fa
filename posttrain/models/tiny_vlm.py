"""A tiny Gemma 3 vision-language checkpoint with no download: tokenizer with image tokens, processor files, model.

`tiny:gemma3-vlm` (see `posttrain.models.tiny`) builds, under the tiny-model cache, an HF folder that
transformers loads as `Gemma3ForConditionalGeneration` and `AutoProcessor` (a `Gemma3Processor`): a character
tokenizer whose special tokens are Gemma 3's (`<start_of_turn>`, `<end_of_turn>`, `<start_of_image>`,
`<end_of_image>`, `<image_soft_token>`) with a Gemma-style chat template that renders `{"type": "image"}`
parts as `<start_of_image>`, a `preprocessor_config.json` (Gemma3ImageProcessor: resize to the tower's size,
rescale 1/255, normalise with mean = std = 0.5, pan-and-scan off) and a `processor_config.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from posttrain.models.config import ModelConfig, RopeConfig
from posttrain.models.tokenizer import DEFAULT_CHARS, Tokenizer, load
from posttrain.models.vision_config import VisionConfig

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
START_TURN, END_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
#: Special tokens in id order (0..8), Gemma's order for the first three.
VLM_SPECIAL_TOKENS = [PAD, EOS, BOS, UNK, START_TURN, END_TURN, BOI, EOI, IMAGE]

#: Gemma 3 style: `<bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n`; a system message is
#: prepended to the first user turn; content is a string or a list of text / image parts.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = 0 %}{% set prefix = '' %}"
    "{% if messages[0]['role'] == 'system' %}{% set first = 1 %}"
    "{% if messages[0]['content'] is string %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}{% endif %}"
    "{% for message in messages[first:] %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{% if loop.first %}{{ prefix }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_vlm_tokenizer(out_dir: str | os.PathLike) -> Tokenizer:
    """A character tokenizer with Gemma 3's special and image tokens (ids 0..8) and `VLM_CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(VLM_SPECIAL_TOKENS + DEFAULT_CHARS)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(VLM_SPECIAL_TOKENS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000, "chat_template": VLM_CHAT_TEMPLATE, "processor_class": "Gemma3Processor",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return load(out)


def processor_files(vc: VisionConfig) -> dict[str, dict]:
    """preprocessor_config.json and processor_config.json of a Gemma3Processor for the tower of `vc`."""
    return {
        "preprocessor_config.json": {
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "size": {"height": vc.image_size, "width": vc.image_size}, "resample": 2,
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5] * vc.num_channels, "image_std": [0.5] * vc.num_channels,
            "do_convert_rgb": None, "do_pan_and_scan": None,
        },
        "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": vc.mm_tokens_per_image},
    }


def tiny_vlm_config(vocab_size: int, *, image_size: int = 32, patch_size: int = 4, mm_tokens_per_image: int = 16,
                    size: str = "") -> ModelConfig:
    """A tiny Gemma 3 VLM config for the tokenizer of `build_vlm_tokenizer` (image token ids read from it)."""
    hidden, layers = (128, 4) if size == "small" else (64, 2)
    vision = VisionConfig(hidden_size=hidden // 2, intermediate_size=hidden, num_layers=2, num_heads=4,
                          image_size=image_size, patch_size=patch_size, mm_tokens_per_image=mm_tokens_per_image,
                          image_token_id=VLM_SPECIAL_TOKENS.index(IMAGE), boi_token_id=VLM_SPECIAL_TOKENS.index(BOI),
                          eoi_token_id=VLM_SPECIAL_TOKENS.index(EOI))
    vision = dataclasses.replace(vision, processor_files=processor_files(vision))
    return ModelConfig(
        model_type="gemma3_text", vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=2048,
        rope=RopeConfig(theta=1_000_000.0), rope_local=RopeConfig(theta=10_000.0), tie_word_embeddings=True,
        qk_norm=True, norm_offset=True, post_norms=True, embed_scale=True, hidden_act="gelu_tanh",
        sliding_window=512, layer_types=("sliding_attention",) * (layers - 1) + ("full_attention",),
        bos_token_id=VLM_SPECIAL_TOKENS.index(BOS),
        eos_token_id=(VLM_SPECIAL_TOKENS.index(EOS), VLM_SPECIAL_TOKENS.index(END_TURN)),
        pad_token_id=0, vision=vision,
    )
