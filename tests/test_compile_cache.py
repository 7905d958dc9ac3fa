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


# ------------------------------------------------- XLA's GPU autotuning: its results in the cache, its level
def test_enable_keeps_xlas_autotuning_results_with_the_cache(tmp_path):
    before = jax.config.values["jax_persistent_cache_enable_xla_caches"]
    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                 "jax_persistent_cache_min_compile_time_secs",
                                                 "jax_persistent_cache_min_entry_size_bytes")}
    try:
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
        compile_cache.enable(tmp_path / "c")
        assert jax.config.values["jax_persistent_cache_enable_xla_caches"] == "xla_gpu_per_fusion_autotune_cache_dir"
    finally:
        jax.config.update("jax_persistent_cache_enable_xla_caches", before)
        for k, v in saved.items():
            jax.config.update(k, v)


def test_autotune_flags_replace_only_their_own_flag():
    assert compile_cache.autotune_flags("", 0) == "--xla_gpu_autotune_level=0"
    assert (compile_cache.autotune_flags("--a=1 --xla_gpu_autotune_level=4 --b", 2)
            == "--a=1 --b --xla_gpu_autotune_level=2")
    assert compile_cache.autotune_flags("--a=1 --xla_gpu_autotune_level=4", None) == "--a=1"


def test_compile_section_checks_the_level():
    from posttrain.config import ConfigError, from_dict

    assert from_dict(compile_cache.CompileConfig, {"gpu_autotune_level": 4}).gpu_autotune_level == 4
    assert from_dict(compile_cache.CompileConfig, {"gpu_autotune_level": None}).gpu_autotune_level is None
    with pytest.raises(ConfigError, match="0..4"):
        from_dict(compile_cache.CompileConfig, {"gpu_autotune_level": 5})


LEVEL_PROBE = r"""
import dataclasses, json, os, sys
from posttrain import compile_cache
from posttrain.training.config import SFTConfig
from posttrain.training.run import Run

@dataclasses.dataclass
class WithCompile(SFTConfig):  # a run config with a `compile` section
    compile: compile_cache.CompileConfig = dataclasses.field(default_factory=compile_cache.CompileConfig)

out = {"default": compile_cache.enable()}  # the CLI's start: the cache is off here, the default level is asked for
out["flags_default"] = os.environ.get("XLA_FLAGS", "")
said = []
cfg = WithCompile(output_dir=sys.argv[1], compile=compile_cache.CompileConfig(gpu_autotune_level=3))
Run(cfg, "sft", lock=False, log=said.append).close()
out["flags_run"] = os.environ.get("XLA_FLAGS", "")
import jax
jax.devices()  # the backend starts: XLA has read its flags
out["later"] = compile_cache.set_gpu_autotune_level(1)
cfg = WithCompile(output_dir=sys.argv[1], compile=compile_cache.CompileConfig(gpu_autotune_level=1))
Run(cfg, "sft", lock=False, log=said.append).close()
out["said"] = said
out["flags_end"] = os.environ.get("XLA_FLAGS", "")
print("PROBE " + json.dumps(out))
"""


def _probe(tmp_path, xla_flags: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": xla_flags, "POSTTRAIN_COMPILE_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", LEVEL_PROBE, str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


def test_a_runs_autotune_level_goes_to_xla_before_the_backend_starts(tmp_path):
    got = _probe(tmp_path, "--xla_force_host_platform_device_count=1")
    assert got["default"] is None  # POSTTRAIN_COMPILE_CACHE=0: no cache, the level all the same
    assert got["flags_default"] == "--xla_force_host_platform_device_count=1 --xla_gpu_autotune_level=0"
    assert got["flags_run"] == "--xla_force_host_platform_device_count=1 --xla_gpu_autotune_level=3"
    # once the backend runs, XLA does not read its flags again: the level stays (on a CPU it does not matter: the
    # run says nothing)
    assert got["later"] is False and got["flags_end"] == got["flags_run"] and got["said"] == []


def test_the_level_in_xla_flags_at_launch_wins(tmp_path):
    got = _probe(tmp_path, "--xla_gpu_autotune_level=2")
    assert got["flags_default"] == got["flags_run"] == got["flags_end"] == "--xla_gpu_autotune_level=2"


def test_a_gpu_run_says_when_its_level_cannot_apply(tmp_path, monkeypatch):
    import dataclasses

    from posttrain.training.config import SFTConfig
    from posttrain.training.run import Run

    @dataclasses.dataclass
    class WithCompile(SFTConfig):
        compile: compile_cache.CompileConfig = dataclasses.field(default_factory=compile_cache.CompileConfig)

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(compile_cache, "_backend_started", lambda: True)  # XLA has read its flags
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    said: list[str] = []
    Run(WithCompile(output_dir=str(tmp_path / "o"), compile=compile_cache.CompileConfig(gpu_autotune_level=4)), "sft",
        lock=False, log=said.append).close()
    assert len(said) == 1 and "compile.gpu_autotune_level=4 not applied" in said[0]
