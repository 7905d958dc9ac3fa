"""The real-model RL recipe (configs/smollm2_rl_cpu.yaml) for 2 small steps on SmolLM2-135M-Instruct: finite loss,
adapters that moved the model, and an export that transformers loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SIGNAL = '''
def distinct_chars(prompts, completions, **fields):
    return [len(set(text)) / 32 for text in completions]
'''


@pytest.mark.slow
def test_recipe_two_steps_on_the_real_model(tmp_path):
    """Two steps: the second samples with the weights the first trained (published to the sampler). The task's
    checker gives ~1 group in 5 a learning signal at 16 new tokens, so a small second reward (distinct characters)
    gives every group one: the adapters move in two steps without dynamic sampling's resampling, which made this
    test's time (1-7 generation rounds a step) a matter of luck."""
    import torch
    import transformers

    from posttrain.models import from_pretrained
    from posttrain.models.fetch import fetch
    from posttrain.rl.loop import load_rl_config, run_rl
    from posttrain.models.tokenizer import load

    torch.set_num_threads(1)
    (tmp_path / "signal.py").write_text(SIGNAL)
    cfg = load_rl_config(REPO / "configs/smollm2_rl_cpu.yaml", [
        f"output_dir={tmp_path / 'run'}", "trainer.max_steps=2", "rollout.batch_prompts=2", "rollout.group_size=4",
        "rollout.max_slots=8", "rollout.max_new_tokens=16", "trainer.grad_accum=1", "eval.at_start=false",
        "data.eval_limit=4", "trainer.save_every=0", "trainer.progress=false", "optim.warmup_steps=0",
        "rewards.functions=[{name: reasoning_gym, weight: 1.0}, "
        f"{{name: '{tmp_path / 'signal.py'}:distinct_chars', weight: 0.1}}]",
    ])
    assert cfg.model.path == "pypi:smollm2-135m-instruct" and cfg.lora.enabled
    result = run_rl(cfg)
    assert result.steps == 2 and all(np.isfinite(h["loss"]) for h in result.history)
    assert all(h["reward/std"] > 0 and h["grad_norm"] > 0 for h in result.history), result.history
    assert result.evals and 0.0 <= result.evals[-1]["eval/accuracy"] <= 1.0

    path = fetch("smollm2-135m-instruct")
    tok = load(path)
    ids = np.array([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    base = np.asarray(from_pretrained(path)(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(result.hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        tuned = hf(torch.tensor(ids)).logits.numpy()
    assert np.isfinite(tuned).all()
    print(f"\nmax |logit change| after {result.steps} steps: {np.abs(tuned - base).max():.2e}; history: "
          f"{[(h['reward/mean'], h['grad_norm'], h.get('groups/dropped_no_signal')) for h in result.history]}")
    assert np.abs(tuned - base).max() > 1e-3  # the merged adapters changed the model
    assert np.abs(tuned - base).max() < 5.0  # ... without wrecking it
    assert transformers.AutoTokenizer.from_pretrained(str(result.hf_dir)).encode("2+3=5") == tok.encode("2+3=5")
