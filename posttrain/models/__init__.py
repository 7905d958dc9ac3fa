"""posttrain.models: one Flax NNX decoder-only Transformer for Llama, Qwen2/3, Mistral and Gemma 2/3 (Gemma 3 also
with its SigLIP vision tower: `ModelConfig.vision`) and the mixtures of experts Qwen3-MoE, Mixtral and Qwen2-MoE
(`posttrain.models.moe`), with HF I/O."""

from posttrain.models.attention import KVCache
from posttrain.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeConfig, UnsupportedModelError
from posttrain.models.transformer import Transformer, init_model
from posttrain.models.vision_config import VisionConfig

__all__ = [
    "KVCache",
    "ModelConfig",
    "RopeConfig",
    "SUPPORTED_MODEL_TYPES",
    "Transformer",
    "UnsupportedModelError",
    "VisionConfig",
    "init_model",
]

from posttrain.models.hf_io import CheckpointError, from_pretrained, load_config, save_pretrained  # noqa: E402

__all__ += ["CheckpointError", "from_pretrained", "load_config", "save_pretrained"]
