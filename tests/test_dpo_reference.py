"""DPO's precomputed reference (issue 26): the log-probs scored before training are the frozen reference's for
the very pairs of each batch (chosen and rejected in their places), so a first step, with policy = reference,
has zero rewards and margin."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from posttrain.algorithms.preference import sequence_logps
from posttrain.models.hf_io import from_pretrained
from posttrain.models.tiny import resolve_model_path
from posttrain.training.dpo import load_dpo_config, run_dpo

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "dpo_smoke.yaml"


@pytest.mark.slow
def test_precomputed_reference_is_the_frozen_references_for_the_same_pairs(tmp_path):
    seen = {}

    def hook(step, batch):
        seen[step] = {k: np.array(v) for k, v in batch.items()}
        return batch

    out = tmp_path / "run"
    res = run_dpo(load_dpo_config(SMOKE, [f"output_dir={out}", "trainer.progress=false", "trainer.max_steps=1",
                                          "trainer.log_every=1", "trainer.eval_every=0", "export_hf=false",
                                          "algorithm.precompute_reference=true"]), batch_hook=hook)
    assert res.reference == "precomputed"
    batch = seen[1]
    reference = from_pretrained(resolve_model_path("tiny:llama"), dtype="float32")  # the policy's initial weights
    expected = np.asarray(sequence_logps(reference, batch)[0])  # rows 2i chosen, 2i+1 rejected
    assert np.abs(expected[0::2] - expected[1::2]).max() > 0.1  # a swap would show
    np.testing.assert_allclose(batch["ref_logps"], expected, rtol=1e-5, atol=1e-4)
    row = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(row[k]) < 1e-4, (k, row[k])
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-4)  # sigmoid loss at margin 0
