"""Shared pytest fixtures: tiny HF checkpoints (built once per session) and a CPU-only JAX setup."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI turns JAX's persistent compilation cache on in ~/.cache; tests that run the CLI leave the user's alone.
os.environ.setdefault("POSTTRAIN_COMPILE_CACHE", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Identical step programs compile once per session: JAX's persistent compilation cache (process-wide)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.getbasetemp() / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """`hf_checkpoint(family)` -> folder with a saved tiny random HF model of that family (cached per session)."""
    from hf_models import save_hf_model

    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = save_hf_model(family, tmp_path_factory.mktemp(f"hf-{family}"))
        return cache[family]

    return get
