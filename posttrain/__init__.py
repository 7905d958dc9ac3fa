"""posttrain: a JAX-native post-training stack (SFT, LoRA/QLoRA, DPO, distillation, GRPO-family RL)."""

__version__ = "0.1.0"
