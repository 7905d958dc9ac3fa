"""The persistent compilation cache switch used by the CLI (`posttrain.compile_cache`)."""

from __future__ import annotations

import jax
import pytest

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


# ------------------------------------------------- the suite's compilation mode (tests/conftest.py: FULL_OPTIMIZATION)
def _mode_seen_by_a_new_process() -> str:
    import subprocess
    import sys

    code = "import jax; print(jax.config.values['jax_disable_most_optimizations'])"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_tests_compile_with_most_optimizations_off_and_so_do_their_processes():
    from conftest import FULL_OPTIMIZATION

    assert jax.config.values["jax_disable_most_optimizations"] is not FULL_OPTIMIZATION
    assert _mode_seen_by_a_new_process() == str(not FULL_OPTIMIZATION)


@pytest.mark.full_optimization
def test_marked_tests_compile_as_users_runs_do_and_so_do_their_processes():
    assert jax.config.values["jax_disable_most_optimizations"] is False
    assert _mode_seen_by_a_new_process() == "False"
