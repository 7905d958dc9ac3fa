"""notebooks/quickstart.ipynb: stored without outputs, and its one documented headless command (in its first cell, the
docs and the README, after the `notebook` extra) runs it from the first cell to the last, SFT then RL through the
Python API, ending with its plot and a better held-out accuracy than the model it started from."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
EXTRA = 'pip install -e ".[notebook]"'


def documented_command() -> str:
    """The headless command the notebook's first cell gives (an indented line starting with `jupyter`)."""
    first = "".join(json.loads(NOTEBOOK.read_text())["cells"][0]["source"])
    (command,) = re.findall(r"^ {4}(jupyter .+)$", first, flags=re.M)
    return command.strip()


def test_the_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


def test_one_headless_command_is_documented_with_its_extra():
    """The first cell, the getting-started page and the README give the same command and the same extra; the extra
    installs what the command needs (nbclient's `jupyter execute`, ipykernel's kernel), pinned as the test extra
    pins them."""
    command = documented_command()
    assert command == "jupyter execute notebooks/quickstart.ipynb"
    first = "".join(json.loads(NOTEBOOK.read_text())["cells"][0]["source"])
    for text in (first, (ROOT / "docs" / "getting-started.md").read_text(), (ROOT / "README.md").read_text()):
        assert command in text and EXTRA in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[=<>]", d)[0].lower() for d in extras["notebook"]}
    assert {"nbclient", "ipykernel"} <= names and set(extras["notebook"]) <= set(extras["test"])


@pytest.mark.slow
def test_the_documented_command_runs_the_notebook(tmp_path):
    """The command, as documented, from the root of a folder holding the notebook (a copy: it writes beside it)."""
    (tmp_path / "notebooks").mkdir()
    shutil.copy(NOTEBOOK, tmp_path / "notebooks" / NOTEBOOK.name)
    # the kernel inherits this environment: the checkout's package, and a user's full compilation (the suite's
    # fast-compile mode would make these few hundred steps slower, not faster)
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(shlex.split(documented_command()), cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1500, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "notebooks" / "outputs" / "quickstart"
    assert (out / "quickstart.png").stat().st_size > 0, "the plot is missing"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft"] > summary["init"] + 0.1, summary
    assert 0.0 <= summary["rl"] <= 1.0
    assert (out / "rl" / "hf" / "config.json").exists()
