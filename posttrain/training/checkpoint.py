"""Training checkpoints through Orbax: trained params, optimizer state, step, RNG, data-iterator state, metadata.

Layout: `DIR/<step>/state` (Orbax PyTree of arrays) and `DIR/<step>/meta` (JSON: step, Grain iterator
state, caller's metadata). Saving goes through `ocp.CheckpointManager` (asynchronous, keeps the last N):
Orbax writes each checkpoint into a temporary folder and renames it into place only when complete, so
a crash mid-save leaves the previous checkpoints intact and `latest_step()` only ever sees finished ones.
Temporary folders left by a killed save are removed when a `Checkpointer` opens the folder, and
`restore_latest` falls back to the newest checkpoint that restores (a damaged one is moved aside as
`<step>.unrestorable`, and the caller is told which one and why).

Multi-host: every process calls `save` / `restore` (Orbax writes each process's shards and process 0 the
metadata, into one folder that every host sees: a shared file system or a bucket); the trainer's arrays
come back into their global shardings, so a run resumes exactly on the same or another process count.

A failed save never hangs the process: directories are created synchronously (errors surface in `save`),
background writes are bounded by `save_timeout_s`, and every failure (in `save`, `wait` or `close`) is a
`CheckpointSaveError`; `close` gives up on a stuck writer after a bounded wait.

Only the *trained* parameters are stored (the LoRA adapters alone with LoRA), plus the optimizer state;
the frozen base comes back from the model checkpoint the run started from. Any optimizer state
(AdamW's namedtuples, Adafactor's factored moments, ...) is stored as a nested dict keyed by its pytree
path, and restored into the live trainer's own structure and shardings.
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from posttrain import distributed
from posttrain.training.errors import CheckpointSaveError, ResumeError
from posttrain.models.weights import path_names

__all__ = ["Checkpointer", "CheckpointSaveError", "ResumeError", "read_trained_params", "tree_to_nested",
           "nested_to_tree"]

TMP_MARKER = ".orbax-checkpoint-tmp"


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


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

    `save` is asynchronous when `async_save`; `wait()` blocks until pending saves are on disk. Any failure
    to write is raised as `CheckpointSaveError`. `save_timeout_s` bounds a background write,
    `close_timeout_s` the final wait in `close`.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 save_timeout_s: int = 600, close_timeout_s: float = 30.0,
                 say: Callable[[str], None] | None = None):
        import orbax.checkpoint as ocp  # lazy: orbax (~0.2 s) loads only when a run opens its checkpoints

        self.directory = Path(directory).absolute()
        self._ocp = ocp
        self._say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.close_timeout_s = float(close_timeout_s)
        self._failed: BaseException | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointSaveError(f"cannot create the checkpoint folder {self.directory}: {_short(e)}") from e
        self.removed_tmp = self.clean_stale()
        distributed.barrier("posttrain-checkpoint-open")  # process 0 cleaned up before anyone lists the folder
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep and keep > 0 else None, create=True, enable_async_checkpointing=async_save,
            # Folders are created in the calling thread, so an unwritable folder fails `save` at once
            # instead of leaving a background thread (and the process exit) waiting.
            async_options=ocp.AsyncOptions(timeout_secs=int(save_timeout_s), create_directories_asynchronously=False))
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def clean_stale(self) -> list[str]:
        """Removes temporary folders of saves that never finished (a killed run's); returns their names."""
        removed = []
        if jax.process_index() != 0 or not self.directory.is_dir():
            return removed
        for p in sorted(self.directory.iterdir()):
            if TMP_MARKER in p.name and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        if removed:
            self._say(f"checkpoints: removed {len(removed)} unfinished save(s) of an earlier run: {', '.join(removed)}")
        return removed

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
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - this save's or an earlier background save's failure
            raise self._save_error(e) from e
        return step

    def _save_error(self, e: BaseException) -> CheckpointSaveError:
        self._failed = e
        return CheckpointSaveError(f"cannot write checkpoints to {self.directory} ({_short(e)}); the run stopped. "
                                   "Check free disk space and that the folder is writable.")

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

    def restore_latest(self, trainer) -> dict[str, Any] | None:
        """Restores the newest checkpoint that restores into `trainer`; returns its meta (None: no checkpoint).

        A checkpoint that fails (truncated or damaged files) is reported, moved aside as `<step>.unrestorable`
        (so the run can save that step again) and the next older one is tried. If none restores, raises
        `ResumeError` with each one's reason.
        """
        steps = sorted(self.all_steps(), reverse=True)
        failures: list[tuple[int, BaseException]] = []
        for step in steps:
            try:
                meta = self.restore(trainer, step)
            except Exception as e:  # noqa: BLE001 - reported, then the previous checkpoint is tried
                failures.append((step, e))
                continue
            for bad, e in failures:
                aside = self._move_aside(bad)
                self._say(f"checkpoints: skipped step {bad} ({_short(e, 200)}); moved it to {aside.name}; "
                          f"resuming from step {step}")
            return meta
        if failures:
            reasons = "; ".join(f"step {s}: {_short(e, 200)}" for s, e in failures)
            raise ResumeError(f"cannot resume: no checkpoint in {self.directory} restores into this run ({reasons}). "
                              "Was it written by another model or LoRA setting? Use a fresh output_dir or "
                              "trainer.resume=false")
        return None

    def _move_aside(self, step: int) -> Path:
        src = self.directory / str(step)
        dst = self.directory / f"{step}.unrestorable"
        if jax.process_index() == 0 and src.exists():
            if dst.exists():
                shutil.rmtree(dst, ignore_errors=True)
            src.rename(dst)
        distributed.barrier("posttrain-checkpoint-aside")
        self.manager.reload()
        return dst

    def wait(self) -> None:
        """Blocks until pending saves are on disk; a failed one raises `CheckpointSaveError`."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_error(e) from e

    def close(self) -> None:
        """Waits for pending saves (at most `close_timeout_s` after a failure) and releases the manager.

        Raises `CheckpointSaveError` if a pending save failed (unless one was raised already).
        """
        failed_before = self._failed is not None
        box: dict[str, BaseException] = {}

        def finish():
            try:
                if not failed_before:
                    self.manager.wait_until_finished()
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                box["error"] = e
            try:
                self.manager.close()
            except BaseException as e:  # noqa: BLE001
                box.setdefault("error", e)

        worker = threading.Thread(target=finish, name="checkpoint-close", daemon=True)
        worker.start()
        # A healthy final save may take long (large models); after a failure, wait a few seconds only.
        worker.join(self.close_timeout_s if failed_before else None)
        if worker.is_alive():
            self._say(f"checkpoints: the checkpoint writer did not finish within {self.close_timeout_s:.0f}s "
                      "after a failed save; giving up on it")
            return
        if "error" in box and not failed_before:
            raise self._save_error(box["error"])


def read_trained_params(directory: str | Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(step, trained parameters) of checkpoint `step` (default: the newest) under `directory`, read without a
    trainer: a flat {path: array} dict keyed as `posttrain.models.weights.flat_weights` keys a model's variables
    (a LoRA run's adapters alone). FileNotFoundError when the folder holds no checkpoint."""
    import orbax.checkpoint as ocp  # lazy: orbax (~0.2 s) loads only when checkpoints are read

    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {directory}")
    manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    flat: dict[str, np.ndarray] = {}

    def walk(node, prefix: str):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}/")
            else:
                flat[prefix + k] = np.asarray(v)

    walk(state["params"], "")
    return int(step), flat
