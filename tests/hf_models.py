"""Tiny random-initialised Hugging Face checkpoints of every supported family, built with `transformers` + torch."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# family name -> (transformers config class name, model class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3_scaled_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16),
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
             num_hidden_layers=4),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(sliding_window=5, query_pre_attn_scalar=24, num_hidden_layers=4,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}}),
    ),
}


def build_hf_model(family: str, seed: int = 0):
    """A torch HF model of `family` whose every weight (norms and biases too) is random, so parity is meaningful."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**COMMON, **extra}
    if family == "qwen3":
        kwargs["attention_bias"] = False
    config = getattr(transformers, cfg_cls)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
    return model


def save_hf_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    model = build_hf_model(family, seed)
    model.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------- vision-language (Gemma 3)
#: A tiny Gemma3ForConditionalGeneration: 24 px images in 4 px patches (6 x 6), pooled to 3 x 3 = 9 image tokens;
#: a sliding window (6) shorter than an image's run of placeholders, so windows and image blocks interact.
VLM_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=6,
                query_pre_attn_scalar=24, pad_token_id=0, eos_token_id=[1, 5], bos_token_id=2,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})
VLM_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=24,
                  patch_size=4, vision_use_head=False)
VLM_MM_TOKENS = 9


def build_hf_vlm(vocab_size: int, seed: int = 0):
    """A torch Gemma3ForConditionalGeneration whose every weight is random (image token ids of `tiny_vlm`)."""
    import torch
    import transformers

    from posttrain.models.tiny_vlm import BOI, EOI, IMAGE, VLM_SPECIAL_TOKENS

    config = transformers.Gemma3Config(
        text_config={**VLM_TEXT, "vocab_size": vocab_size}, vision_config=VLM_VISION,
        mm_tokens_per_image=VLM_MM_TOKENS, image_token_index=VLM_SPECIAL_TOKENS.index(IMAGE),
        boi_token_index=VLM_SPECIAL_TOKENS.index(BOI), eoi_token_index=VLM_SPECIAL_TOKENS.index(EOI))
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or "post_layernorm" in name:  # SigLIP LayerNorm: weight around 1
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif "norm" in name:  # Gemma RMSNorm (1 + w)
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.ndim == 4:  # patch embedding conv [out, C, p, p]
                p.copy_(torch.randn_like(p) / (p[0].numel() ** 0.5))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
    return model


def save_hf_vlm(out_dir: Path, seed: int = 0) -> Path:
    """The tiny VLM with its tokenizer and processor files: an HF folder AutoProcessor loads."""
    import json

    from posttrain.models.config import ModelConfig
    from posttrain.models.tiny_vlm import build_vlm_tokenizer, processor_files

    tok = build_vlm_tokenizer(out_dir)
    model = build_hf_vlm(tok.vocab_size, seed)
    model.save_pretrained(out_dir)
    vc = ModelConfig.from_file(Path(out_dir) / "config.json").vision
    for fname, content in processor_files(vc).items():
        (Path(out_dir) / fname).write_text(json.dumps(content, indent=2))
    return out_dir
