"""The supervised fine-tuning run: config -> data -> model (+LoRA/QLoRA) -> loss -> optimizer -> loop -> HF export.

Files under `output_dir`: `config.yaml` (the resolved config), `metrics.jsonl`, `tensorboard/`,
`checkpoints/<step>/` (Orbax; resumed from automatically when `trainer.resume`), `hf/` (the final model,
LoRA merged, with the tokenizer, loadable by `transformers`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

__all__ = ["TrainingDivergedError", "ResumeError", "SFTResult", "load_sft_config", "run_sft", "build_model", "eval_batches"]


from posttrain.algorithms.sft import make_sft_loss  # noqa: E402
from posttrain.config import ConfigError, load_config  # noqa: E402
from posttrain.data import build_sft_dataset  # noqa: E402
from posttrain.data.pipeline import too_long_warning  # noqa: E402
from posttrain.data.vlm import VisionSpec  # noqa: E402
from posttrain.models.moe_loss import RouterLoss
from posttrain.training.config import DataSection, SFTConfig  # noqa: E402
from posttrain.training.errors import ResumeError, TrainingDivergedError  # noqa: E402  (re-exported)
from posttrain.training.run import Run, build_model  # noqa: E402  (build_model re-exported)


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


def load_sft_config(path: str | Path | None, overrides=()) -> SFTConfig:
    """SFTConfig from a YAML file and `key=value` overrides (unknown keys are a ConfigError)."""
    return load_config(SFTConfig, path, list(overrides))


def eval_batches(d: DataSection, n: int, tok, rows=None, vision=None) -> list[dict]:
    """The first `n` (trainer.eval_batches) batches of the SFT-format eval split of `d` (`rows`: this process's
    rows; `vision`: the model's `VisionSpec` for image data)."""
    ds = build_sft_dataset(d.eval, tok, d.format, seq_len=d.seq_len, batch_size=d.batch_size, pack=d.pack,
                           shuffle=False, num_epochs=1, truncation=d.truncation, split=d.eval_split, batch_rows=rows,
                           vision=vision)
    out = []
    for batch in ds:
        out.append(batch)
        if len(out) >= n:
            break
    return out


def run_sft(cfg: SFTConfig, *, stop_after: int | None = None, batch_hook: Callable[[int, dict], dict] | None = None,
            log: Callable[[str], None] | None = None) -> SFTResult:
    """Runs (or resumes) SFT as `cfg` (an `SFTConfig`) says, on the shared run skeleton (`Run`).

    stop_after: stop (with a checkpoint) once this many steps are done, as if interrupted; a later call
      with `trainer.resume` continues exactly from there.
    batch_hook(step, batch) -> batch: a test hook applied to every host batch (step counts from 1).
    """
    tc, d = cfg.trainer, cfg.data
    if not d.train:
        raise ConfigError("data.train is required (a .jsonl/.json/.parquet file, a datasets folder or a hub name)")
    if d.batch_size % tc.grad_accum:
        raise ConfigError(f"data.batch_size={d.batch_size} must be divisible by trainer.grad_accum={tc.grad_accum}")

    with Run(cfg, "sft", log=log) as run:
        # Data first: a bad data set fails before any model is loaded.
        tok = run.tokenizer()
        vision = VisionSpec.from_checkpoint(run.model_folder(), tok)  # None for a text-only model
        rows = run.batch_rows(d.batch_size)  # multi-host: this process's rows of every global batch
        train_ds = build_sft_dataset(d.train, tok, d.format, seq_len=d.seq_len, batch_size=d.batch_size,
                                     pack=d.pack, seed=d.seed, shuffle=d.shuffle, num_epochs=None,
                                     truncation=d.truncation, split=d.train_split, batch_rows=rows, vision=vision)
        if (warning := too_long_warning(train_ds.stats, d.seq_len)) is not None:
            run.say(f"warning: data.train: {warning}")
        eval_data = eval_batches(d, tc.eval_batches, tok, rows, vision) if (d.eval and tc.eval_every > 0) else []
        trainer = run.build_trainer(make_sft_loss(tc.loss_chunk_size or None, RouterLoss(**dataclasses.asdict(cfg.moe))),
                                    process_local_batches=True)
        it = iter(train_ds)
        run.restore(it)
        start = run.start_step
        run.open_logger(start)
        run.say(f"sft: {run.folder} | {trainer.num_trainable:,} trained parameters"
                f"{' (LoRA)' if trainer.has_lora else ''} | {train_ds.num_rows} rows of {d.seq_len} tokens | "
                f"steps {start}->{tc.max_steps}" + (f" | resumed from step {start}" if start else ""))

        def evaluate() -> dict[str, float]:
            tot, w = 0.0, 0.0
            for b in eval_data:
                ls, ww = trainer.eval_step(b)
                tot, w = tot + ls, w + ww
            return {"eval_loss": tot / max(w, 1e-12)}

        fit = run.fit(it, evaluate=evaluate if eval_data else None, stop_after=stop_after, batch_hook=batch_hook,
                      seq_len=d.seq_len)
        run.logger.close()
        hf_dir = run.export_hf(prompt_style=train_ds.prompt_style) if run.finished else None
    return SFTResult(output_dir=run.out, losses=fit.losses, final_step=trainer.step_count, start_step=start,
                     eval_loss=fit.last_eval.get("eval_loss"), hf_dir=hf_dir, checkpoint_dir=run.ckpt.directory,
                     stats=dict(train_ds.stats), trainer=trainer)
