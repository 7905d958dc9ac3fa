"""`ModelConfig`: the typed description of one decoder-only Transformer, read from and written to HF config.json.

One config covers every supported family; the family only decides defaults and which switches are on (its row of
`FAMILIES`, the one table `ModelConfig.from_hf` reads):

| family        | qkv bias | q/k norm | norm (1+w) | post norms | act       | soft-caps | sliding window        |
|---------------|----------|----------|------------|------------|-----------|-----------|-----------------------|
| llama         | opt.     | -        | -          | -          | silu      | -         | -                     |
| qwen2         | yes      | -        | -          | -          | silu      | -         | opt. (layer_types)    |
| qwen3         | opt.     | yes      | -          | -          | silu      | -         | opt. (layer_types)    |
| mistral       | -        | -        | -          | -          | silu      | -         | every layer, if set   |
| gemma2        | opt.     | -        | yes        | yes        | gelu_tanh | attn+final| alternating (layer_types) |
| gemma3_text   | opt.     | yes (1+w)| yes        | yes        | gelu_tanh | opt.      | 5 local : 1 global    |
| qwen3_moe     | opt.     | yes      | -          | -          | silu      | -         | every layer, if set   |
| mixtral       | -        | -        | -          | -          | silu      | -         | every layer, if set   |
| qwen2_moe     | yes      | -        | -          | -          | silu      | -         | opt. (layer_types)    |

The mixture-of-experts families (`num_experts` > 0) replace the MLP of their sparse layers (`moe_layers`) by
`num_experts` gated MLPs of width `moe_intermediate_size` and a router choosing `num_experts_per_tok` of them per
token (`posttrain.models.moe`): Qwen3-MoE and Qwen2-MoE keep dense MLPs in `mlp_only_layers` and off the
`decoder_sparse_step` layers and renormalise the top-k weights if `norm_topk_prob`; Mixtral's layers are all
sparse and always renormalise; Qwen2-MoE adds a shared expert behind a sigmoid gate.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from posttrain.models.vision_config import VisionConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "mixtral",
                         "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


class UnsupportedModelError(ValueError):
    """A config.json whose `model_type` this library does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one attention kind: base `theta` and an optional scaling rule."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @staticmethod
    def from_hf(params: dict[str, Any] | None, theta: float) -> "RopeConfig":
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: default, linear, llama3"
            )
        return RopeConfig(
            theta=float(params.get("rope_theta", theta)),
            type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


@dataclasses.dataclass(frozen=True)
class Family:
    """How one family reads its config.json (`ModelConfig.from_hf`): its defaults and the switches it turns on.

    gemma: Gemma's norms (1 + w), post norms, embedding scale, soft-caps, tanh GELU and tied embeddings by default.
    qk_norm: RMS norms on queries and keys.
    qkv_bias: the q/k/v biases: on or off, or the config.json key that says and its default; o_bias: `o_proj`'s
      bias follows them.
    windows: how the sliding window and each layer's attention kind are read (`_attention_kinds`).
    rope_theta: the RoPE base when config.json gives none. rope_local: a second RoPE for the sliding layers.
    """

    gemma: bool = False
    qk_norm: bool = False
    qkv_bias: bool | tuple[str, bool] = ("attention_bias", False)
    o_bias: bool = False
    windows: str = "none"
    rope_theta: float = 10000.0
    rope_local: bool = False


#: every supported family's row (the module docstring's table, as `from_hf` reads it)
FAMILIES = {
    "llama": Family(o_bias=True),
    "qwen2": Family(qkv_bias=True, windows="qwen"),
    "qwen3": Family(qk_norm=True, windows="qwen"),
    "mistral": Family(qkv_bias=False, windows="every"),
    "gemma2": Family(gemma=True, o_bias=True, windows="alternating"),
    "gemma3_text": Family(gemma=True, qk_norm=True, o_bias=True, windows="gemma3", rope_theta=1_000_000.0,
                          rope_local=True),
    "qwen3_moe": Family(qk_norm=True, windows="every_if_used"),
    "mixtral": Family(qkv_bias=False, windows="every"),
    "qwen2_moe": Family(qkv_bias=("qkv_bias", True), windows="qwen2_moe"),
}


def _attention_kinds(hf: dict[str, Any], windows: str, layers: int) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as a family's `windows` rule reads them: `none` (full attention), `every`
    (the window, when set, on every layer), `every_if_used` (so, when `use_sliding_window`), `qwen` (the layers
    from `max_window_layers` on, when `use_sliding_window`), `qwen2_moe` (every other layer below it),
    `alternating` (Gemma 2: even layers) or `gemma3` (5 local : 1 global); config.json's `layer_types` wins."""
    given, window = hf.get("layer_types"), hf.get("sliding_window")
    used = hf.get("use_sliding_window", False)
    max_window = int(hf.get("max_window_layers", layers))
    if windows == "none":
        given = window = None
    elif windows == "every" or windows == "every_if_used":
        window = window if windows == "every" or used else None
        given = ["sliding_attention" if window else "full_attention"] * layers
    elif windows == "qwen" and not used:
        window = None
    elif windows == "qwen":
        given = given or ["sliding_attention" if i >= max_window else "full_attention" for i in range(layers)]
    elif windows == "qwen2_moe":
        window = window if used else None
        given = given or ["sliding_attention" if (i + 1) % 2 and i < max_window and window else "full_attention"
                          for i in range(layers)]
    elif windows == "alternating":
        given = given or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    else:  # gemma3
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        given = given or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return {"sliding_window": int(window) if window else None, "layer_types": tuple(given or ())}


def _rope_fields(hf: dict[str, Any], fam: Family) -> dict[str, Any]:
    """RoPE: transformers 5 writes `rope_parameters` (per layer type for Gemma 3); 4 wrote rope_theta/rope_scaling."""
    theta = float(hf.get("rope_theta", fam.rope_theta))
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        out = {"rope": RopeConfig.from_hf(rp["full_attention"], theta)}
        if "sliding_attention" in rp:
            out["rope_local"] = RopeConfig.from_hf(rp["sliding_attention"], 10000.0)
    else:
        out = {"rope": RopeConfig.from_hf(rp if isinstance(rp, dict) else hf.get("rope_scaling"), theta)}
    if fam.rope_local and "rope_local" not in out:
        out["rope_local"] = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0)))
    return out


def _activation(hf: dict[str, Any], fam: Family, source: str) -> str:
    act = (hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh") if fam.gemma else \
        hf.get("hidden_act", "silu")
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise UnsupportedModelError(f"{source}: hidden activation {act!r} is not supported; supported: {sorted(acts)}")
    return acts[act]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture plus numerics (parameter dtype, compute dtype, scan and remat) of one model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    rope_local: RopeConfig | None = None  # Gemma 3: RoPE of the sliding-window layers
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False  # Gemma: y = x_normed * (1 + w)
    post_norms: bool = False  # Gemma 2/3: norms after attention and MLP, plus pre-MLP norm
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    hidden_act: str = "silu"  # silu | gelu_tanh
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # mixture of experts (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP; default all True with experts
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token passes, with a sigmoid gate
    router_aux_loss_coef: float = 0.0  # transformers' weight of the load-balancing loss (kept for export)
    # numerics (not part of the HF architecture)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scan_layers: bool = True
    remat: str = "none"  # none | full | dots | dots_no_batch
    attention_impl: str = "auto"  # auto | xla | cudnn
    # auto | generic | cpu: the kernel set (`posttrain.models.kernels`); auto resolves when the model is built
    kernels: str = "auto"
    # vision-language checkpoints (Gemma 3): the SigLIP tower, projector and image token ids; None = text only
    vision: VisionConfig | None = None
    hf_config: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if isinstance(self.eos_token_id, list):  # Llama 3 lists several; a tuple keeps the config hashable
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        self._check_experts()
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name}={getattr(self, name)!r}; accepted: float32, bfloat16, float16")
        if self.remat not in ("none", "full", "dots", "dots_no_batch"):
            raise ValueError(f"remat={self.remat!r}; accepted: none, full, dots, dots_no_batch")
        if self.kernels not in ("auto", "generic", "cpu"):
            raise ValueError(f"kernels={self.kernels!r}; accepted: auto, generic, cpu")

    def _check_experts(self):
        if self.num_experts == 0:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)
            return
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (True,) * self.num_layers)
        object.__setattr__(self, "moe_layers", tuple(bool(m) for m in self.moe_layers))
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                             f"{self.num_experts}")
        if self.moe_intermediate_size <= 0:
            raise ValueError("a mixture-of-experts config needs moe_intermediate_size > 0")
        if self.model_type == "mixtral" and self.moe_intermediate_size != self.intermediate_size:
            raise ValueError("mixtral's experts have the width intermediate_size: moe_intermediate_size must equal it")

    # ------------------------------------------------------------------ derived
    @property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return any(self.moe_layers)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer has the dense MLP (every layer of a dense model; mlp_only_layers of a MoE one)."""
        return not all(self.moe_layers)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" and self.sliding_window is not None for t in self.layer_types)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def _attn_params(self) -> int:
        d = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d

    def _moe_params(self, experts: int) -> int:
        """One sparse layer's MLP weights with `experts` of its experts counted (router and shared expert too)."""
        d = self.hidden_size
        shared = 3 * d * self.shared_expert_intermediate_size + d if self.shared_expert_intermediate_size else 0
        return d * self.num_experts + experts * 3 * d * self.moe_intermediate_size + shared

    def layer_matmul_params(self) -> int:
        """The weights of one decoder layer's linear maps (q, k, v, o, gate, up, down): what a token multiplies
        (for a mixture of experts: the router and the top-k experts, averaged over the layers)."""
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self._moe_params(self.num_experts_per_tok)
        mlp = sum(sparse if m else dense for m in self.moe_layers) / self.num_layers
        return self._attn_params() + round(mlp)

    def num_params(self, active: bool = False) -> int:
        """All parameters; with `active`, those one token uses (a mixture of experts' top-k experts only)."""
        d, l = self.hidden_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dense = 3 * d * self.intermediate_size
        sparse = self._moe_params(self.num_experts_per_tok if active else self.num_experts)
        per_layer = self._attn_params() + 2 * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.post_norms:
            per_layer += 2 * d
        total = l * per_layer + sum(sparse if m else dense for m in self.moe_layers) + self.vocab_size * d + d
        if not self.tie_word_embeddings:
            total += self.vocab_size * d
        if self.vision is not None:
            total += self.vision.num_params(d)
        return total

    # ------------------------------------------------------------------ HF I/O
    @staticmethod
    def from_hf(hf: dict[str, Any], *, source: str = "config.json", **overrides) -> "ModelConfig":
        """Builds the config from a Hugging Face config.json dict (transformers 4 and 5 layouts); each family's
        defaults and switches are its row of `FAMILIES`."""
        if hf.get("model_type") == "gemma3":  # multimodal wrapper: its text part, and the vision tower when it has one
            if hf.get("vision_config") is not None and "vision" not in overrides:
                overrides["vision"] = VisionConfig.from_hf(hf, source=source)
            hf = {**hf.get("text_config", {}), "model_type": "gemma3_text"}
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        fam = FAMILIES[model_type]
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            fields: dict[str, Any] = dict(
                model_type=model_type, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]), num_layers=layers, num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads))
        except KeyError as e:
            raise ValueError(f"{source}: required field {e.args[0]!r} is missing") from None
        bias = fam.qkv_bias if isinstance(fam.qkv_bias, bool) else bool(hf.get(*fam.qkv_bias))
        fields.update(
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", fam.gemma)), bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qkv_bias=bias, o_bias=bias and fam.o_bias, qk_norm=fam.qk_norm, **_rope_fields(hf, fam),
            hidden_act=_activation(hf, fam, source), **_attention_kinds(hf, fam.windows, layers), hf_config=dict(hf))
        if fam.gemma:
            fields.update(norm_offset=True, post_norms=True, embed_scale=True,
                          attn_logit_softcap=hf.get("attn_logit_softcapping"),
                          final_logit_softcap=hf.get("final_logit_softcapping"),
                          query_pre_attn_scalar=hf.get("query_pre_attn_scalar"))
        if model_type in MOE_MODEL_TYPES:
            fields.update(_experts_from_hf(hf, model_type, layers))
        return ModelConfig(**(fields | overrides))

    def _experts_to_hf(self, out: dict[str, Any]) -> None:
        """The mixture-of-experts and attention fields of the MoE families' config.json (in place)."""
        sliding = any(self.sliding_layers)
        out.update(num_experts_per_tok=self.num_experts_per_tok, router_aux_loss_coef=self.router_aux_loss_coef,
                   sliding_window=self.sliding_window if sliding else None)
        if self.model_type == "mixtral":
            out.pop("num_experts", None)
            out.update(num_local_experts=self.num_experts)
            return
        out.pop("num_local_experts", None)
        out.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                   norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, use_sliding_window=sliding,
                   mlp_only_layers=[i for i, m in enumerate(self.moe_layers) if not m])
        if self.model_type == "qwen3_moe":
            out["attention_bias"] = self.qkv_bias
        else:
            out.update(qkv_bias=self.qkv_bias, layer_types=list(self.layer_types),
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size)

    @staticmethod
    def from_file(path: str | Path, **overrides) -> "ModelConfig":
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
        return ModelConfig.from_hf(hf, source=str(path), **overrides)

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict that `transformers` loads; starts from the loaded one when there was one."""
        out: dict[str, Any] = dict(self.hf_config or {})
        gemma = self.model_type in ("gemma2", "gemma3_text")
        out.update(
            model_type=self.model_type,
            architectures=[_ARCHITECTURES[self.model_type]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            pad_token_id=self.pad_token_id,
            dtype=self.param_dtype,
        )
        for old in ("rope_theta", "rope_scaling", "torch_dtype", "rope_local_base_freq"):
            out.pop(old, None)
        if self.model_type == "gemma3_text":
            out["rope_parameters"] = {
                "full_attention": self.rope.to_hf(),
                "sliding_attention": (self.rope_local or RopeConfig()).to_hf(),
            }
        else:
            out["rope_parameters"] = self.rope.to_hf()
        act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[self.hidden_act]
        if gemma:
            out.update(
                hidden_activation=act,
                attention_bias=self.qkv_bias,
                attn_logit_softcapping=self.attn_logit_softcap,
                final_logit_softcapping=self.final_logit_softcap,
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types),
            )
        else:
            out["hidden_act"] = act
        if self.model_type == "llama":
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.model_type == "qwen3":
            out["attention_bias"] = self.qkv_bias
        if self.model_type in ("qwen2", "qwen3"):
            out.update(
                use_sliding_window=any(self.sliding_layers),
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types),
            )
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window if any(self.sliding_layers) else None
        if self.model_type in MOE_MODEL_TYPES:
            self._experts_to_hf(out)
        if self.vision is not None:
            return self.vision.to_hf(out, self.param_dtype)
        return out

    def _describe_experts(self) -> dict[str, Any]:
        sparse = sum(self.moe_layers)
        shared = f", shared expert {self.shared_expert_intermediate_size}" if self.shared_expert_intermediate_size else ""
        active = self.num_params(active=True)
        return {"experts": f"{self.num_experts} x {self.moe_intermediate_size}, top-{self.num_experts_per_tok}"
                           f"{' (renormalised)' if self.norm_topk_prob else ''}{shared}",
                "expert layers": f"{sparse} of {self.num_layers}",
                "active parameters": f"{active:,} ({active / 1e6:.2f} M) of {self.num_params():,} per token"}

    def describe(self) -> dict[str, Any]:
        """A short human summary (used by `posttrain info`)."""
        return {
            "architecture": _ARCHITECTURES[self.model_type],
            "model_type": self.model_type,
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "intermediate": self.intermediate_size,
            "heads": f"{self.num_heads} q / {self.num_kv_heads} kv x {self.head_dim}",
            "vocab": self.vocab_size,
            "tied embeddings": self.tie_word_embeddings,
            "sliding window": self.sliding_window if any(self.sliding_layers) else None,
            "rope": f"{self.rope.type} theta={self.rope.theta:g}",
        } | (self._describe_experts() if self.is_moe else {}) | ({"architecture": "Gemma3ForConditionalGeneration", "model_type": "gemma3 (text: gemma3_text)",
              **self.vision.describe()} if self.vision else {})


def _experts_from_hf(hf: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a MoE family's config.json (transformers' names and defaults)."""
    experts = int(hf.get("num_experts", hf.get("num_local_experts")) or 0)
    if model_type == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=(experts > 0,) * layers,
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or ())
    return dict(
        num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe"
        else 0,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def llama_like(**kw) -> ModelConfig:
    """A small Llama-shaped config, for tests, benchmarks and the demo."""
    base = dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(kw)
    if "head_dim" not in kw and "hidden_size" in kw:
        base["head_dim"] = base["hidden_size"] // base["num_heads"]
    return ModelConfig(**base)

