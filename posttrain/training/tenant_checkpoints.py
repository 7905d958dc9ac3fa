"""A LoRA tenant's saved state on disk (Orbax): its adapters, optionally its AdamW state, and a JSON record.

Layout of one checkpoint folder: `state/` (an Orbax PyTree: `params` and, for a full state, `opt_state`, nested
dicts keyed by path as `posttrain.training.checkpoint.tree_to_nested` writes them) and `meta/` (JSON: the
`LoraSpec`, the base model's name, optimizer steps, whatever the caller adds). Orbax writes into a temporary folder
and renames it into place when complete, so a folder that exists is whole; overwriting writes the new one beside
the old and swaps them, so a crash leaves one of the two, never a mix. The base weights are never saved here: they
come back from the served model.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from posttrain.training.checkpoint import tree_to_nested
from posttrain.training.tenants import Tenant

__all__ = ["SavedTenant", "load_tenant", "save_tenant"]


class SavedTenant(dict):
    """What `load_tenant` returns: `meta` (dict), `params` (nested dict of arrays), `opt_state` (or None)."""


def _ocp():
    import orbax.checkpoint as ocp  # lazy: orbax (~0.2 s) loads only when a checkpoint is written or read

    return ocp


def save_tenant(path: str | Path, tenant: Tenant, meta: dict[str, Any], *, optimizer: bool = True,
                overwrite: bool = False) -> Path:
    """Writes the tenant's adapters (and optimizer state when `optimizer`) and `meta` to the folder `path`
    (atomically, module docstring). An existing folder is a FileExistsError unless `overwrite`."""
    ocp = _ocp()
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"a checkpoint named {path.name!r} exists already (pass overwrite=True)")
    state = {"params": tree_to_nested(tenant.params)}
    if optimizer:
        state["opt_state"] = tree_to_nested(tenant.opt_state)
    record = {**meta, "lora": tenant.spec.to_json(), "steps": tenant.steps, "optimizer": optimizer}
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path if not path.exists() else path.with_name(f"{path.name}.new-{uuid.uuid4().hex[:8]}")
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        checkpointer.save(target, ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(record)))
    finally:
        checkpointer.close()
    if target != path:  # overwrite: the old folder aside, the new one in, the old one gone
        old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
        path.rename(old)
        target.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_tenant(path: str | Path, *, optimizer: bool = False) -> SavedTenant:
    """The checkpoint in the folder `path`: `meta`, `params` and, when `optimizer`, `opt_state` (a checkpoint
    saved without one is a ValueError). A missing folder is a FileNotFoundError."""
    ocp = _ocp()
    path = Path(path).absolute()
    if not (path / "meta").exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        meta = dict(checkpointer.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        if optimizer and not meta.get("optimizer"):
            raise ValueError(f"the checkpoint {path.name!r} holds no optimizer state (saved for a sampler); "
                             "load it without the optimizer")
        state = checkpointer.restore(path, ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    finally:
        checkpointer.close()
    host = jax.tree.map(np.asarray, state)
    return SavedTenant(meta=meta, params=host["params"], opt_state=host.get("opt_state") if optimizer else None)
