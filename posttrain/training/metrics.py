"""Run metrics: `OUTPUT_DIR/metrics.jsonl` (one JSON object per logged step), TensorBoard, a rich progress bar.

Throughput and MFU are measured over the steps between two log points (wall-clock time per step window;
the SFT loop keeps the first step, which includes compilation, out of it and logs it as first_step_time):
tokens/s counts real (non-padding) tokens; MFU = flops_per_token * processed tokens / (time * peak_flops)
with `posttrain.training.trainer.flops_per_token` (6 N + 12 L H Q T) and processed tokens = batch * seq_len.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["MetricsLogger", "Throughput", "truncate_after"]


class Throughput:
    """Accumulates tokens between log points and turns them into tokens/s, step time and MFU."""

    def __init__(self, *, flops_per_token: float = 0.0, peak_flops: float = 0.0):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.steps = 0
        self.tokens = 0.0
        self.processed = 0.0

    def add(self, tokens: float, processed: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.processed += processed

    def summary(self) -> dict[str, float]:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"tokens_per_sec": self.tokens / dt, "step_time": dt / max(self.steps, 1)}
        if self.flops_per_token and self.peak_flops:
            out["mfu"] = self.flops_per_token * self.processed / dt / self.peak_flops
        self.reset()
        return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": valid JSON, still readable
    return v


def truncate_after(path: str | Path, step: int) -> int:
    """Drops the JSONL records of `path` logged for steps after `step` (and lines cut short by a crash).

    `step` is where the run (re)starts: records after it were written by a run that did not checkpoint
    them and will be written again. Returns how many lines were dropped.
    """
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                keep.append(line)
                continue
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            pass
        dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
        tmp.replace(path)
    return dropped


# Progress-bar fields, shown when a record has them (GRPO's loss is ~0 by construction: show reward). RL's reward and
# accuracy are the step's training batch's (its rollouts), named so, apart from the held-out accuracy of evaluations.
PROGRESS_FIELDS = (("reward/mean", "batch reward", "{:.3f}"), ("accuracy", "batch reward accuracy", "{:.3f}"),
                   ("loss", "loss", "{:.4f}"))


def _summary_writer(folder: Path):
    """A tensorboardX `SummaryWriter` (scalars only). tensorboardX imports torch wherever it is installed, only to
    accept torch tensors, which are never passed here: that import (seconds per process) is kept out when torch is
    not loaded yet."""
    import sys

    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's own fallback
    try:
        from tensorboardX import SummaryWriter  # lazy: only when TensorBoard logs are written
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter(str(folder))


class MetricsLogger:
    """Writes metrics to metrics.jsonl and TensorBoard (`OUTPUT_DIR/tensorboard/`), and drives a progress bar.

    A run that starts at `start_step` (a resume; 0 for a fresh start) first drops the rows of later steps
    from metrics.jsonl and from the other `row_files` (e.g. samples.jsonl): they are written again.
    In a multi-host run only process 0 writes (and shows progress); on the others every method does nothing.
    """

    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, description: str = "train", row_files: tuple[str, ...] = ("samples.jsonl",)):
        self.output_dir = Path(output_dir)
        self.writer = self.progress = self.jsonl = None
        if jax.process_index() != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # A fresh start (step 0) drops every row, step-0 evaluations included: they are run again too.
        for name in ("metrics.jsonl", *row_files):
            truncate_after(self.output_dir / name, start_step if start_step > 0 else -1)
        self.jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            self.writer = _summary_writer(self.output_dir / "tensorboard")
        if progress:
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task(description, total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        record = {"step": int(step), **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                tag = k if "/" in k else (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}")
                self.writer.add_scalar(tag, float(v), int(step))
            self.writer.flush()
        if self.progress is not None:
            info = [f"{label} {fmt.format(float(metrics[k]))}" for k, label, fmt in PROGRESS_FIELDS if k in metrics]
            if "reward/mean" in metrics:
                info = [x for x in info if not x.startswith("loss")]
            if info:
                self.progress.update(self.task, info=", ".join(info))

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
        if self.jsonl is None:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.jsonl is not None and not self.jsonl.closed:
            self.jsonl.close()

