"""The supervised fine-tuning run: config -> data -> model (+LoRA/QLoRA) -> loss -> optimizer -> loop -> HF export.

Files under `output_dir`: `config.yaml` (the resolved config), `metrics.jsonl`, `tensorboard/`,
`checkpoints/<step>/` (Orbax; resumed from automatically when `trainer.resume`), `hf/` (the final model,
LoRA merged, with the tokenizer, loadable by `transformers`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

__all__ = ["TrainingDivergedError", "ResumeError", "SFTResult", "load_sft_config", "run_sft", "build_model"]


from posttrain.training.errors import ResumeError, TrainingDivergedError  # noqa: E402  (re-exported)


@dataclasses.dataclass
class SFTResult:
    """What a run did: per-step training losses (step, loss), last eval loss, where things were written."""

    output_dir: Path
    losses: list[tuple[int, float]]
    final_step: int
    start_step: int
    eval_loss: float | None
    hf_dir: Path | None
    checkpoint_dir: Path
    stats: dict[str, Any]
    trainer: Any = None


def load_sft_config(path: str | Path | None, overrides=()):
    """SFTConfig from a YAML file and `key=value` overrides (unknown keys are a ConfigError)."""
    from posttrain.config import load_config
    from posttrain.training.config import SFTConfig

    return load_config(SFTConfig, path, list(overrides))


def build_model(cfg, mesh=None):
    """Loads the configured checkpoint (streamed straight into its shards when a mesh is given) and attaches
    LoRA / QLoRA as configured; returns (model, folder)."""
    from posttrain.models import lora
    from posttrain.models.hf_io import from_pretrained
    from posttrain.models.hf_io import resolve_path
    from posttrain.models.tiny import resolve_model_path

    folder = resolve_path(resolve_model_path(cfg.model.path))  # a local folder, or a hub id downloaded
    m = cfg.model
    model = from_pretrained(folder, dtype=m.param_dtype, compute_dtype=m.compute_dtype or m.param_dtype, mesh=mesh,
                            scan_layers=m.scan_layers, remat=m.remat, attention_impl=m.attention_impl,
                            kernels=m.kernels)
    if cfg.lora.enabled:
        lora.attach(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, target=cfg.lora.target, seed=cfg.trainer.seed,
                    init=cfg.lora.init)
        if cfg.lora.quantize:
            lora.quantize_base(model, target=cfg.lora.target, qtype=cfg.lora.quantize,
                               block_size=cfg.lora.block_size)
    elif cfg.lora.quantize:
        from posttrain.config import ConfigError

        raise ConfigError("lora.quantize needs lora.enabled=true (a quantised base can only be trained through adapters)")
    return model, folder


def _eval_batches(cfg, tok, rows=None):
    from posttrain.data import build_sft_dataset

    d = cfg.data
    ds = build_sft_dataset(d.eval, tok, d.format, seq_len=d.seq_len, batch_size=d.batch_size, pack=d.pack,
                           shuffle=False, num_epochs=1, truncation=d.truncation, split=d.eval_split, batch_rows=rows)
    out = []
    for batch in ds:
        out.append(batch)
        if len(out) >= cfg.trainer.eval_batches:
            break
    return out


def run_sft(cfg, *, stop_after: int | None = None, batch_hook: Callable[[int, dict], dict] | None = None,
            log: Callable[[str], None] | None = None) -> SFTResult:
    """Runs (or resumes) SFT as `cfg` (an `SFTConfig`) says.

    stop_after: stop (with a checkpoint) once this many steps are done, as if interrupted; a later call
      with `trainer.resume` continues exactly from there.
    batch_hook(step, batch) -> batch: a test hook applied to every host batch (step counts from 1).
    """
    import jax
    import numpy as np

    from posttrain import distributed
    from posttrain import tokenizer as tokenizer_lib
    from posttrain.algorithms.sft import make_sft_loss
    from posttrain.config import save_config
    from posttrain.data import build_sft_dataset
    from posttrain.models import lora
    from posttrain.models.hf_io import resolve_path, save_pretrained
    from posttrain.models.tiny import resolve_model_path
    from posttrain.training.checkpoint import Checkpointer
    from posttrain.training.metrics import MetricsLogger, Throughput
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer, flops_per_token

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if distributed.is_primary():
        save_config(cfg, out / "config.yaml")
    tc, d = cfg.trainer, cfg.data
    if not d.train:
        from posttrain.config import ConfigError

        raise ConfigError("data.train is required (a .jsonl/.json/.parquet file, a datasets folder or a hub name)")
    if d.batch_size % tc.grad_accum:
        from posttrain.config import ConfigError

        raise ConfigError(f"data.batch_size={d.batch_size} must be divisible by trainer.grad_accum={tc.grad_accum}")

    mesh = None
    if jax.device_count() > 1:
        mesh = distributed.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)

    # Data first: a bad data set fails before any model is loaded.
    folder = resolve_path(resolve_model_path(cfg.model.path))  # a hub id is downloaded (a clear error offline)
    tok = tokenizer_lib.load(folder)
    rows = distributed.process_batch_rows(mesh, d.batch_size)  # this process's rows of every global batch
    train_ds = build_sft_dataset(d.train, tok, d.format, seq_len=d.seq_len, batch_size=d.batch_size, pack=d.pack,
                                 seed=d.seed, shuffle=d.shuffle, num_epochs=None, truncation=d.truncation,
                                 split=d.train_split, batch_rows=rows)
    eval_data = _eval_batches(cfg, tok, rows) if (d.eval and tc.eval_every > 0) else []
    model, folder = build_model(cfg, mesh)

    tx, schedule = make_optimizer(cfg.optim, tc.max_steps)
    loss_fn = make_sft_loss(tc.loss_chunk_size or None)
    trainer = Trainer(model, tx, loss_fn=loss_fn, grad_accum=tc.grad_accum, mesh=mesh, schedule=schedule,
                      seed=tc.seed, logprob_chunk_size=tc.loss_chunk_size or None, process_local_batches=True)
    del model

    ckpt = Checkpointer(out / "checkpoints", keep=tc.keep_checkpoints, async_save=tc.async_checkpointing, say=log)
    it = iter(train_ds)
    start = 0
    if tc.resume:
        try:
            meta = ckpt.restore_latest(trainer)
        except BaseException:
            ckpt.close()
            raise
        if meta is not None:
            if meta.get("data_state") is not None:
                it.set_state(meta["data_state"])
            start = trainer.step_count

    logger = MetricsLogger(out, total_steps=tc.max_steps, start_step=start, progress=tc.progress)
    say = log or logger.message
    say(f"sft: {folder} | {trainer.num_trainable:,} trained parameters"
        f"{' (LoRA)' if trainer.has_lora else ''} | {train_ds.num_rows} rows of {d.seq_len} tokens | "
        f"steps {start}->{tc.max_steps}" + (f" | resumed from step {start}" if start else ""))
    throughput = Throughput(flops_per_token=flops_per_token(trainer.cfg, d.seq_len) if trainer.cfg else 0.0,
                            peak_flops=tc.peak_flops * jax.device_count())
    losses: list[tuple[int, float]] = []
    eval_loss = None
    end = tc.max_steps if stop_after is None else min(tc.max_steps, stop_after)
    last_saved = ckpt.latest_step()

    def run_eval() -> float:
        tot, w = 0.0, 0.0
        for b in eval_data:
            ls, ww = trainer.eval_step(b)
            tot, w = tot + ls, w + ww
        return tot / max(w, 1e-12)

    try:
        for step in range(start + 1, end + 1):
            batch = next(it)
            if batch_hook is not None:
                batch = batch_hook(step, batch)
            metrics = trainer.step(batch)
            losses.append((step, metrics["loss"]))
            throughput.add(metrics["tokens"], float(np.prod(np.shape(batch["input_ids"]))) * jax.process_count())
            if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
                logger.log(step, metrics)
                raise TrainingDivergedError.at(step, metrics["loss"], metrics["grad_norm"], ckpt)
            record = None
            if step == start + 1:  # the first step includes compilation: report it, keep it out of tokens/s
                record = dict(metrics, first_step_time=throughput.summary()["step_time"])
            elif step % tc.log_every == 0 or step == end:
                record = dict(metrics, **throughput.summary())
            if eval_data and (step % tc.eval_every == 0 or step == tc.max_steps):
                eval_loss = run_eval()
                record = dict(record or metrics, eval_loss=eval_loss)
            if record is not None:
                logger.log(step, record)
            logger.advance(step)
            if (tc.save_every > 0 and step % tc.save_every == 0) or step == end:
                ckpt.save(trainer, data_state=it.get_state(), metadata={"loss": metrics["loss"]})
                last_saved = step
        final = trainer.step_count
        if last_saved != final and final > 0 and final != start:
            ckpt.save(trainer, data_state=it.get_state())
        ckpt.wait()
    finally:
        logger.close()
        ckpt.close()

    hf_dir = None
    if cfg.export_hf and trainer.step_count >= tc.max_steps:
        model = trainer.model()
        lora.merge(model)
        hf_dir = save_pretrained(model, out / "hf", tokenizer=tok, dtype=cfg.export_dtype)
        say(f"sft: exported {hf_dir}")
    return SFTResult(output_dir=out, losses=losses, final_step=trainer.step_count, start_step=start,
                     eval_loss=eval_loss, hf_dir=hf_dir, checkpoint_dir=ckpt.directory, stats=dict(train_ds.stats),
                     trainer=trainer)
