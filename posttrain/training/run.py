"""The run skeleton every training command composes: output folder, lock, mesh, model, trainer, checkpoints,
logs, the supervised step loop and the HF export. A command (sft, dpo, distill, rl) is its data, its loss
and its few special steps on top of one `Run`.

    run = Run(cfg, "sft")                         # lock OUTPUT_DIR, write config.yaml, build the mesh
    tok = run.tokenizer()                         # from the configured checkpoint (data before the model)
    trainer = run.build_trainer(loss_fn)          # model (+LoRA/QLoRA), optimizer + schedule, Trainer
    start = run.restore(data_iter)                # newest checkpoint that restores; the data position too
    run.open_logger(start)                        # metrics.jsonl (rows after `start` dropped), TensorBoard
                                                  # (and trainer.profile's trace: run.profiler)
    result = run.fit(data_iter, start, ...)       # or a command's own loop: run.check_finite / run.save
    run.export_hf()                               # OUTPUT_DIR/hf, LoRA merged
    run.close()                                   # logs, checkpoint writes, the lock

`Run` is a context manager: `with Run(cfg, "dpo") as run: ...` closes it (and releases the lock) on any
exit.

Multi-host (one process per host, all running the same command): `Run` first joins the processes
(`distributed.initialize` from the config's `distributed` section, the environment or the cluster) before
anything touches a device, checks that every process resolved the same config, builds the mesh over all
processes' devices and writes config.yaml once; `batch_rows` are this process's rows of each global batch
(with `build_trainer(process_local_batches=True)` the trainer assembles them); the logger, samples and the
HF export write on process 0, checkpoints on all. The command ends with `distributed.finish()` (the CLI). The config is
any `RunConfig` (`posttrain.training.config`: output_dir, model, optim, trainer, lora, mesh, distributed, export_hf,
export_dtype); config.yaml is written whole. A config's `compile` section (`posttrain.compile_cache.CompileConfig`:
the GPU autotune level) is applied first, before JAX's backend starts.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np
from flax import nnx

from posttrain import compile_cache, distributed
from posttrain.config import ConfigError, save_config
from posttrain.models import lora as lora_lib
from posttrain.models import tokenizer as tokenizer_lib
from posttrain.models.hf_io import from_pretrained, save_pretrained
from posttrain.models.spec import resolve_checkpoint
from posttrain.training.checkpoint import Checkpointer
from posttrain.training.config import LoraConfig, ModelSection, RunConfig
from posttrain.training.errors import TrainingDivergedError
from posttrain.training.metrics import MetricsLogger, Throughput
from posttrain.training.optim import make_optimizer
from posttrain.training.profile import StepProfiler
from posttrain.training.runlock import RunLock
from posttrain.training.trainer import Trainer, flops_per_token

VISION_TOWER = "vision_tower"  # a vision-language model's vision tower attribute (posttrain.models)

__all__ = ["Run", "FitResult", "build_model", "frozen_copy"]


def frozen_copy(model: ModelSection, mesh=None, path: str | None = None):
    """The checkpoint at `path` (default: `model.path`; a hub id is downloaded) with the section's numerics and
    no adapters, streamed straight into its shards when a mesh is given: a run's reference policy or teacher,
    and what `build_model` attaches adapters to; returns (model, folder)."""
    folder = resolve_checkpoint(path or model.path)  # a local folder, or a hub id downloaded
    m = model
    return from_pretrained(folder, dtype=m.param_dtype, compute_dtype=m.compute_dtype or m.param_dtype, mesh=mesh,
                           scan_layers=m.scan_layers, remat=m.remat, attention_impl=m.attention_impl,
                           kernels=m.kernels), folder


def build_model(model: ModelSection, lora: LoraConfig, seed: int, mesh=None):
    """The trained model: the configured checkpoint (`frozen_copy`) with LoRA / QLoRA attached as `lora` says
    (adapters initialised from `seed`); returns (model, folder)."""
    if lora.quantize and not lora.enabled:
        raise ConfigError("lora.quantize needs lora.enabled=true (a quantised base can only be trained through adapters)")
    net, folder = frozen_copy(model, mesh)
    if lora.enabled:
        target = lora_target(net, lora)
        lora_lib.attach(net, rank=lora.rank, alpha=lora.alpha, target=target, seed=seed, init=lora.init)
        if lora.quantize:
            lora_lib.quantize_base(net, target=target, qtype=lora.quantize, block_size=lora.block_size)
    return net, folder


def lora_target(net, lora: LoraConfig) -> str:
    """The LoRA target pattern: `lora.target`, kept off a vision-language model's vision tower unless
    `lora.vision`."""
    if getattr(net, "vision_tower", None) is None or lora.vision:
        return lora.target
    return rf"(?!{VISION_TOWER}\.)(?:{lora.target})"


def trained_variables(net, model: ModelSection):
    """Which variables the trainer trains: LoRA adapters when attached, else every parameter, less a
    vision-language model's vision tower when `model.freeze_vision` (it then has no gradient and no optimizer
    state; the projector and decoder train)."""
    kind = nnx.LoRAParam if lora_lib.has_lora(net) else nnx.Param
    if getattr(net, "vision_tower", None) is None or not model.freeze_vision or kind is nnx.LoRAParam:
        return kind
    return nnx.All(kind, nnx.Not(nnx.PathContains(VISION_TOWER)))


@dataclasses.dataclass
class FitResult:
    """What `Run.fit` did: per-step training losses (step, loss), the last evaluation's metrics, the steps."""

    losses: list[tuple[int, float]]
    last_eval: dict[str, float]
    start_step: int
    final_step: int
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)


class Run:
    """The set-up and bookkeeping shared by every training command (see the module docstring).

    Args:
      cfg: the run's typed config (a `RunConfig`: the shared sections, and the command's own, written to config.yaml).
      command: the command's name ("sft", "dpo", ...): the progress bar's label and the messages' prefix.
      log: where messages go (default: the metrics logger's console, or print before it is open).
      lock: take the output folder's run lock (`posttrain.training.runlock`) for the run's lifetime.
    """

    def __init__(self, cfg: RunConfig, command: str, *, log: Callable[[str], None] | None = None, lock: bool = True):
        self.cfg = cfg
        self.command = command
        self._log = log
        self.logger = None
        # before anything touches a device: XLA reads its flags when JAX's backend starts
        self._compile_settings(getattr(cfg, "compile", None))
        # before anything touches a device (the lock names its process): a no-op on one process
        distributed.initialize(cfg.distributed)
        distributed.check_same_config(cfg)
        self.out = Path(cfg.output_dir)
        self.lock = RunLock(self.out).acquire() if lock else None
        self.trainer = None
        self.ckpt = None
        self.tok = None
        self.folder: Path | None = None
        self.start_step = 0
        self.last_saved: int | None = None
        # trainer.profile: a jax.profiler trace of a window of steps into OUTPUT_DIR/tensorboard (fit and the RL loop)
        self.profiler = StepProfiler(cfg.trainer.profile, self.out / "tensorboard", say=self.say)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            if distributed.is_primary():
                save_config(cfg, self.out / "config.yaml")
            self.mesh = self._make_mesh()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ set-up
    def _compile_settings(self, section: compile_cache.CompileConfig | None) -> None:
        """Applies the config's `compile` section (`posttrain.compile_cache.CompileConfig`), saying so when it
        cannot (JAX's backend started earlier in this process, or XLA_FLAGS set the level at launch)."""
        if section is not None and not compile_cache.configure(section):
            self.say(f"{self.command}: compile.gpu_autotune_level={section.gpu_autotune_level} not applied: XLA "
                     "already started with another level in this process, or XLA_FLAGS sets it (which wins)")

    def _make_mesh(self):
        if jax.device_count() == 1:
            return None
        m = self.cfg.mesh
        return distributed.make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor)

    def batch_rows(self, batch_size: int) -> list[int] | None:
        """This process's rows of every global batch of `batch_size` rows (None: all, one process)."""
        return distributed.process_batch_rows(self.mesh, batch_size)

    def local_rows(self, batch: dict, rows: list[int] | None) -> dict:
        """This process's `rows` (`batch_rows`) of a whole global batch (all of it on one process)."""
        return batch if rows is None else {k: np.asarray(v)[rows] for k, v in batch.items()}

    def say(self, text: str) -> None:
        if self._log is not None:
            self._log(text)
        elif self.logger is not None:
            self.logger.message(text)
        else:
            print(text, flush=True)

    def model_folder(self) -> Path:
        """The configured checkpoint's local folder (a hub id is downloaded: a clear error offline)."""
        if self.folder is None:
            self.folder = resolve_checkpoint(self.cfg.model.path)
        return self.folder

    def tokenizer(self):
        """The checkpoint's tokenizer (loaded once): data can be encoded and checked before any model loads."""
        if self.tok is None:
            self.tok = tokenizer_lib.load(self.model_folder())
        return self.tok

    def build_trainer(self, loss_fn=None, *, updates: int | None = None, **trainer_kwargs):
        """The model (+LoRA/QLoRA), the optimizer and schedule over `updates` optimizer steps (default
        trainer.max_steps) and the `Trainer`; also opens the checkpoint folder."""
        tc = self.cfg.trainer
        model, self.folder = build_model(self.cfg.model, self.cfg.lora, tc.seed, self.mesh)
        tx, schedule = make_optimizer(self.cfg.optim, updates or tc.max_steps)
        trainer_kwargs.setdefault("wrt", trained_variables(model, self.cfg.model))
        self.trainer = Trainer(model, tx, loss_fn=loss_fn, grad_accum=tc.grad_accum, mesh=self.mesh, schedule=schedule,
                               seed=tc.seed, logprob_chunk_size=tc.loss_chunk_size or None, **trainer_kwargs)
        self.ckpt = Checkpointer(self.out / "checkpoints", keep=tc.keep_checkpoints,
                                 async_save=tc.async_checkpointing, say=self._log)
        return self.trainer

    def frozen_model(self, path: str | None = None):
        """A frozen model on this run's mesh (see `frozen_copy`): a reference policy or a teacher."""
        return frozen_copy(self.cfg.model, self.mesh, path)[0]

    # ------------------------------------------------------------------ resume, logs, checkpoints
    def restore(self, data_iter=None) -> dict[str, Any] | None:
        """Restores the newest checkpoint that restores when `trainer.resume` (and the data iterator's
        position when the checkpoint has one and `data_iter` is given); sets `start_step` (the trainer's
        step) and returns the checkpoint's meta (None on a fresh start)."""
        meta = self.ckpt.restore_latest(self.trainer) if self.cfg.trainer.resume else None
        if meta is not None:
            if data_iter is not None and meta.get("data_state") is not None:
                data_iter.set_state(meta["data_state"])
            self.start_step = self.trainer.step_count
        self.last_saved = self.ckpt.latest_step()
        return meta

    def open_logger(self, start: int | None = None, *, description: str | None = None,
                    row_files: tuple[str, ...] = ("samples.jsonl",)):
        """metrics.jsonl + TensorBoard + progress bar; rows of steps after `start` are dropped (they run again)."""
        start = self.start_step if start is None else start
        tc = self.cfg.trainer
        self.logger = MetricsLogger(self.out, total_steps=tc.max_steps, start_step=start, progress=tc.progress,
                                    description=description or ("train" if self.command == "sft" else self.command),
                                    row_files=row_files)
        return self.logger

    def check_finite(self, step: int, metrics: dict[str, float], *, grad_norm: bool = True, log: bool = True) -> None:
        """Raises `TrainingDivergedError` (after logging the step when `log`) when the loss (or, with `grad_norm`,
        the gradient norm) is not finite."""
        gn = metrics.get("grad_norm")
        bad = not math.isfinite(metrics["loss"]) or (grad_norm and gn is not None and not math.isfinite(gn))
        if bad:
            if log and self.logger is not None:
                self.logger.log(step, metrics)
            raise TrainingDivergedError.at(step, metrics["loss"], gn, self.ckpt)

    def save(self, *, data_state: dict | None = None, metadata: dict | None = None) -> bool:
        """Checkpoints the trainer (and the data position) unless this step is already saved; True if saved."""
        step = self.trainer.step_count
        if self.last_saved == step or self.ckpt.latest_step() == step:
            return False
        self.ckpt.save(self.trainer, data_state=data_state, metadata=metadata)
        self.last_saved = self.trainer.step_count
        return True

    def export_hf(self, *, tokenizer=None, quiet: bool = False, prompt_style=None) -> Path | None:
        """The final model (LoRA merged, QLoRA dequantised) as a Hugging Face folder OUTPUT_DIR/hf, when
        `export_hf`; None otherwise. `prompt_style`: how the run's data prompted the model
        (`posttrain.models.prompt_format`), written into the export as the default of chat, generate and eval."""
        if not self.cfg.export_hf:
            return None
        model = lora_lib.merge(self.trainer.model())
        hf_dir = save_pretrained(model, self.out / "hf", tokenizer=tokenizer or self.tok, dtype=self.cfg.export_dtype,
                                 prompt_style=prompt_style)
        if not quiet:
            self.say(f"{self.command}: exported {hf_dir}")
        return hf_dir

    # ------------------------------------------------------------------ the supervised loop
    def fit(self, data_iter: Iterator[dict], *, loss_fn=None, evaluate: Callable[[], dict[str, float]] | None = None,
            stop_after: int | None = None, batch_hook: Callable[[int, dict], dict] | None = None,
            seq_len: int | None = None, step_kwargs: dict | None = None,
            evaluate_at_start: bool = False) -> FitResult:
        """The step loop of a supervised command (sft, dpo, distill): batch -> trainer.step -> divergence
        check -> logs (throughput, MFU) -> periodic evaluation -> periodic checkpoint (with the data
        position), from `start_step + 1` to trainer.max_steps (or `stop_after`, as if interrupted).

        evaluate() -> metrics (named eval_*/eval/*) runs every trainer.eval_every steps and at the last step
        (and, with `evaluate_at_start`, before the first step of a fresh run, logged as step 0).
        batch_hook(step, batch) -> batch: applied to every host batch (tests). step_kwargs: passed to
        `trainer.step` (e.g. rows_per_example).
        """
        tc, trainer, logger = self.cfg.trainer, self.trainer, self.logger
        start = self.start_step
        throughput = Throughput(flops_per_token=flops_per_token(trainer.cfg, seq_len) if (trainer.cfg and seq_len)
                                else 0.0, peak_flops=tc.peak_flops * jax.device_count())
        losses: list[tuple[int, float]] = []
        last_eval: dict[str, float] = {}
        end = tc.max_steps if stop_after is None else min(tc.max_steps, stop_after)
        step_kwargs = step_kwargs or {}
        if evaluate is not None and evaluate_at_start and start == 0 and end > 0:
            last_eval = dict(evaluate())
            logger.log(0, last_eval)
            throughput.reset()  # the baseline evaluation is not step time
        for step in range(start + 1, end + 1):
            self.profiler.begin(step)
            batch = next(data_iter)
            if batch_hook is not None:
                batch = batch_hook(step, batch)
            metrics = trainer.step(batch, loss_fn, **step_kwargs)
            losses.append((step, metrics["loss"]))
            # processed tokens of the global batch (a multi-host process holds its rows of it)
            throughput.add(metrics["tokens"], float(np.prod(np.shape(batch["input_ids"])))
                           * (jax.process_count() if trainer.process_local_batches else 1))
            self.check_finite(step, metrics)
            record = None
            if step == start + 1:  # the first step includes compilation: report it, keep it out of tokens/s
                record = dict(metrics, first_step_time=throughput.summary()["step_time"])
            elif step % tc.log_every == 0 or step == end:
                record = dict(metrics, **throughput.summary())
            if evaluate is not None and tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.max_steps):
                last_eval = dict(evaluate())
                record = dict(record or metrics, **last_eval)
            if record is not None:
                logger.log(step, record)
            logger.advance(step)
            if (tc.save_every > 0 and step % tc.save_every == 0) or step == end:
                self.save(data_state=data_iter.get_state(), metadata={"loss": metrics["loss"]})
            self.profiler.end(step)
        final = trainer.step_count
        if self.last_saved != final and final > 0 and final != start:
            self.save(data_state=data_iter.get_state())
        self.ckpt.wait()
        return FitResult(losses=losses, last_eval=last_eval, start_step=start, final_step=trainer.step_count)

    @property
    def finished(self) -> bool:
        return self.trainer is not None and self.trainer.step_count >= self.cfg.trainer.max_steps

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Closes the logs, waits for checkpoint writes (bounded) and releases the lock; safe to call twice."""
        try:
            self.profiler.close()
            if self.logger is not None:
                self.logger.close()
            if self.ckpt is not None:
                self.ckpt.close()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None
