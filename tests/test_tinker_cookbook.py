"""tinker-cookbook's own loop recipes, unchanged, run to completion against posttrain's Tinker server (tiny:llama).

`recipes/sl_loop.py` (supervised, `cross_entropy`) and `recipes/rl_loop.py` (`loss_fn="importance_sampling"`) of
tinker-cookbook 0.5.8 run as they ship, each in a subprocess of the cookbook's own virtual environment (it pins
transformers<=5.5.4, so it cannot share posttrain's: `.ci/cookbook-venv` builds it once and caches it;
POSTTRAIN_COOKBOOK_PYTHON names its python, which `.ci/run` sets), through `tests/cookbook_recipes.py`, which only
puts local pieces where a recipe would reach a hub (tokenizer, renderer, rows; the RL reward). Offline: the server,
model and rows are local. The tests read what the recipes wrote: `metrics.jsonl` (losses, rewards, optimizer
metrics) and `checkpoints.jsonl` (tinker:// paths), and use the saved checkpoints with the `tinker` SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "tiny:llama"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # two recipe runs (and a resumed one) in a second environment against a live server


@pytest.fixture(scope="module")
def cookbook_python() -> str:
    """POSTTRAIN_COOKBOOK_PYTHON, or the cached venv `.ci/cookbook-venv` builds (from the package index)."""
    python = os.environ.get("POSTTRAIN_COOKBOOK_PYTHON")
    if python:
        assert Path(python).exists(), f"POSTTRAIN_COOKBOOK_PYTHON={python} does not exist"
        return python
    out = subprocess.run(["bash", str(ROOT / ".ci/cookbook-venv")], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable})
    if out.returncode:
        pytest.fail("tinker-cookbook's virtual environment could not be built (it needs the package index once): "
                    f"run `.ci/cookbook-venv` where the index is reachable, or set POSTTRAIN_COOKBOOK_PYTHON to a "
                    f"python with tinker-cookbook[math-rl]==0.5.8.\n{out.stderr[-2000:]}", pytrace=False)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`posttrain serve tiny:llama --tinker` in this process."""
    from posttrain.serve import ServeConfig, Server

    srv = Server(ServeConfig(model=BASE, port=0, max_slots=8, segment_steps=8, tinker=True,
                             tinker_checkpoints=str(tmp_path_factory.mktemp("ckpts")))).start()
    yield srv
    srv.stop()


def run_recipe(python: str, server, kind: str, log_path: Path, *fields: str) -> list[dict]:
    """Runs the cookbook's recipe `kind` ("sl" or "rl") to the end; returns its metrics.jsonl rows."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the cookbook's environment, not ours
    env.update(TINKER_TELEMETRY="0", TINKER_API_KEY="tml-cookbook", HF_HUB_OFFLINE="1")
    folder = str(server.state.tinker.folder)  # the served model's tokenizer (get_info's tokenizer_id)
    cmd = [python, str(ROOT / "tests/cookbook_recipes.py"), kind, server.url, BASE, folder, str(log_path), *fields]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=log_path.parent, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "Training completed" in out.stderr, out.stderr[-3000:]
    return [json.loads(x) for x in (log_path / "metrics.jsonl").read_text().splitlines()]


def checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines()]


def test_supervised_loop_recipe_runs_resumes_and_learns(cookbook_python, server, tmp_path):
    log = tmp_path / "sl-loop"
    fields = ("batch_size=4", "lora_rank=8", "learning_rate=1e-2", "max_length=64", "save_every=1")
    first = run_recipe(cookbook_python, server, "sl", log, *fields)  # 8 rows: 2 steps, a state saved at step 1
    assert [m["step"] for m in first] == [0, 1] and all(m["num_sequences"] == 4 for m in first)
    assert first[1]["train_mean_nll"] < first[0]["train_mean_nll"]  # the step it took helped
    rows = checkpoints(log)
    assert [r["name"] for r in rows] == ["000001", "final"] and rows[-1]["sampler_path"].startswith("tinker://")

    (log / "checkpoints.jsonl").write_text(json.dumps(rows[0]) + "\n")  # as if the run had died during step 1
    again = run_recipe(cookbook_python, server, "sl", log, *fields)[len(first):]  # resumes from the step-1 state
    assert [m["step"] for m in again] == [1]
    np.testing.assert_allclose(again[0]["train_mean_nll"], first[1]["train_mean_nll"], rtol=2e-3)

    # the client closes its session on leaving (its heartbeat would warn after the module's server stops)
    with tinker.ServiceClient(base_url=server.url, api_key="tml-cookbook") as service:
        sampler = service.create_sampling_client(model_path=checkpoints(log)[-1]["sampler_path"]).result()
        seqs = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=3)).result()
        assert len(seqs.sequences) == 2


def test_rl_loop_recipe_with_importance_sampling_runs_to_completion(cookbook_python, server, tmp_path):
    log = tmp_path / "rl-loop"
    source = subprocess.run([cookbook_python, "-c", "import importlib.util as u; print(u.find_spec("
                             "'tinker_cookbook.recipes.rl_loop').origin)"], capture_output=True, text=True, check=True)
    assert 'loss_fn="importance_sampling"' in Path(source.stdout.strip()).read_text()  # the recipe's own step
    metrics = run_recipe(cookbook_python, server, "rl", log, "batch_size=2", "group_size=4", "lora_rank=8",
                         "max_tokens=12", "learning_rate=1e-2", "save_every=0")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # 8 rows, 2 prompts a batch
    assert all(0.0 <= m["reward/total"] <= 1.0 for m in metrics)
    trained = [m for m in metrics if "optim/update_norm" in m]  # batches whose groups had signal: an IS step ran
    assert trained and all(m["optim/update_norm"] > 0 for m in trained)
    final = checkpoints(log)[-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://") and "sampler_path" in final
    with tinker.ServiceClient(base_url=server.url, api_key="tml-cookbook") as service:
        resumed = service.create_training_client_from_state(final["state_path"]).result()
        assert resumed.get_info().model_data.model_name == BASE
