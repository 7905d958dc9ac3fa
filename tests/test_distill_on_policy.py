"""On-policy distillation: per-token advantages in the policy loss, the teacher/student vocabulary check, config
errors, and a run end to end that lowers the reverse KL on the student's own samples."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms.policy import policy_loss


@pytest.mark.slow
def test_per_token_advantages():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(size=(3, 5)) - 2, jnp.float32)
    old = logp + 0.05 * jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    mask = jnp.asarray((rng.random((3, 5)) > 0.2).astype(np.float32))
    adv = jnp.asarray([0.5, -1.0, 2.0])
    # constant per-token advantages are the per-sequence ones
    a, _ = policy_loss(logp, old, adv, mask)
    b, _ = policy_loss(logp, old, jnp.broadcast_to(adv[:, None], (3, 5)), mask)
    assert float(a) == pytest.approx(float(b), abs=1e-7)
    # on policy (ratio 1) the gradient is -A_t / Σ mask per token
    a_tok = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    g = jax.grad(lambda lp: policy_loss(lp, lp, a_tok, mask)[0])(logp)
    np.testing.assert_allclose(g, -a_tok * mask / mask.sum(), atol=1e-6)
    with pytest.raises(ValueError, match="ratio_level='token'"):
        policy_loss(logp, old, a_tok, mask, ratio_level="sequence")
    with pytest.raises(ValueError, match=r"\[N\]=3 or \[N, T\]"):
        policy_loss(logp, old, jnp.zeros((3, 4)), mask)


def test_different_vocabularies_is_a_clear_error(tmp_path, capsys):
    from posttrain.cli.main import main
    from posttrain.models.tiny import resolve_model_path
    from posttrain.models.tokenizer import build_tokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(resolve_model_path("tiny:llama-small"), teacher)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (teacher / f).unlink()
    build_tokenizer(teacher, vocab=list("0123456789 +?abcdefghij"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    for mode in ("on_policy", "logit"):
        code = main(["--no-compile-cache", "distill", "configs/distill_smoke.yaml", f"mode={mode}",
                     f"teacher.path={teacher}", f"on_policy.prompts.train={prompts}", f"output_dir={tmp_path / mode}"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert f"teacher {teacher} and student tiny:llama have different vocabularies" in err
        assert "tokenizers differ" in err
    # same tokenizer, another output size
    from posttrain.config import ConfigError
    from posttrain.distill.teacher import check_same_vocabulary
    from posttrain.models.tokenizer import load

    tok = load(resolve_model_path("tiny:llama"))
    with pytest.raises(ConfigError, match="output vocabulary sizes differ \\(student 104, teacher 128\\)"):
        check_same_vocabulary(tok, tok, student="S", teacher="T", student_vocab=104, teacher_vocab=128)


def test_config_errors(tmp_path, capsys):
    from posttrain.cli.main import main

    assert main(["distill", "configs/distill_smoke.yaml", "loss.kind=kl"]) == 2
    err = capsys.readouterr().err
    assert "loss.kind" in err and "forward_kl" in err and "jsd" in err
    assert main(["distill", "configs/distill_smoke.yaml", "loss.temprature=2"]) == 2
    assert "temprature" in capsys.readouterr().err
    assert main(["distill", "configs/distill_smoke.yaml", "mode=on_policy", "on_policy.prompts.train="]) == 2
    assert "on_policy.prompts.train" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?"}) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    assert main(["--no-compile-cache", "distill", "configs/distill_smoke.yaml", "mode=on_policy",
                 f"on_policy.prompts.train={bad}", f"output_dir={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl, line 2" in err and "'prompt'" in err


@pytest.mark.slow
def test_on_policy_distillation_lowers_reverse_kl_on_own_samples(tmp_path):
    """The student (tiny:llama) samples, the larger teacher (tiny:llama-small, same tokenizer) scores: the
    per-token reverse KL on the student's own samples falls over 16 steps (means of the first and last 4)."""
    from posttrain.distill.run import load_distill_config, run_distill

    cfg = load_distill_config("configs/distill_smoke.yaml", [
        "mode=on_policy", f"output_dir={tmp_path / 'op'}", "trainer.max_steps=16", "trainer.save_every=8",
        "trainer.log_every=1",
        "on_policy.rollout.batch_prompts=8", "on_policy.rollout.group_size=2", "on_policy.rollout.max_new_tokens=12",
        "optim.lr=3e-3", "optim.warmup_steps=0", "optim.decay=constant", "export_hf=false"])
    summary = run_distill(cfg)
    rows = [json.loads(x) for x in (tmp_path / "op" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    assert len(kl) == 16 and "reverse KL on own samples" in summary
    assert np.mean(kl[-4:]) < 0.7 * np.mean(kl[:4]), kl
    assert all(r["skipped"] == 0 for r in rows if "skipped" in r)
    assert "mode: on_policy" in (tmp_path / "op" / "config.yaml").read_text()


@pytest.mark.slow
def test_on_policy_resume_is_exact(tmp_path):
    """Stopped after step 2 (checkpoint) and resumed, on-policy distillation repeats the uninterrupted run's
    steps 3-4: the same samples (their reverse KL) and the same losses."""
    from posttrain.distill.on_policy import run_on_policy
    from posttrain.distill.run import load_distill_config

    def cfg(out):
        return load_distill_config("configs/distill_smoke.yaml", [
            "mode=on_policy", f"output_dir={out}", "trainer.max_steps=4", "trainer.save_every=2", "trainer.log_every=1",
            "on_policy.rollout.batch_prompts=4", "on_policy.rollout.group_size=2", "on_policy.rollout.max_new_tokens=8",
            "optim.lr=3e-3", "export_hf=false", "trainer.progress=false"])

    full = run_on_policy(cfg(tmp_path / "full"))
    assert run_on_policy(cfg(tmp_path / "part"), stop_after=2).steps == 2
    resumed = run_on_policy(cfg(tmp_path / "part"))
    assert [h["step"] for h in resumed.history] == [3, 4]
    for key in ("distill/reverse_kl", "loss"):
        np.testing.assert_allclose([h[key] for h in resumed.history], [h[key] for h in full.history[2:]], atol=1e-6)
