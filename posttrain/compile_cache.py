"""How posttrain runs compile: JAX's persistent compilation cache (a second run of the same job starts warm) and
XLA's GPU autotuning (its level, and its results kept with the cache).

`enable()` points JAX at a user cache folder, by default `~/.cache/posttrain/jax` (or
`$POSTTRAIN_COMPILE_CACHE` when that names a folder). `POSTTRAIN_COMPILE_CACHE=0` (or off / false / no),
or the CLI's `--no-compile-cache`, turns it off. The CLI enables it for every subcommand; library users
call `enable()` themselves. Programs that took at least `min_compile_seconds` to compile are stored: by
default all of them (a GRPO start compiles ~45 programs, most of them tiny; at JAX's default of 1 s a
warm start still spent ~1.3 s compiling those, stored it spends ~0.5 s, on the CPU benchmark model).
With the cache on, XLA's GPU autotuning results are kept beside it (`jax_persistent_cache_enable_xla_caches` =
`xla_gpu_per_fusion_autotune_cache_dir`): a program that is new (another shape, another run) but holds fusions
tuned before does not tune them again.

`enable()` also asks XLA for the default GPU autotune level (`CompileConfig.gpu_autotune_level`), and a training
run (`posttrain.training.run.Run`) for its config's: XLA reads its flags once, when JAX starts its backend, so the
level is set through `XLA_FLAGS` before that (`set_gpu_autotune_level`); an `--xla_gpu_autotune_level` in the
`XLA_FLAGS` the process was started with always wins.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax

ENV_VAR = "POSTTRAIN_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none")
AUTOTUNE_FLAG = "--xla_gpu_autotune_level"
#: XLA's per-fusion autotuning results, kept in the compilation cache's folder (JAX's name of that cache)
XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"
#: the XLA flags this process was started with: what the user asked for, which wins over any config
_LAUNCH_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")


@dataclasses.dataclass
class CompileConfig:
    """How XLA compiles a run's programs.

    gpu_autotune_level: XLA's GPU autotuning (`--xla_gpu_autotune_level`); no effect on other backends.
      0 = off: XLA's heuristics pick each matmul's and fusion's kernel. 1-4 = on: every candidate kernel of every
      matmul and Triton fusion is compiled and timed while a program compiles (4, XLA's own default, also checks
      each candidate's results against a reference). The trade-off: tuning can make a large matmul-bound step a few
      percent faster, where the heuristic picks a poor kernel, and it is paid again for every new program and
      shape. Measured on an H200 (2026-11-27, the demo's 4-layer model): the RL stage's programs compiled in 94 s
      at 4 and in 20 s at 0, with the same held-out accuracy (42 s wall against 120 s). Default 0: short runs,
      first runs and small models (the demo, the smoke configs, a few hundred steps) spend more time tuning than
      it can give back. Set 4 for long runs of large models (`benchmarks/gpu_kit.py run --only autotune` measures
      compile seconds against step time at both levels); with the compilation cache on, tuned results persist,
      so only the first run on a machine pays. None leaves XLA's own default (4).
    """

    gpu_autotune_level: int | None = 0

    def __post_init__(self):
        if self.gpu_autotune_level is not None and not 0 <= self.gpu_autotune_level <= 4:
            raise ValueError(f"compile.gpu_autotune_level must be 0..4 or null (XLA's default), "
                             f"found {self.gpu_autotune_level}")


def default_dir() -> Path:
    return Path.home() / ".cache" / "posttrain" / "jax"


def enable(path: str | os.PathLike | None = None, *, min_compile_seconds: float = 0.0) -> Path | None:
    """Turns the persistent compilation cache on, with XLA's GPU autotuning results kept in it (returns its
    folder), or leaves it off when the environment says so (returns None). An explicit `path` wins over the
    environment variable. Either way, asks for the default GPU autotune level (`CompileConfig`)."""
    set_gpu_autotune_level(CompileConfig().gpu_autotune_level)
    env = os.environ.get(ENV_VAR, "").strip()
    if path is None and env.lower() in _OFF:
        return None
    folder = Path(path or env or default_dir()).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    return folder


def autotune_flags(flags: str, level: int | None) -> str:
    """`flags` (an XLA_FLAGS value) asking for GPU autotune `level` (None: XLA's default, no flag)."""
    rest = re.sub(rf"{AUTOTUNE_FLAG}=\S*", "", flags).split()
    return " ".join(rest if level is None else [*rest, f"{AUTOTUNE_FLAG}={int(level)}"])


def set_gpu_autotune_level(level: int | None) -> bool:
    """Asks XLA for GPU autotune `level` (see `CompileConfig`) through `XLA_FLAGS`; returns whether that level is
    the one this process compiles with. False when the process was started with its own `--xla_gpu_autotune_level`
    (it wins), or when JAX's backend already started with another level (XLA reads its flags once: set it before
    anything touches a device)."""
    if AUTOTUNE_FLAG in _LAUNCH_XLA_FLAGS:
        return autotune_flags(_LAUNCH_XLA_FLAGS, level) == " ".join(_LAUNCH_XLA_FLAGS.split())
    current = os.environ.get("XLA_FLAGS", "")
    wanted = autotune_flags(current, level)
    if wanted == " ".join(current.split()):
        return True
    if _backend_started():
        return False
    if wanted:
        os.environ["XLA_FLAGS"] = wanted
    else:
        os.environ.pop("XLA_FLAGS", None)
    return True


def configure(cfg: CompileConfig) -> bool:
    """Applies a run's `compile` section (its GPU autotune level); returns whether it is in effect, or does not
    matter (JAX's backend is up and is not a GPU)."""
    if set_gpu_autotune_level(cfg.gpu_autotune_level):
        return True
    return _backend_started() and jax.default_backend() != "gpu"


def _backend_started() -> bool:
    from jax._src import (
        xla_bridge,  # JAX's own record of whether its backends exist (no public API says so)
    )

    return xla_bridge.backends_are_initialized()
