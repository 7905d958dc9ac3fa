"""RL on image prompts: the prompts' images reach the sampler's prefill and every log-prob pass of the learner
(old/proximal, reference, the policy loss), padded, packed or in shared-prompt rows, so at step 1 the learner's
recomputed log-probs equal the sampler's; the fleet's workers get the prompts with their images (one worker at
staleness 0 reproduces the in-process run); image prompts for a text-only model or with multi-turn tools are
one-line errors."""

from pathlib import Path

import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.data.errors import DataError
from posttrain.rl.batch import build_rl_batch, stack_images
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rollout.rollouts import Rollouts
from posttrain.rl.setup import build_rl

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


def test_image_prompts_refuse_multi_turn_tools_before_the_model_loads(tmp_path):
    """The one refusal left: the agent renders its first messages and every appended turn as text (no image
    expansion, no pixels for the extend program), so image prompts stay single-turn."""
    with pytest.raises(ConfigError, match="rollout.tools") as e:
        build_rl(_cfg(tmp_path / "no-model-here", tmp_path / "out", "rollout.tools=[calculator]"))
    assert "\n" not in str(e.value) and "image prompts" in str(e.value)


@pytest.mark.slow  # two RL steps on the tiny VLM, per layout
@pytest.mark.parametrize("layout", ["padded", "learner.pack=true", "learner.share_prompts=true"])
def test_rl_on_image_prompts_scores_with_the_images_in_every_pass(tiny_vlm, tmp_path, layout):
    """With the old log-probs recomputed and a reference (beta > 0), step 1's recomputed old log-probs equal the
    sampler's (mismatch_kl: KL(sampler || old)), the policy loss's equal the old ones (ratio 1) and the reference's
    equal the policy's (kl): any pass that dropped the images would differ from the sampler, which had them (the
    random model's float noise: mismatch_kl ~5e-5). Packed batches (a row's images: its sequences' in row order)
    and shared-prompt rows (the prompt's images once a row) alike."""
    extra = [] if layout == "padded" else [layout]
    result = run_rl(_cfg(tiny_vlm, tmp_path / "rl", "learner.old_logprobs=recompute", "algorithm.beta=0.01", *extra))
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
        build_rl(_cfg("tiny:llama", tmp_path / "rl", "model.param_dtype=float32"))
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a Ray fleet of one worker on the tiny VLM, and the same run in-process
def test_fleet_on_image_prompts_reproduces_the_in_process_run(tiny_vlm, tmp_path):
    """The leases' `Prompt` items carry their images to the worker (Ray): one worker at max_staleness 0 samples
    what the in-process source samples, so every step's metrics agree (deterministic: same seed, same weights), the
    sampler's log-probs included (`mismatch_kl` against the learner's recomputed ones: a worker without the images
    would sample other tokens with other log-probs)."""
    runs = {}
    for name, extra in (("sync", []), ("fleet", ["fleet.workers=1", "fleet.max_staleness=0"])):
        runs[name] = run_rl(_cfg(tiny_vlm, tmp_path / name, "learner.old_logprobs=recompute", *extra))
    sync, fleet = runs["sync"].history, runs["fleet"].history
    assert len(sync) == len(fleet) == 2
    for a, b in zip(sync, fleet):
        same = [k for k in a if not k.startswith(("time/", "fleet/", "throughput/")) and k in b]
        assert {"reward/mean", "loss", "pg_loss", "mismatch_kl"} <= set(same)
        for key in same:
            np.testing.assert_allclose(b[key], a[key], atol=1e-5, err_msg=key)
        assert b["fleet/staleness_max"] == 0
    assert runs["fleet"].evals[-1]["eval/accuracy"] == runs["sync"].evals[-1]["eval/accuracy"]
