"""JAX's persistent compilation cache for posttrain runs: a second run of the same job starts warm.

`enable()` points JAX at a user cache folder, by default `~/.cache/posttrain/jax` (or
`$POSTTRAIN_COMPILE_CACHE` when that names a folder). `POSTTRAIN_COMPILE_CACHE=0` (or off / false / no),
or the CLI's `--no-compile-cache`, turns it off. The CLI enables it for every subcommand; library users
call `enable()` themselves. Programs that took at least `min_compile_seconds` to compile are stored: by
default all of them (a GRPO start compiles ~45 programs, most of them tiny; at JAX's default of 1 s a
warm start still spent ~1.3 s compiling those, stored it spends ~0.5 s, on the CPU benchmark model).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV_VAR = "POSTTRAIN_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none")


def default_dir() -> Path:
    return Path.home() / ".cache" / "posttrain" / "jax"


def enable(path: str | os.PathLike | None = None, *, min_compile_seconds: float = 0.0) -> Path | None:
    """Turns the persistent compilation cache on (returns its folder), or leaves it off when the environment
    says so (returns None). An explicit `path` wins over the environment variable."""
    env = os.environ.get(ENV_VAR, "").strip()
    if path is None and env.lower() in _OFF:
        return None
    folder = Path(path or env or default_dir()).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder
