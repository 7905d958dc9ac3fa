"""trainer.profile: a jax.profiler trace of a window of steps lands in OUTPUT_DIR/tensorboard/plugins/profile
(where TensorBoard's profile plugin and XProf read it), with the step and phase names; off writes nothing.
The runs' own traces are checked in test_sft's smoke run (the shared supervised loop) and test_rl (rollout/update)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from posttrain.config import ConfigError
from posttrain.training.config import ProfileConfig
from posttrain.training.profile import StepProfiler
from posttrain.training.sft import load_sft_config

def _traces(tb: Path) -> list[Path]:
    return sorted(tb.glob("plugins/profile/*/*.xplane.pb"))


def event_names(trace: Path) -> set[str]:
    """The names of every event in a trace file (annotations are events named exactly as given)."""
    data = jax.profiler.ProfileData.from_file(str(trace))
    return {ev.name for plane in data.planes for line in plane.lines for ev in line.events}


def _loop(profiler: StepProfiler, steps: int) -> list[int]:
    """A toy training loop: every step runs a compiled function inside a named phase; returns traced steps."""
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((64, 64))
    traced = []
    for step in range(1, steps + 1):
        profiler.begin(step)
        if profiler.active:
            traced.append(step)
        with profiler.phase("toy_update"):
            float(f(x + step))
        profiler.end(step)
    profiler.close()
    return traced


def test_window_writes_one_trace_with_step_and_phase_names(tmp_path):
    prof = StepProfiler(ProfileConfig(start_step=2, steps=2), tmp_path / "tensorboard")
    assert _loop(prof, 5) == [2, 3]
    files = _traces(tmp_path / "tensorboard")
    assert len(files) == 1, files
    names = event_names(files[0])
    assert {"toy_update", "train"} <= names


def test_off_by_default_writes_nothing(tmp_path):
    prof = StepProfiler(ProfileConfig(), tmp_path / "tensorboard")
    assert not prof.enabled and _loop(prof, 3) == []
    assert not (tmp_path / "tensorboard").exists()


def test_profile_section_is_typed_and_checked():
    cfg = load_sft_config(None, ["trainer.profile.steps=3", "trainer.profile.start_step=5"])
    assert cfg.trainer.profile == ProfileConfig(start_step=5, steps=3)
    with pytest.raises(ConfigError):
        load_sft_config(None, ["trainer.profile.steps=-1"])
    with pytest.raises(ConfigError):
        load_sft_config(None, ["trainer.profile.every=2"])
