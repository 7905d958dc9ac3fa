"""`posttrain dpo` end to end: learning on a synthetic preference set, exact resume, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from posttrain.training.dpo import load_dpo_config, run_dpo

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "dpo_smoke.yaml"


def _cfg(out, *overrides):
    return load_dpo_config(SMOKE, [f"output_dir={out}", "trainer.progress=false", *overrides])


@pytest.mark.slow
def test_dpo_raises_heldout_preference_accuracy_and_margin(tmp_path):
    """The smoke recipe (tiny random Llama, frozen reference, 40 steps): on the 48 held-out pairs, the
    reward accuracy and the chosen-minus-rejected margin rise from their starting values (policy =
    reference: 0 and 0), and so does the policy's own preference log π(y_w) > log π(y_l)."""
    res = run_dpo(_cfg(tmp_path / "run", "trainer.max_steps=40", "trainer.eval_every=40", "trainer.eval_batches=6",
                       "export_hf=false"))
    before, after = res.initial_eval, res.eval_metrics
    print("held-out before:", {k: round(v, 3) for k, v in before.items()})
    print("held-out after: ", {k: round(v, 3) for k, v in after.items()})
    assert res.reference == "reference"
    assert abs(before["eval/rewards/margins"]) < 1e-3
    assert after["eval/rewards/accuracies"] >= 0.7 > before["eval/rewards/accuracies"] + 0.3
    assert after["eval/rewards/margins"] > 1.0
    assert after["eval/logps/accuracies"] > before["eval/logps/accuracies"]
    assert after["eval/loss"] < before["eval/loss"] - 0.2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/rewards/accuracies" in rows[0]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= set(rows[1])


@pytest.mark.slow
def test_dpo_resume_is_exact_with_lora_base_reference_precomputed(tmp_path):
    """LoRA with the base (adapters off) as the reference, scored once before training and cached: a run
    stopped after 3 steps and resumed gives the same per-step losses and weights as an uninterrupted one."""
    common = ("trainer.max_steps=6", "trainer.save_every=3", "trainer.eval_every=0", "trainer.log_every=1",
              "lora.enabled=true", "lora.rank=4", "optim.lr=5e-3", "algorithm.precompute_reference=true",
              "export_hf=false")
    full = run_dpo(_cfg(tmp_path / "full", *common))
    assert full.reference == "precomputed" and (tmp_path / "full" / "reference_logps.npz").is_file()
    first = run_dpo(_cfg(tmp_path / "part", *common), stop_after=3)
    assert first.final_step == 3
    second = run_dpo(_cfg(tmp_path / "part", *common))
    assert second.start_step == 3 and second.final_step == 6
    np.testing.assert_allclose([x for _, x in first.losses + second.losses], [x for _, x in full.losses],
                               rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(full.trainer.params), jax.tree.leaves(second.trainer.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    rows = [json.loads(x)["step"] for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5, 6]


def test_cli_bad_preference_data_is_one_line(tmp_path, capsys):
    from posttrain.cli.main import main

    bad = tmp_path / "prefs.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n"
                   + json.dumps({"prompt": "1+2=", "rejected": "4"}) + "\n")
    code = main(["dpo", str(SMOKE), f"data.train={bad}", f"output_dir={tmp_path / 'o'}", "trainer.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == [f"error: {bad}, line 2: missing field 'chosen' (a preference record needs 'chosen' and 'rejected', "
                   "and 'prompt' unless the prompt is implicit); fields present: ['prompt', 'rejected']"]
    code = main(["dpo", str(SMOKE), "algorithm.loss=ipo", "algorithm.gamma=1", f"output_dir={tmp_path / 'o'}"])
    assert code == 2
    assert "algorithm.gamma does not apply to loss 'ipo' (it takes: beta)" in capsys.readouterr().err


def test_reference_is_resolved_in_one_place():
    """The config's auto/base/model (with LoRA or not, with a reference_path or not) -> a ReferenceSource; the
    loss reads a frozen model only for base/model, by its trainer name."""
    from posttrain.algorithms.preference import ReferenceSource, make_preference_loss, make_preset
    from posttrain.config import ConfigError
    from posttrain.training.dpo import PreferenceAlgorithm, resolve_reference

    dpo, simpo = make_preset("sigmoid"), make_preset("simpo")
    R = ReferenceSource
    cases = {("auto", True, None): R.BASE, ("auto", True, "ref/"): R.MODEL, ("auto", False, None): R.MODEL,
             ("base", True, None): R.BASE, ("model", True, None): R.MODEL, ("model", False, "ref/"): R.MODEL}
    for (choice, lora, path), want in cases.items():
        assert resolve_reference(PreferenceAlgorithm(reference=choice, reference_path=path), dpo, lora) is want
        assert resolve_reference(PreferenceAlgorithm(reference=choice, reference_path=path), simpo, lora) is R.NONE
    with pytest.raises(ConfigError, match="algorithm.reference=base needs lora.enabled=true"):
        resolve_reference(PreferenceAlgorithm(reference="base"), dpo, False)
    names = {r: make_preference_loss(dpo, reference=r).names for r in ("precomputed", "base", "reference", "none")}
    assert names == {"precomputed": (), "base": ("base",), "reference": ("reference",), "none": ()}
    assert make_preference_loss(simpo, reference="reference").names == ()
    with pytest.raises(ValueError, match=r"unknown reference source 'model'; accepted: \['precomputed', 'base'"):
        make_preference_loss(dpo, reference="model")
