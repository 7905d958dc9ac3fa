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

__all__ = ["MetricsLogger", "Throughput"]


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


class MetricsLogger:
    """Writes metrics to metrics.jsonl and TensorBoard (`OUTPUT_DIR/tensorboard/`), and drives a progress bar."""

    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, description: str = "train"):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))
        self.progress = None
        if progress:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task(description, total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": int(step), **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                tag = k if "/" in k else (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}")
                self.writer.add_scalar(tag, float(v), int(step))
            self.writer.flush()
        if self.progress is not None and "loss" in metrics:
            self.progress.update(self.task, info=f"loss {float(metrics['loss']):.4f}")

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
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
        if not self.jsonl.closed:
            self.jsonl.close()


def drop_records_after(path: str | Path, step: int) -> None:
    """Removes the JSONL records of steps after `step` (written by a run that then crashed, and run again after
    it resumed from the checkpoint of `step`), and any line cut short by the crash."""
    import json

    path = Path(path)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    path.write_text("".join(x + "\n" for x in keep))
