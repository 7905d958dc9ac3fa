"""An RL checkpoint: the trainer's state (`posttrain.training.run.Run`: weights, optimizer, RNG) and the dispatcher's
(`posttrain.rl.dispatcher`: the prompt stream's position, queued groups, buffered rollouts, curation) in one save,
with the RL step it was taken after. `save` writes one; `restore` reads the latest that restores when the run
resumes, and returns the step it starts from."""

from __future__ import annotations

from posttrain.rl.dispatcher import Dispatcher
from posttrain.training.run import Run

__all__ = ["restore", "save"]


def save(run: Run, dispatcher: Dispatcher, step: int, *, wait: bool = False) -> None:
    """A checkpoint of `step`: the trainer's state and the dispatcher's (`wait`: until it is on disk)."""
    run.save(data_state={"dispatcher": dispatcher.state_dict()}, metadata={"rl_step": step})
    if wait:
        run.ckpt.wait()


def restore(run: Run, dispatcher: Dispatcher) -> int:
    """The step the run starts from: when resuming (`trainer.resume`), the latest checkpoint that restores (the
    trainer's state and the dispatcher's, with its buffered rollouts) and its RL step; else 0."""
    meta = run.restore()
    if meta is None:
        return 0
    dispatcher.load_state_dict(meta["data_state"]["dispatcher"])
    return int(meta["metadata"]["rl_step"])
