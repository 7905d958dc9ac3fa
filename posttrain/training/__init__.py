"""The shared trainer core: train state, jit step with gradient accumulation, optimizers, checkpoints, metrics, the run
skeleton every command composes (`posttrain.training.run.Run`), SFT.

Heavy modules (JAX) load on first attribute access, so importing the config classes stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Trainer": "posttrain.training.trainer",
    "LossFn": "posttrain.algorithms.protocol",
    "flops_per_token": "posttrain.training.trainer",
    "reduce_metrics": "posttrain.algorithms.protocol",
    "uses_frozen": "posttrain.algorithms.protocol",
    "UsesFrozen": "posttrain.algorithms.protocol",
    "Run": "posttrain.training.run",
    "FitResult": "posttrain.training.run",
    "build_model": "posttrain.training.run",
    "frozen_copy": "posttrain.training.run",
    "make_optimizer": "posttrain.training.optim",
    "make_schedule": "posttrain.training.optim",
    "decay_mask": "posttrain.training.optim",
    "Checkpointer": "posttrain.training.checkpoint",
    "MetricsLogger": "posttrain.training.metrics",
    "Throughput": "posttrain.training.metrics",
    "run_sft": "posttrain.training.sft",
    "load_sft_config": "posttrain.training.sft",
    "TrainingDivergedError": "posttrain.training.sft",
    "ResumeError": "posttrain.training.sft",
    "SFTResult": "posttrain.training.sft",
    "SFTConfig": "posttrain.training.config",
    "ModelSection": "posttrain.training.config",
    "DataSection": "posttrain.training.config",
    "OptimConfig": "posttrain.training.config",
    "TrainerConfig": "posttrain.training.config",
    "LoraConfig": "posttrain.training.config",
    "MeshConfig": "posttrain.training.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posttrain.training' has no attribute {name!r}")
