"""The one loader of `module:function` / `file.py:function` references (`posttrain.loading`): every failure is a
one-line `LoadError` (a ConfigError) naming the reference, and `posttrain rl` with a reward that cannot be
loaded stops with that one line and no traceback."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.config import ConfigError
from posttrain.loading import LoadError, load_callable
from posttrain.rewards import RewardRunner

ROOT = Path(__file__).resolve().parents[1]


def _unchained(e: BaseException) -> bool:
    """No earlier exception would be printed with `e` (no "During handling..." / "direct cause" block)."""
    return e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


@pytest.fixture()
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent("""
        class Box:
            @staticmethod
            def inner(x):
                return x + 1

        def add(a, b):
            return a + b

        value = 3
    """))
    return path


def test_loads_builtins_modules_files_and_dotted_attributes(tools_file):
    builtins = {"twice": lambda x: 2 * x}
    assert load_callable("twice", what="tool", builtins=builtins)(4) == 8
    assert load_callable("os.path:join", what="tool") is os.path.join
    assert load_callable(f"{tools_file}:add", what="tool")(2, 3) == 5
    assert load_callable(f"{tools_file}:Box.inner", what="tool")(1) == 2
    # a file is imported once per process: the same function object both times
    assert load_callable(f"{tools_file}:add") is load_callable(f" {tools_file}:add ")


@pytest.mark.parametrize("ref, message", [
    ("", r"tool reference must be a non-empty string"),
    ("nope", r"unknown tool 'nope'; built-in tools: \['twice'\]; or use 'package.module:function'"),
    ("os.path:", r"tool reference 'os.path:' names no function after ':'"),
    ("no_such_pkg_xyz.mod:fn", r"cannot import tool module 'no_such_pkg_xyz.mod'"),
    ("os.path:no_such_fn", r"tool 'no_such_fn' not found in module 'os.path'; callables there: \[.*'join'"),
    ("os:sep", r"tool 'os:sep' resolved to a non-callable str"),
    ("missing_dir/none.py:fn", r"tool file 'missing_dir/none.py' not found \(resolved to /"),
])
def test_every_failure_is_one_line_load_error(ref, message):
    with pytest.raises(LoadError, match=message) as e:
        load_callable(ref, what="tool", builtins={"twice": lambda x: 2 * x})
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value) and _unchained(e.value)


def test_a_file_that_fails_to_import_is_named(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import os\nraise RuntimeError('half-written file')\n")
    with pytest.raises(LoadError, match=r"error while importing reward file '.*broken.py': RuntimeError: half-written"):
        load_callable(f"{bad}:fn", what="reward")
    assert not [m for m in sys.modules if m.startswith("_posttrain_file_") and "broken" in str(sys.modules[m])]


def test_reward_runner_names_the_reward_in_one_line():
    with pytest.raises(LoadError, match=r"^reward 'fn': reward file 'nonexist.py' not found") as e:
        RewardRunner([{"name": "fn", "fn": "nonexist.py:fn"}], num_workers=0)
    assert _unchained(e.value)
    with pytest.raises(LoadError, match=r"^reward 'one_arg': reward '<lambda>' must accept \(prompts, completions"):
        RewardRunner([{"name": "one_arg", "fn": lambda x: x}], num_workers=0)


def test_cli_reports_an_unloadable_reward_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "rl", str(ROOT / "configs" / "rl_smoke.yaml"),
                        "rewards.functions=[{name: nonexist.py:fn}]", f"output_dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert lines == [f"error: reward 'fn': reward file 'nonexist.py' not found (resolved to {tmp_path / 'nonexist.py'})"], \
        p.stderr[-3000:]
