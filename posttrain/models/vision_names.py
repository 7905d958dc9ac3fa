"""Hugging Face tensor names of a Gemma 3 vision-language checkpoint, for `hf_io` (loading and export).

transformers 5 writes `Gemma3ForConditionalGeneration` with the names `language_model.model.*` (the text
model), `language_model.lm_head.weight` (untied heads only), `vision_tower.*` (SigLIP: `embeddings.*`,
`encoder.layers.N.*`, `post_layernorm.*`) and `multi_modal_projector.*`; hub checkpoints and other writers
also use `vision_tower.vision_model.*` and a leading `model.`. Export uses transformers' own names; loading
accepts every spelling (`aliases`).

Layout codes as in `hf_io`: n > 0 a linear kernel with n input axes (HF [out, in]); -1 a bias flattened over
heads; 0 stored as it is; `CONV` the patch embedding (ours [C, p, p, hidden], HF's conv weight [hidden, C, p, p]).
"""

from __future__ import annotations

CONV = 1000

VISION_ROOTS = ("vision_tower", "multi_modal_projector")


def hf_name(parts: list[str], layer: int | None) -> tuple[str, int]:
    """HF name and layout code of a parameter of the vision tower or the projector (path parts, layer index)."""
    leaf = parts[-1]
    if parts[0] == "multi_modal_projector":
        if parts[1] == "mm_input_projection":
            return "multi_modal_projector.mm_input_projection_weight", 0
        return "multi_modal_projector.mm_soft_emb_norm.weight", 0
    assert parts[0] == "vision_tower", parts
    suffix = "weight" if leaf in ("kernel", "weight") else "bias"
    if parts[1] == "patch_embedding":
        return f"vision_tower.embeddings.patch_embedding.{suffix}", CONV if leaf == "kernel" else 0
    if parts[1] == "position_embedding":
        return "vision_tower.embeddings.position_embedding.weight", 0
    if parts[1] == "post_layernorm":
        return f"vision_tower.post_layernorm.{suffix}", 0
    assert parts[1] == "layers", parts
    module = ".".join(parts[2:-1])
    n_in = 2 if parts[-2] == "out_proj" else 1
    code = {"kernel": n_in, "bias": -1}.get(leaf, 0) if "layer_norm" not in module else 0
    return f"vision_tower.encoder.layers.{layer}.{module}.{suffix}", code


def is_stacked(path: tuple) -> bool:
    """Whether a parameter path is one of stacked layers (the text model's or the vision tower's)."""
    return str(path[0]) == "layers" or (str(path[0]) == "vision_tower" and str(path[1]) == "layers")


def export_name(name: str) -> str:
    """The name transformers writes for one of our HF names in a vision-language checkpoint."""
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    if name.startswith("model."):
        return "language_model." + name
    return name


def aliases(name: str) -> list[str]:
    """Other spellings of an HF tensor name to look for in a checkpoint."""
    out = []
    if name.startswith("vision_tower."):
        rest = name.removeprefix("vision_tower.")
        out = [f"vision_tower.vision_model.{rest}", f"model.vision_tower.{rest}",
               f"model.vision_tower.vision_model.{rest}"]
    elif name.startswith("multi_modal_projector."):
        out = ["model." + name]
    elif name == "lm_head.weight":
        out = ["language_model.lm_head.weight"]
    return out
