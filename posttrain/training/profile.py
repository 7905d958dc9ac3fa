"""Profiling a window of training steps: a `jax.profiler` trace into OUTPUT_DIR/tensorboard (what XProf opens).

`trainer.profile.steps=N` (off at 0, the default) traces steps `start_step` .. `start_step + N - 1` of a run
(`start_step` defaults to 2: the first step compiles). The trace is written where TensorBoard's profile plugin
and XProf look for it, beside the run's scalars::

    OUTPUT_DIR/tensorboard/plugins/profile/<timestamp>/<host>.xplane.pb

(`tensorboard --logdir OUTPUT_DIR/tensorboard`, Profile tab; or `xprof --logdir ...`). Each traced step is a
`StepTraceAnnotation` named "train" with its step number (XProf's step view); inside it a command names its
phases with `phase(name)` (RL: "rollout" and "update"), which are `TraceAnnotation`s on the host timeline
with the device work they launched beneath them. Steps must finish their device work before the window
closes (the supervised loop and the RL loop fetch their metrics, which waits for it).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import jax

from posttrain.training.config import ProfileConfig

__all__ = ["StepProfiler"]


class StepProfiler:
    """Starts the trace before the window's first step and stops it after its last (or at `close`).

    A loop calls `begin(step)` and `end(step)` around every step (no-ops outside the window) and `close()`
    when it ends (a run that stops inside the window keeps what it traced)."""

    def __init__(self, cfg: ProfileConfig, log_dir: str | Path, say: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.log_dir = Path(log_dir)
        self.say = say
        self.active = False
        self.done = False
        self._step = None

    @property
    def enabled(self) -> bool:
        return self.cfg.steps > 0

    def _in_window(self, step: int) -> bool:
        return self.enabled and self.cfg.start_step <= step < self.cfg.start_step + self.cfg.steps

    def begin(self, step: int) -> None:
        """Before a training step's body: starts the trace at the window's first step, opens the step's range."""
        if not self._in_window(step) or self.done:
            return
        if not self.active:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir))
            self.active = True
        self._step = jax.profiler.StepTraceAnnotation("train", step_num=step)
        self._step.__enter__()

    def end(self, step: int) -> None:
        """After the step's body (its device work finished): closes its range; stops the trace after the last."""
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.active and step >= self.cfg.start_step + self.cfg.steps - 1:
            self.close()

    def phase(self, name: str):
        """A named range inside a traced step (a no-op outside the window)."""
        return jax.profiler.TraceAnnotation(name) if self.active else contextlib.nullcontext()

    def close(self) -> None:
        """Stops the trace (a run that ends inside its window keeps what it traced); safe to call twice."""
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if not self.active:
            return
        self.active = False
        self.done = True
        jax.profiler.stop_trace()
        if self.say is not None:
            self.say(f"profile: trace of steps {self.cfg.start_step}..{self.cfg.start_step + self.cfg.steps - 1} "
                     f"in {self.log_dir}/plugins/profile (TensorBoard's Profile tab, XProf)")
