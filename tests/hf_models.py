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
