"""notebooks/quickstart.ipynb: stored without outputs, and it runs from the first cell to the last (nbclient), SFT then
RL through the Python API, ending with its plot and a better held-out accuracy than the model it started from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_the_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


@pytest.mark.slow
def test_the_notebook_runs(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # the kernel inherits this environment: a user's run compiles fully (the suite's fast-compile mode would make
    # these few hundred steps slower, not faster)
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is missing"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    summary = json.loads(text.split("held-out accuracy:")[-1].strip().splitlines()[0])
    assert summary["sft"] > summary["init"] + 0.1, summary
    assert 0.0 <= summary["rl"] <= 1.0
    assert (tmp_path / "outputs" / "quickstart" / "rl" / "hf" / "config.json").exists()
