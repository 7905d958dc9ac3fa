"""RL on image prompts: the prompts' images reach the sampler's prefill and every log-prob pass of the learner
(old/proximal, reference, the policy loss), so at step 1 the learner's recomputed log-probs equal the sampler's;
image prompts for a text-only model, packed batches or the fleet are one-line errors."""

from pathlib import Path

import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.data.errors import DataError
from posttrain.rl.batch import build_rl_batch, stack_images
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rollout.rollouts import Rollouts
from posttrain.rl.setup import RLRun

SMOKE = Path(__file__).parents[1] / "configs" / "vlm_rl_smoke.yaml"


def _cfg(model, out, *overrides):
    return load_rl_config(SMOKE, [f"model.path={model}", f"output_dir={out}", "data.train=shapes:?size=16&seed=1",
                                  "data.eval=shapes:?size=4&seed=2", "rollout.batch_prompts=2", "rollout.group_size=4",
                                  "rollout.max_new_tokens=4", "trainer.max_steps=2", "trainer.log_every=1",
                                  "trainer.progress=false", "eval.at_start=false", "eval.every=0", *overrides])


def test_image_batch_holds_each_rows_images_padded_with_blanks():
    a, b = np.full((3, 2, 2), 1.0, np.float32), np.full((3, 2, 2), 2.0, np.float32)
    ro = Rollouts(group_size=1, record_index=[0, 1, 2], prompt_ids=[[1, 2], [3], [4]], completion_ids=[[5], [6], [7]],
                  logprobs=[[-0.1], [-0.2], [-0.3]], finish_reasons=["stop"] * 3, texts=["", "", ""],
                  prompts_text=["", "", ""], rewards=np.zeros(3, np.float32), per_reward={}, reward_stats={})
    batch = build_rl_batch(ro, np.zeros(3), images=[[a, b], [], [b]])
    assert batch.pixel_values.shape == (3, 2, 3, 2, 2)
    assert batch.pixel_values[:, :, 0, 0, 0].tolist() == [[1, 2], [0, 0], [2, 0]]
    assert batch.rows(np.array([2, 0])).pixel_values[:, 0, 0, 0, 0].tolist() == [2, 1]
    assert "pixel_values" in batch.model_inputs()
    assert build_rl_batch(ro, np.zeros(3)).pixel_values is None  # text: no field, the same programs as before
    assert "pixel_values" not in build_rl_batch(ro, np.zeros(3)).model_inputs()
    assert stack_images([[], [a]]).shape == (2, 1, 3, 2, 2)


@pytest.mark.parametrize("override,key", [("learner.pack=true", "learner.pack"), ("fleet.workers=1", "fleet.workers"),
                                          ("learner.share_prompts=true", "learner.share_prompts")])
def test_image_prompts_refuse_packing_and_fleet_before_the_model_loads(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key) as e:
        RLRun(_cfg(tmp_path / "no-model-here", tmp_path / "out", override))
    assert "\n" not in str(e.value) and "image prompts" in str(e.value)


@pytest.mark.slow  # two RL steps on the tiny VLM
def test_rl_on_image_prompts_scores_with_the_images_in_every_pass(tiny_vlm, tmp_path):
    """With the old log-probs recomputed and a reference (beta > 0), step 1's recomputed old log-probs equal the
    sampler's (mismatch_kl: KL(sampler || old)), the policy loss's equal the old ones (ratio 1) and the reference's
    equal the policy's (kl): any pass that dropped the images would differ from the sampler, which had them (the
    random model's float noise: mismatch_kl ~5e-5)."""
    result = run_rl(_cfg(tiny_vlm, tmp_path / "rl", "learner.old_logprobs=recompute", "algorithm.beta=0.01"))
    assert result.steps == 2 and len(result.history) == 2 and result.hf_dir is not None
    first = result.history[0]
    # images dropped from the old/reference pass: mismatch_kl 0.017, kl 0.016; from the loss: ratio 1.0125
    assert first["mismatch_kl"] < 1e-3, first
    assert abs(first["ratio_mean"] - 1.0) < 2e-3, first
    assert first["kl"] < 1e-3, first
    assert all(np.isfinite(h["loss"]) for h in result.history)
    assert "eval/accuracy" in result.evals[-1]


@pytest.mark.slow  # loads a text-only model
def test_image_prompts_for_a_text_only_model_name_the_record(tmp_path):
    with pytest.raises(DataError, match=r"shapes:.*text-only") as e:
        RLRun(_cfg("tiny:llama", tmp_path / "rl", "model.param_dtype=float32"))
    assert "\n" not in str(e.value)
