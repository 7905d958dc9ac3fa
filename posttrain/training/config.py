"""Typed config sections of a training run (model, data, optim, trainer, lora, mesh) and the SFT run config.

Built from YAML plus `key=value` overrides with `posttrain.config.load_config(SFTConfig, path, overrides)`;
unknown keys are rejected with the list of valid ones. DPO, distillation and RL configs reuse the sections.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from posttrain.data.formats import DataFormatConfig

__all__ = [
    "ModelSection",
    "DataSection",
    "OptimConfig",
    "TrainerConfig",
    "LoraConfig",
    "MeshConfig",
    "DistributedConfig",
    "SFTConfig",
]

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass
class ModelSection:
    """Which checkpoint to start from and its numerics.

    path: a Hugging Face folder, a hub id, or `tiny:<family>` (a small random model built on demand).
    param_dtype: dtype of the weights held (and trained: the float32 master copy with bf16 compute).
    compute_dtype: dtype of activations and matmuls (None = param_dtype).
    kernels: the backend's kernel set (`posttrain.models.kernels`): auto = cpu on JAX's CPU backend, generic
      (plain products, fused attention, accelerator cache layout) elsewhere.
    """

    path: str = "tiny:llama"
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype | None = None
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    scan_layers: bool = True
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    kernels: Literal["auto", "generic", "cpu"] = "auto"


@dataclasses.dataclass
class DataSection:
    """Training and validation data: sources, record format, sequence packing and batching.

    batch_size is the global batch (rows per optimizer step, before gradient accumulation splits it).
    """

    train: str = ""
    eval: str | None = None
    train_split: str | None = None
    eval_split: str | None = None
    format: DataFormatConfig = dataclasses.field(default_factory=DataFormatConfig)
    seq_len: int = 512
    batch_size: int = 8
    pack: bool = True
    shuffle: bool = True
    seed: int = 0
    truncation: Literal["right", "drop"] = "right"

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, found {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, found {self.batch_size}")


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule.

    Schedule: linear warm-up from 0 to `lr` over `warmup_steps`, then `decay` (cosine | linear |
    constant) down to `lr * min_lr_ratio` at the last step. Weight decay skips norms, biases and (unless
    `decay_embeddings`) the embedding table. `clip_norm` <= 0 disables global-norm clipping.
    """

    name: Literal["adamw", "sgd", "adafactor"] = "adamw"
    lr: float = 1e-4
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    decay_embeddings: bool = False
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    clip_norm: float = 1.0

    def __post_init__(self):
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0, found {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, found {self.warmup_steps}")


@dataclasses.dataclass
class TrainerConfig:
    """The loop: steps, accumulation, logging, evaluation, checkpoints.

    grad_accum splits every global batch into that many micro-batches inside the jitted step.
    loss_chunk_size: tokens per chunk of the vocabulary projection in the loss (0 = whole logits at once).
    peak_flops: peak FLOP/s of one device for the MFU estimate (times the device count; 0 = no MFU).
    save_every: steps between checkpoints (0 = only at the end).
    resume: continue from the newest checkpoint in OUTPUT_DIR/checkpoints that restores, when there is one.
    """

    max_steps: int = 100
    grad_accum: int = 1
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 8
    save_every: int = 100
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    resume: bool = True
    seed: int = 0
    loss_chunk_size: int = 0
    peak_flops: float = 0.0
    progress: bool = True

    def __post_init__(self):
        if self.max_steps < 1:
            raise ValueError(f"trainer.max_steps must be >= 1, found {self.max_steps}")
        if self.grad_accum < 1:
            raise ValueError(f"trainer.grad_accum must be >= 1, found {self.grad_accum}")
        if self.log_every < 1:
            raise ValueError(f"trainer.log_every must be >= 1, found {self.log_every}")


@dataclasses.dataclass
class LoraConfig:
    """LoRA / QLoRA adapters (off unless `enabled`).

    target: regular expression over dotted module paths (full match), e.g. `.*(q_proj|v_proj)`.
    quantize: "nf4" stores the targeted base kernels in 4-bit NormalFloat (QLoRA), blocks of `block_size`.
    """

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    target: str = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    init: Literal["kaiming", "gaussian"] = "kaiming"
    quantize: Literal["nf4"] | None = None
    block_size: int = 64


@dataclasses.dataclass
class MeshConfig:
    """Device mesh sizes (data x fsdp x tensor); one may be -1 = all remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1


@dataclasses.dataclass
class DistributedConfig:
    """Multi-host runs (JAX multi-controller): one process per host, all running the same command.

    Unset fields come from the environment (`POSTTRAIN_COORDINATOR` or `JAX_COORDINATOR_ADDRESS`,
    `POSTTRAIN_NUM_PROCESSES`, `POSTTRAIN_PROCESS_ID`), then from JAX's cluster detection (TPU pod slices,
    SLURM, Open MPI) when `auto_detect`; with none of them the run is one process.
    coordinator: host:port of process 0 (every process names the same one).
    init_timeout_s: how long a process waits for all the others to reach the coordinator.
    heartbeat_timeout_s: a process that stops answering for this long (killed, host lost) ends the run on
      every other process with an error; restarting all of them resumes from the last checkpoint.
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto_detect: bool = True
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 60

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1, found {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"distributed.process_id must be >= 0, found {self.process_id}")
        if self.init_timeout_s < 1 or self.heartbeat_timeout_s < 2:
            raise ValueError("distributed.init_timeout_s must be >= 1 and distributed.heartbeat_timeout_s >= 2")


@dataclasses.dataclass
class SFTConfig:
    """Supervised fine-tuning run: everything `posttrain sft CONFIG.yaml` needs."""

    output_dir: str = "outputs/sft"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    export_hf: bool = True
    export_dtype: Dtype | None = None
