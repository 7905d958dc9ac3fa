"""Training checkpoints through Orbax: trained params, optimizer state, step, RNG, data-iterator state, metadata.

Layout: `DIR/<step>/state` (Orbax PyTree of arrays) and `DIR/<step>/meta` (JSON: step, Grain iterator
state, caller's metadata). Saving goes through `ocp.CheckpointManager` (asynchronous, keeps the last N):
Orbax writes each checkpoint into a temporary folder and renames it into place only when complete, so
a crash mid-save leaves the previous checkpoints intact and `latest_step()` only ever sees finished ones.

Only the *trained* parameters are stored (the LoRA adapters alone with LoRA), plus the optimizer state;
the frozen base comes back from the model checkpoint the run started from. Any optimizer state
(AdamW's namedtuples, Adafactor's factored moments, ...) is stored as a nested dict keyed by its pytree
path, and restored into the live trainer's own structure and shardings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from posttrain.training.optim import path_names

__all__ = ["Checkpointer", "tree_to_nested", "nested_to_tree"]


def tree_to_nested(tree) -> dict:
    """A pytree as a nested dict of its array leaves keyed by path names (Variables' `value` dropped)."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [n for n in path_names(path) if n != "value"] or ["_"]
        node = out
        for n in names[:-1]:
            node = node.setdefault(n, {})
        node[names[-1]] = leaf
    return out


def _get(nested: dict, path) -> Any:
    names = [n for n in path_names(path) if n != "value"] or ["_"]
    node = nested
    for n in names:
        node = node[n]
    return node


def nested_to_tree(nested: dict, like):
    """Inverse of `tree_to_nested`: the values of `nested` in the structure of the pytree `like`."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [_get(nested, p) for p, _ in paths])


class Checkpointer:
    """Saves and restores a `Trainer`'s state (and the data position) under `directory`.

    `save` is asynchronous when `async_save`; `wait()` blocks until pending saves are on disk.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=keep if keep and keep > 0 else None, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, trainer, *, data_state: dict | None = None, metadata: dict | None = None) -> int:
        """Saves the trainer's state at `trainer.step_count` (returns that step)."""
        ocp = self._ocp
        step = int(trainer.step_count)
        state = tree_to_nested(trainer.state_dict())
        meta = {"step": step, "data_state": data_state, "metadata": metadata or {}}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        return step

    def restore(self, trainer, step: int | None = None) -> dict[str, Any]:
        """Loads checkpoint `step` (default: the latest) into `trainer`; returns its meta dict."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        live = trainer.state_dict()

        def abstract(x):
            sharding = getattr(x, "sharding", None)
            x = np.asarray(x) if not hasattr(x, "shape") else x
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        target = tree_to_nested(jax.tree.map(abstract, live))
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                     meta=ocp.args.JsonRestore()))
        trainer.load_state_dict(nested_to_tree(restored["state"], live))
        return dict(restored["meta"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
