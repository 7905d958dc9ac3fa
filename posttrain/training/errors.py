"""Error types of training runs, shared by SFT and RL (the CLI turns each into one line and a non-zero exit)."""

from __future__ import annotations

__all__ = ["TrainingDivergedError", "ResumeError", "CheckpointSaveError", "RunInterrupted"]


class TrainingDivergedError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stopped and the last good checkpoint is intact."""

    @classmethod
    def at(cls, step: int, loss: float, grad_norm: float | None = None, checkpointer=None) -> "TrainingDivergedError":
        """The error for a non-finite loss at `step`, naming the checkpoints a resume can start from."""
        steps: list[int] = []
        where = "no checkpoint had been written yet"
        if checkpointer is not None:
            checkpointer.wait()
            steps = sorted(checkpointer.all_steps())
            if steps:
                where = f"the last good checkpoint (step {steps[-1]}) in {checkpointer.directory} is intact"
        back = ""
        if len(steps) > 1:
            back = (f" Checkpoints kept: steps {', '.join(map(str, steps))}; if resuming from step {steps[-1]} diverges "
                    f"again (its weights may already be damaged), move {checkpointer.directory}/{steps[-1]} aside to "
                    "resume from the one before (trainer.keep_checkpoints keeps more).")
        gn = f", grad_norm={grad_norm}" if grad_norm is not None else ""
        return cls(f"non-finite loss at step {step} (loss={loss}{gn}); the update was not applied and the run "
                   f"stopped; {where}. Lower optim.lr, enable optim.clip_norm, or check the data.{back}")


class ResumeError(RuntimeError):
    """No checkpoint in OUTPUT_DIR/checkpoints can be restored into this run (another model or LoRA setting)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (full disk, unwritable folder, ...); the run stops."""


class RunInterrupted(BaseException):
    """SIGTERM (a scheduler's preemption) arrived; raised in the main thread so `finally` blocks clean up.

    A BaseException, like KeyboardInterrupt, so `except Exception` in library code does not swallow it.
    """
