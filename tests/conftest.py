"""Shared pytest fixtures: tiny HF checkpoints (built once per session) and a CPU-only JAX setup."""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI turns JAX's persistent compilation cache on in ~/.cache; tests that run the CLI leave the user's alone.
os.environ.setdefault("POSTTRAIN_COMPILE_CACHE", "0")
#: Tests compile with JAX's `jax_disable_most_optimizations` (XLA's backend and LLVM optimization passes off): most of
#: a test's time on this CPU is compiling tiny programs, and the suite took 22 min this way against 29 (2026-11-27).
#: Set before JAX is imported, so the processes tests start (CLI runs, other "hosts", Ray workers) inherit it. Tests
#: marked `full_optimization` (numbers compared with a reference: transformers, TRL, a hand computation, the padded
#: batch) compile as a user's run does. POSTTRAIN_TEST_FULL_OPTIMIZATION=1 runs every test that way.
FULL_OPTIMIZATION = os.environ.get("POSTTRAIN_TEST_FULL_OPTIMIZATION", "0") == "1"
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if FULL_OPTIMIZATION else "1"

import logging  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

#: POSTTRAIN_NO_TORCH=1: an environment without PyTorch (e.g. the Python 3.12 + jax 0.11.2 check of the GPU machine's
#: versions without its 5 GB torch: docs/benchmarks.md, "The suite under the GPU machine's versions"): the modules
#: that import torch at the top are not collected (their tests compare against transformers in torch).
TORCH_MODULES = ("test_model_parity.py", "test_sampling.py", "test_sft.py")
collect_ignore = list(TORCH_MODULES) if os.environ.get("POSTTRAIN_NO_TORCH") == "1" else []


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process a test starts with `devices` CPU devices: the suite's own XLA_FLAGS (whatever the
    pytest process runs with) and the device count, which replaces any count those flags held."""
    rest = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    return " ".join([*rest, f"--xla_force_host_platform_device_count={devices}"])


#: GSM8K's JSONL splits, outside the repository: `../shared/data/gsm8k` from its root.
GSM8K_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


def require_data(folder: Path, name: str) -> Path:
    """`folder` if it holds `name`; else skip the test, or fail it when the environment variable `CI` is set."""
    if not (folder / name).is_file():
        message = f"{name} not found in {folder}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: the data is required)")
        pytest.skip(message)
    return folder


@pytest.fixture
def gsm8k():
    """The GSM8K folder (train.jsonl, test.jsonl); see `require_data` for when it is missing."""
    return require_data(GSM8K_DIR, "test.jsonl")


class _CurrentStderr:
    """A stream that writes to whatever `sys.stderr` is when it is written to (a test's capture, or the real one)."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Libraries (transformers, huggingface_hub, torch, ray) give their loggers a StreamHandler bound to the
    `sys.stderr` of the moment they are first imported: inside a test with `capsys` that is the test's capture,
    closed when it ends, and every later log line of theirs became a "--- Logging error ---" traceback in
    some other test's stderr (which test depended on the order). After each test, handlers left on a closed
    stream write to the current `sys.stderr` instead, as they would in a process of their own."""
    yield
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for handler in (h for lg in loggers for h in lg.handlers):
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and getattr(stream, "closed", False):
            handler.__dict__.pop("flush", None)  # transformers pins `flush` to the old stream's
            handler.stream = _CurrentStderr()


def _optimize_fully(on: bool) -> None:
    """Compiles from now on with XLA's full optimization (on) or most of it off; programs compiled the other way
    are dropped from JAX's in-memory caches (the persistent cache keys the two apart itself)."""
    import jax

    if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == ("0" if on else "1"):
        return
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if on else "1"  # for the processes the test starts
    jax.config.update("jax_disable_most_optimizations", not on)
    jax.clear_caches()


def pytest_configure(config):
    config.addinivalue_line("markers", "full_optimization: compiled with XLA's full optimization, as users' runs are "
                            "(numbers compared with a reference; see FULL_OPTIMIZATION in tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up: its compilation mode (see FULL_OPTIMIZATION)."""
    _optimize_fully(FULL_OPTIMIZATION or item.get_closest_marker("full_optimization") is not None)


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """Identical programs compile once per session: JAX's persistent compilation cache (process-wide), on for
    every test from the first (each run of a job jits fresh functions, so its second run would compile again).
    One folder for all of pytest-xdist's workers (their base folders' parent), so a program one worker compiled
    is read by the other and by the processes either starts; a size bound turns on JAX's file lock around each
    entry's read and write, which several processes writing one folder need.
    Returns the environment variables that give a process the tests start (a CLI run, a Ray worker) the same cache."""
    import jax

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax-cache"
    settings = {"jax_compilation_cache_dir": str(folder), "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0, "jax_compilation_cache_max_size": 16 << 30}
    for name, value in settings.items():
        jax.config.update(name, value)
    return {name.upper(): str(value) for name, value in settings.items()}


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


#: A toy-task reward with a learning signal in nearly every group (a rare letter leaves whole steps without one).
DISTINCT_REWARD = '''
def distinct(prompts, completions, **fields):
    """1/8 per distinct character among the first 8."""
    return [len(set(text[:8])) / 8 for text in completions]
'''


def write_toy_task(folder, reward_source: str):
    """The RL tests' toy task in `folder`: prompts.jsonl (16 prompts "x" * (1 + i % 4), answer "a") and reward.py."""
    import json
    from pathlib import Path

    folder = Path(folder)
    (folder / "reward.py").write_text(reward_source)
    with open(folder / "prompts.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": "x" * (1 + i % 4), "answer": "a"}) + "\n")


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A tiny random Gemma 3 VLM checkpoint folder (SigLIP at 32 px, 16 tokens per image), built per module
    (tests/test_vlm_model.py defines its own, from `tiny:gemma3-vlm`)."""
    from posttrain.models.hf_io import save_pretrained
    from posttrain.models.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config
    from posttrain.models.transformer import init_model

    out = tmp_path_factory.mktemp("tiny_vlm")
    tok = build_vlm_tokenizer(out)
    save_pretrained(init_model(tiny_vlm_config(tok.vocab_size), seed=0), out, tokenizer=tok)
    return out
