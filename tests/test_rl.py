"""The RL loop end to end on a tiny model: it learns a toy reward, resumes exactly, runs with LoRA + reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_toy_task
from test_profile import event_names

from posttrain.config import ConfigError
from posttrain.rl.batch import build_rl_batch, bucket_length
from posttrain.eval.evaluate import pass_at_k
from posttrain.rl.dispatcher import PromptStream
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rollout.rollouts import Rollouts

REWARD = '''
def count_a(prompts, completions, **fields):
    """1/8 per letter 'a' among the first 8 characters: the toy pattern to learn."""
    return [sum(c == "a" for c in text[:8]) / 8 for text in completions]

def boom(prompts, completions, **fields):
    raise RuntimeError("reward bug")
'''


@pytest.fixture
def toy(tmp_path):
    write_toy_task(tmp_path, REWARD)

    def cfg(name: str, *overrides: str):
        return load_rl_config(None, [
            f"output_dir={tmp_path / name}", "model.path=tiny:llama", f"data.train={tmp_path / 'prompts.jsonl'}",
            "rollout.batch_prompts=4", "rollout.group_size=8", "rollout.max_new_tokens=8",
            f"rewards.functions=[{{name: '{tmp_path / 'reward.py'}:count_a'}}]", "rewards.correctness=null",
            "rewards.num_workers=0", "optim.lr=3e-3", "optim.decay=constant", "trainer.log_every=1",
            "trainer.save_every=0", "trainer.progress=false", "eval.at_start=false", *overrides,
        ])

    return cfg


@pytest.mark.slow
def test_grpo_learns_toy_pattern(toy):
    result = run_rl(toy("learn", "trainer.max_steps=16"))
    rewards = [h["reward/mean"] for h in result.history]
    start, end = np.mean(rewards[:2]), np.mean(rewards[-3:])
    print(f"toy reward: start {start:.3f} -> end {end:.3f}")  # seen: 0.014 -> 0.95
    assert start < 0.1 and end > 0.6
    assert (result.output_dir / "hf" / "model.safetensors").exists()
    rows = [json.loads(x) for x in open(result.output_dir / "metrics.jsonl")]
    for key in ("reward/mean", "reward/count_a", "entropy", "clip_fraction", "completion/length_mean",
                "time/rollout_s", "time/train_s", "throughput/tokens_per_s"):
        assert key in rows[-1], key


@pytest.mark.slow
def test_resume_gives_identical_losses(toy):
    overrides = ("trainer.max_steps=6", "trainer.save_every=3", "trainer.async_checkpointing=false",
                 "learner.minibatches=2", "learner.ppo_epochs=2")
    full = run_rl(toy("full", *overrides))
    cfg = toy("resumed", *overrides)
    first = run_rl(cfg, stop_after=3)
    assert first.steps == 3 and first.hf_dir is None
    second = run_rl(cfg)
    assert second.steps == 6
    a = [h["loss"] for h in full.history[3:]]
    b = [h["loss"] for h in second.history]
    assert len(b) == 3
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    np.testing.assert_allclose([h["reward/mean"] for h in second.history],
                               [h["reward/mean"] for h in full.history[3:]], atol=0)
    # the default layout (learner.share_prompts unset): packed, a group's prompt computed once a row
    assert all(h["pack/packed_cells"] < h["pack/padded_cells"] for h in full.history)


@pytest.mark.slow
def test_lora_rl_with_base_model_as_reference(toy):
    result = run_rl(toy("lora", "trainer.max_steps=3", "lora.enabled=true", "lora.rank=4", "algorithm.beta=0.1",
                        "algorithm.preset=dapo"))
    for h in result.history:
        assert np.isfinite(h["loss"]) and np.isfinite(h["kl"]) and h["kl"] >= 0
    assert result.history[-1]["kl"] > 0  # adapters moved the policy away from the base
    assert (result.hf_dir / "model.safetensors").exists()


def test_raising_reward_costs_no_run(toy, tmp_path):
    result = run_rl(toy("boom", "trainer.max_steps=2", "trainer.profile.steps=1",
                        f"rewards.functions=[{{name: '{tmp_path / 'reward.py'}:boom'}}]"))
    assert result.steps == 2
    # trainer.profile: step 2 traced into tensorboard/, rollout and update as named ranges
    (trace,) = (tmp_path / "boom" / "tensorboard").glob("plugins/profile/*/*.xplane.pb")
    assert {"train", "rollout", "update"} <= event_names(trace)
    assert result.history[-1]["reward/boom/failures"] == 32


def test_missing_reward_field_is_named(toy):
    cfg = toy("missing", "trainer.max_steps=1", "rewards.functions=[{name: math_answer}]")
    with pytest.raises(ValueError, match="answer"):
        import dataclasses

        from posttrain.rl.config import PromptData

        path = cfg.data.train
        rows = [json.loads(x) for x in open(path)]
        with open(path, "w") as f:
            for r in rows:
                r.pop("answer")
                f.write(json.dumps(r) + "\n")
        run_rl(dataclasses.replace(cfg, data=PromptData(train=path)))


def test_unknown_config_key_lists_valid_ones():
    with pytest.raises(ConfigError, match="rollout.group_sise") as e:
        load_rl_config(None, ["rollout.group_sise=4"])
    assert "group_size" in str(e.value)


def test_prompt_stream_is_deterministic_and_covers_epochs():
    a = PromptStream(10, seed=3, shuffle=True)
    first = [a.record(u) for u in range(10)]
    second = [a.record(u) for u in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    b = PromptStream(10, seed=3, shuffle=True)  # a fresh stream (a resumed run) gives the same records
    assert [b.record(u) for u in range(4, 12)] == (first + second)[4:12]
    assert [PromptStream(10, seed=3, shuffle=False).record(u) for u in range(12)] == list(range(10)) + [0, 1]


def test_build_rl_batch_alignment():
    ro = Rollouts(group_size=2, record_index=[0, 0], prompt_ids=[[5, 6, 7], [4, 5, 6, 7]],
                  completion_ids=[[8, 9], [10]], logprobs=[[-0.5, -0.25], [-1.0]],
                  finish_reasons=["stop", "length"], texts=["", ""], prompts_text=["", ""],
                  rewards=np.array([1.0, 0.0], np.float32), per_reward={}, reward_stats={})
    b = build_rl_batch(ro, np.array([0.5, -0.5]), seq_weights=np.array([1.0, 0.0]))
    assert b.input_ids.shape == (2, 32) and b.loss_mask.shape == (2, 16) and b.completion_len == 16
    # prompt left-padded into columns 0..15, completion from column 16
    np.testing.assert_array_equal(b.input_ids[0, 12:19], [0, 5, 6, 7, 8, 9, 0])
    np.testing.assert_array_equal(b.attention_mask[0, 12:19], [0, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(b.positions[0, 13:18], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(b.loss_mask[0, :3], [1, 1, 0])
    np.testing.assert_array_equal(b.behaviour_logp[0, :3], [-0.5, -0.25, 0])
    assert b.loss_mask[1].sum() == 0  # weight 0 (e.g. overlong-filtered)
    # the proximal log-probs are the behaviour ones until the learner sets them; no reference by default
    assert b.old_logp is None and b.ref_logp is None and b.proximal_logp is b.behaviour_logp
    assert set(b.model_inputs()) == {"input_ids", "attention_mask", "positions"}
    half = b.rows(np.array([1]))
    assert len(half) == 1 and half.old_logp is None and half.advantages.tolist() == [-0.5]
    assert bucket_length(33) == 48 and bucket_length(5) == 16


def test_learner_sets_proximal_and_reference_logprobs():
    """The learner fills old_logp on every step (one batch structure for the jitted step): the behaviour
    log-probs without a rollout correction, the training forward's with one (or always with recompute); the
    reference's when there is one."""
    from posttrain.algorithms.correction import RolloutCorrection
    from posttrain.rl.learner import Learner

    ro = Rollouts(group_size=2, record_index=[0, 0], prompt_ids=[[5, 6], [4]], completion_ids=[[8, 9], [10]],
                  logprobs=[[-0.5, -0.25], [-1.0]], finish_reasons=["stop"] * 2, texts=["", ""],
                  prompts_text=["", ""], rewards=np.zeros(2, np.float32), per_reward={}, reward_stats={})
    b = build_rl_batch(ro, np.array([0.5, -0.5]))
    seen = []

    class Scorer:
        grad_accum = 1

        def token_logprobs(self, inputs, last):
            seen.append((sorted(inputs), last))
            return np.full((len(inputs["input_ids"]), last), -3.0, np.float32)

    def ref_fn(inputs, last):
        return np.full((len(inputs["input_ids"]), last), -7.0, np.float32)

    def learner(**kw):
        return Learner(Scorer(), None, ppo_epochs=1, minibatches=1, seed=0, **kw)

    kept = learner(recompute_old=False).score(b)
    assert kept.old_logp is b.behaviour_logp and kept.ref_logp is None and not seen
    assert learner(recompute_old=False, correction=RolloutCorrection(is_level="none")).score(b).old_logp is \
        b.behaviour_logp and not seen  # a correction that corrects nothing: none
    corrected = learner(recompute_old=False, correction=RolloutCorrection(), ref_fn=ref_fn).score(b)
    assert (corrected.old_logp == -3.0).all() and (corrected.ref_logp == -7.0).all()
    assert corrected.behaviour_logp is b.behaviour_logp
    assert seen == [(["attention_mask", "input_ids", "positions"], 16)]
    assert (learner(recompute_old=True).score(b).old_logp == -3.0).all()


@pytest.mark.slow
def test_rl_loss_logprobs_equal_full_forward():
    """The loss scores completion tokens exactly as a plain forward + log-softmax does."""
    import jax
    import jax.numpy as jnp

    from posttrain.algorithms.sft import token_logprobs
    from posttrain.models import init_model
    from posttrain.models.config import llama_like
    from posttrain.rl.loss import rl_loss

    model = init_model(llama_like())
    ro = Rollouts(group_size=2, record_index=[0, 0], prompt_ids=[[5, 6, 7], [4, 5, 6, 7, 9]],
                  completion_ids=[[8, 9, 3], [10]], logprobs=[[0.0] * 3, [0.0]], finish_reasons=["stop"] * 2,
                  texts=["", ""], prompts_text=["", ""], rewards=np.zeros(2, np.float32), per_reward={},
                  reward_stats={})
    b = build_rl_batch(ro, np.array([1.0, -1.0]))
    # old_logp := log-probs from a plain forward of each unpadded sequence; the loss's ratios must all be 1
    ref = [np.asarray(token_logprobs(model, jnp.asarray([p + c])))[0, len(p) - 1:]
           for p, c in zip(ro.prompt_ids, ro.completion_ids)]
    old = np.zeros_like(b.behaviour_logp)
    for i, r in enumerate(ref):
        old[i, : len(r)] = r
    batch = jax.tree.map(jnp.asarray, b.replace(old_logp=old))
    _, _, metrics = rl_loss(model, batch, loss_kwargs={"aggregation": "token_mean"})
    num, den = metrics["ratio_mean"]
    assert abs(float(num / den) - 1.0) < 1e-5


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
