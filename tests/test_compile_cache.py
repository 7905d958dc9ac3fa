"""The persistent compilation cache switch used by the CLI (`posttrain.compile_cache`)."""

from __future__ import annotations

import jax

from posttrain import compile_cache


def test_enable_sets_the_cache_folder_and_the_environment_turns_it_off(tmp_path, monkeypatch):
    before = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                   "jax_persistent_cache_min_compile_time_secs",
                                                   "jax_persistent_cache_min_entry_size_bytes")}
    try:
        monkeypatch.setenv(compile_cache.ENV_VAR, "off")
        assert compile_cache.enable() is None
        assert jax.config.jax_compilation_cache_dir == before["jax_compilation_cache_dir"]
        monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "from-env"))
        assert compile_cache.enable() == tmp_path / "from-env" and (tmp_path / "from-env").is_dir()
        assert compile_cache.enable(tmp_path / "explicit") == tmp_path / "explicit"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "explicit")
        monkeypatch.delenv(compile_cache.ENV_VAR)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert compile_cache.enable() == tmp_path / "home" / ".cache" / "posttrain" / "jax"
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
