"""posttrain: a JAX-native post-training stack (SFT, LoRA/QLoRA, DPO, distillation, GRPO-family RL)."""

__version__ = "0.1.0"

import os as _os

# transformers prints "PyTorch was not found..." (an advisory warning) on import; posttrain needs only its
# tokenizers and configs, which work without torch.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
