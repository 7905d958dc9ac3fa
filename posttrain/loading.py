"""Loading a callable named in a config: a built-in name, `package.module:function` or `path/to/file.py:function`.

One loader for every such reference (rewards today; tools reuse it): `load_callable(ref, what="reward",
builtins=...)`. A reference that cannot be loaded raises `LoadError`, a `ConfigError` whose message is one
line naming the reference and the reason (the CLI prints it as is, without a traceback). A file is imported
once per process under a private module name derived from its resolved path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from posttrain.config import ConfigError

__all__ = ["LoadError", "load_callable", "load_file_module"]

_FILE_MODULES: dict[str, ModuleType] = {}


class LoadError(ConfigError):
    """A `module:function` / `file.py:function` / built-in reference that cannot be loaded."""


def load_file_module(path_str: str, what: str = "object") -> ModuleType:
    """The module of the Python file `path_str` (imported once per process)."""
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise LoadError(f"{what} file {path_str!r} not found (resolved to {path})")
    key = str(path)
    if key not in _FILE_MODULES:
        mod_name = "_posttrain_file_" + hashlib.sha1(key.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise LoadError(f"cannot import {what} file {path_str!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise LoadError(f"error while importing {what} file {path_str!r}: {type(e).__name__}: {e}") from None
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def _attr_path(obj: Any, attr: str, what: str, where: str) -> Any:
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise LoadError(f"{what} {attr!r} not found in {where}; callables there: {public}")
        obj = getattr(obj, part)
    return obj


def load_callable(ref: str, *, what: str = "object", builtins: Mapping[str, Callable] | None = None) -> Callable:
    """The callable `ref` names: a key of `builtins`, `"package.module:function"` or
    `"path/to/file.py:function"` (`function` may be a dotted attribute path). `what` names the kind of
    thing in messages ("reward", "tool"). Raises `LoadError` with the reason when it cannot."""
    builtins = builtins or {}
    if not isinstance(ref, str) or not ref.strip():
        raise LoadError(f"{what} reference must be a non-empty string, got {ref!r}")
    ref = ref.strip()
    if ref in builtins:
        return builtins[ref]
    if ":" not in ref:
        known = f"built-in {what}s: {sorted(builtins)}; or" if builtins else "no built-in of that name;"
        raise LoadError(f"unknown {what} {ref!r}; {known} use 'package.module:function' or 'path/to/file.py:function'")
    target, attr = ref.rsplit(":", 1)
    if not attr:
        raise LoadError(f"{what} reference {ref!r} names no function after ':'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module, where = load_file_module(target, what), f"file {target!r}"
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise LoadError(f"cannot import {what} module {target!r} (from {ref!r}): {e}") from None
        except Exception as e:  # the module itself fails while importing
            raise LoadError(f"error while importing {what} module {target!r}: {type(e).__name__}: {e}") from None
        where = f"module {target!r}"
    fn = _attr_path(module, attr, what, where)
    if not callable(fn):
        raise LoadError(f"{what} {ref!r} resolved to a non-callable {type(fn).__name__}")
    return fn
