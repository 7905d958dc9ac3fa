"""`VisionConfig`: the vision half of a vision-language checkpoint (Gemma 3: a SigLIP tower plus its projector).

Read from the checkpoint's config.json (`Gemma3Config`: `vision_config` is a `SiglipVisionConfig`; the
image token ids and `mm_tokens_per_image` sit at the top level) and written back the same way. Nothing here is
hard-coded per checkpoint: the token ids, the number of image tokens and the tower's shape all come from the file.

In the text: the processor expands each `<start_of_image>` (`boi_token_id`) into `boi`,
`mm_tokens_per_image` copies of `image_token_id` and `eoi_token_id`; the model replaces the embeddings of
the `image_token_id` placeholders with the projected image embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: Fields of transformers' `SiglipVisionConfig` that this encoder implements (the rest is kept and written back).
_SIGLIP_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """SigLIP encoder shape, projector shape and the image token ids of a Gemma 3 style VLM."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_tanh"  # gelu_tanh | gelu (exact)
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    # the top-level HF config without text_config (written back as it was, with our fields updated)
    hf_config: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    # processor files read beside the checkpoint ({file name: JSON dict}), written again on export
    processor_files: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        side = round(self.mm_tokens_per_image ** 0.5)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square whose side divides "
                             f"the {self.patches_per_side} patches per side of the image")
        if self.hidden_act not in ("gelu_tanh", "gelu"):
            raise ValueError(f"vision hidden_act={self.hidden_act!r}; accepted: gelu_tanh, gelu")

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_side(self) -> int:
        return round(self.mm_tokens_per_image ** 0.5)

    def num_params(self, text_hidden: int) -> int:
        """Parameters of the tower and the projector."""
        d, f, c, p = self.hidden_size, self.intermediate_size, self.num_channels, self.patch_size
        per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        embed = c * p * p * d + d + self.num_patches * d
        return embed + self.num_layers * per_layer + 2 * d + d * text_hidden + d

    # ------------------------------------------------------------------ HF I/O
    @staticmethod
    def from_hf(hf: dict[str, Any], *, source: str = "config.json") -> "VisionConfig":
        """From a multimodal wrapper config dict (`model_type: gemma3`, with `vision_config`)."""
        vc = dict(hf.get("vision_config") or {})
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _SIGLIP_ACTS:
            raise ValueError(f"{source}: vision hidden_act {act!r} is not supported; supported: {sorted(_SIGLIP_ACTS)}")
        try:
            return VisionConfig(
                hidden_size=int(vc.get("hidden_size", 768)),
                intermediate_size=int(vc.get("intermediate_size", 3072)),
                num_layers=int(vc.get("num_hidden_layers", 12)),
                num_heads=int(vc.get("num_attention_heads", 12)),
                image_size=int(vc.get("image_size", 224)),
                patch_size=int(vc.get("patch_size", 16)),
                num_channels=int(vc.get("num_channels", 3)),
                layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
                hidden_act=_SIGLIP_ACTS[act],
                mm_tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
                image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262144))),
                boi_token_id=int(hf.get("boi_token_index", hf.get("boi_token_id", 255999))),
                eoi_token_id=int(hf.get("eoi_token_index", hf.get("eoi_token_id", 256000))),
                hf_config={k: v for k, v in hf.items() if k != "text_config"},
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf(self, text_config: dict[str, Any], param_dtype: str) -> dict[str, Any]:
        """The wrapper config.json (`Gemma3ForConditionalGeneration`) around the text model's `text_config`."""
        out = dict(self.hf_config or {})
        vc = dict(out.get("vision_config") or {})
        vc.update(
            model_type=vc.get("model_type", "siglip_vision_model"),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_channels=self.num_channels,
            layer_norm_eps=self.layer_norm_eps,
            hidden_act={"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[self.hidden_act],
            vision_use_head=False,
        )
        text = {k: v for k, v in text_config.items() if k not in ("architectures", "dtype")}
        out.update(
            model_type="gemma3",
            architectures=["Gemma3ForConditionalGeneration"],
            text_config=text,
            vision_config=vc,
            mm_tokens_per_image=self.mm_tokens_per_image,
            image_token_index=self.image_token_id,
            boi_token_index=self.boi_token_id,
            eoi_token_index=self.eoi_token_id,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
            dtype=param_dtype,
        )
        for old in ("torch_dtype", "image_token_id", "boi_token_id", "eoi_token_id"):
            out.pop(old, None)
        return out

    def describe(self) -> dict[str, Any]:
        """A short human summary (used by `posttrain info`)."""
        return {
            "vision tower": f"SigLIP {self.num_layers} layers, hidden {self.hidden_size}, "
                            f"intermediate {self.intermediate_size}, {self.num_heads} heads",
            "image": f"{self.image_size} px, patch {self.patch_size} ({self.num_patches} patches)",
            "image tokens": f"{self.mm_tokens_per_image} per image (id {self.image_token_id}; "
                            f"boi {self.boi_token_id}, eoi {self.eoi_token_id})",
        }
