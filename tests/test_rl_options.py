"""RL options through the public API (`run_rl`, `load_rl_config`, `posttrain rl`): recomputed old log-probs,
gradient accumulation, DAPO dynamic sampling (resample rounds, the all-equal fallback), chat prompts, QLoRA
resume, pass@k."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_rl import toy  # noqa: F401 - the toy task fixture (reward: letters 'a' in the completion)

from posttrain.eval.evaluate import evaluate, pass_at_k
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptSet

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_recomputed_old_logprobs_and_grad_accum(toy, monkeypatch):  # noqa: F811
    """`old_logprobs=recompute` re-scores the rollouts with the training forward: with the sampler's log-probs
    made wrong (as a stale or lower-precision behaviour policy would be), the ratios stay exactly 1 and the run
    equals an ordinary one; that run with `grad_accum=2` equals the same with `grad_accum=1`."""
    from posttrain.sampling import Sampler

    steps = ("trainer.max_steps=3", "export_hf=false", "algorithm.beta=0")
    ref = run_rl(toy("ref", *steps))
    generate, calls = Sampler.generate, []

    def off_policy(self, prompts, params, **kw):
        calls.append(1)
        return [dataclasses.replace(c, logprobs=[x - 1.0 for x in c.logprobs])
                for c in generate(self, prompts, params, **kw)]

    monkeypatch.setattr(Sampler, "generate", off_policy)
    got = run_rl(toy("recompute", *steps, "learner.old_logprobs=recompute", "trainer.grad_accum=2",
                     "learner.is_level=none"))
    assert len(calls) == 3
    for a, b in zip(ref.history, got.history):
        assert abs(b["ratio_mean"] - 1.0) < 1e-6 and b["clip_fraction"] == 0.0
        assert b["reward/mean"] == a["reward/mean"]
        np.testing.assert_allclose([b["loss"], b["grad_norm"]], [a["loss"], a["grad_norm"]], rtol=1e-4, atol=1e-6)
    # a step after the first has a loss (step 1's is 0: zero-mean advantages at ratio 1); which step depends on
    # the samples, i.e. on the kernel set's sampler (a step whose groups all score alike has none)
    assert any(h["loss"] != 0.0 for h in got.history[1:])
    # with the off-policy correction on (the default), every token's weight is min(pi_old / mu, 2) = min(e, 2) = 2:
    # the same update, twice as large, and the sampler/trainer mismatch is reported
    corrected = run_rl(toy("corrected", *steps, "learner.old_logprobs=recompute"))
    for a, c in zip(ref.history, corrected.history):
        assert c["is/weight_mean"] == pytest.approx(2.0) and c["is/truncated_frac"] == 1.0
        assert c["mismatch_kl"] == pytest.approx(np.e - 2.0, rel=1e-4)  # r - 1 - log r at r = e
        np.testing.assert_allclose(c["grad_norm"], 2 * a["grad_norm"], rtol=1e-4)


MODE_REWARD = '''
def by_mode(prompts, completions, mode, **fields):
    """-1 for every completion of a "flat" prompt (no signal in its group); varied values in [0, 1) otherwise."""
    return [-1.0 if m == "flat" else (sum(map(ord, t)) % 5) / 5 for t, m in zip(completions, mode)]
'''


@pytest.mark.slow
def test_dynamic_sampling_resamples_and_falls_back(toy, tmp_path):  # noqa: F811
    """Prompts in file order (no shuffle), 4 groups per step, at most max_resample_rounds x 4 = 4 groups dropped
    per step for having no signal (equal rewards); after that such groups are trained as they are. Step 1:
    prompts 0-3 hold one group with signal (2), 0, 1, 3 are dropped; of 4-6, 4 is dropped (the fourth) and
    5, 6 kept; prompt 7 (flat) fills the batch. Step 2: prompts 8-11 are dropped, 12-15 (all flat) are
    trained with zero advantages."""
    (tmp_path / "mode.py").write_text(MODE_REWARD)
    with open(tmp_path / "modes.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": "x" * (1 + i % 4), "mode": "vary" if i in (2, 5, 6) else "flat"}) + "\n")
    res = run_rl(toy("dyn", "trainer.max_steps=2", "export_hf=false", f"data.train={tmp_path / 'modes.jsonl'}",
                     "data.shuffle=false", f"rewards.functions=[{{name: '{tmp_path / 'mode.py'}:by_mode'}}]",
                     "algorithm.dynamic_sampling=true", "learner.max_resample_rounds=1", "algorithm.beta=0"))
    first, second = res.history
    trained = [json.loads(x)["records"] for x in (res.output_dir / "trained.jsonl").read_text().splitlines()]
    assert trained == [[2, 5, 6, 7], [12, 13, 14, 15]]
    assert (first["groups/with_signal"], first["groups/dropped_no_signal"]) == (3, 4) and first["grad_norm"] > 0
    assert (second["groups/with_signal"], second["groups/dropped_no_signal"]) == (0, 4)
    assert second["reward/mean"] == -1.0 and second["loss"] == 0.0 and second["grad_norm"] == 0.0


# ---------------------------------------------------------------------- pass@k
def enumerated_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of all k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_of_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


class ScriptedSampler:
    """A stand-in for `Sampler`: greedy calls return GREEDY[prompt], sampled calls SAMPLED[prompt][:n]."""

    GREEDY = ["so \\boxed{1}", "so \\boxed{5}", "so \\boxed{5}"]
    SAMPLED = [["\\boxed{1}", "\\boxed{7}", "\\boxed{8}", "\\boxed{9}"],  # answer 1: 1 of 4 correct
               ["\\boxed{0}"] * 4,  # answer 2: none correct
               ["\\boxed{3}", "\\boxed{3}", "\\boxed{4}", "\\boxed{3}"]]  # answer 3: 3 of 4 correct

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, params, **kw):
        from posttrain.sampling import Completion

        self.calls.append(params)
        out = []
        for p in range(len(prompt_ids)):
            texts = [self.GREEDY[p]] if params.temperature == 0 else self.SAMPLED[p][: params.n]
            out += [Completion(prompt_index=p, sample_index=i, token_ids=[3] * len(t), logprobs=[0.0] * len(t),
                               sampling_logprobs=None, finish_reason="stop", text=t) for i, t in enumerate(texts)]
        return out


def test_evaluate_greedy_accuracy_and_pass_at_k():
    from posttrain.rewards.runner import RewardRunner, RewardSpec

    records = [{"prompt": f"q{i}", "answer": str(i + 1)} for i in range(3)]
    sampler = ScriptedSampler()
    with RewardRunner([RewardSpec("math_answer")], num_workers=0) as runner:
        e = evaluate(Policy(None, None, sampler=sampler), PromptSet.of(records, [[5, 6]] * 3), runner,
                     correctness="math_answer", max_new_tokens=8, k=2, n_samples=4, temperature=0.7, seed=5)
    greedy, sampled = sampler.calls
    assert greedy.temperature == 0 and (sampled.n, sampled.temperature, sampled.seed) == (4, 0.7, 5)
    assert e["eval/accuracy"] == pytest.approx(1 / 3) and e["eval/num_prompts"] == 3
    assert e["eval/pass@2"] == pytest.approx(np.mean([enumerated_pass_at_k(4, c, 2) for c in (1, 0, 3)]))
    assert e["eval/pass@2"] == pytest.approx(0.5) and e["eval/pass@1_sampled"] == pytest.approx(1 / 3)
    # k > n_samples: k samples are drawn
    with RewardRunner([RewardSpec("math_answer")], num_workers=0) as runner:
        e = evaluate(Policy(None, None, sampler=sampler), PromptSet.of(records, [[5, 6]] * 3), runner,
                     correctness="math_answer", max_new_tokens=8, k=3)
    assert sampler.calls[-1].n == 3
    assert e["eval/pass@3"] == pytest.approx(np.mean([enumerated_pass_at_k(3, c, 3) for c in (1, 0, 2)]))


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_cli_rl_chat_prompts_and_qlora_resume(tmp_path, monkeypatch, capsys):
    """`posttrain rl configs/rl_smoke.yaml` with QLoRA on string prompts rendered with the chat template and a
    system prompt, held-out pass@2 at the end; the same run stopped after step 1 and resumed through `run_rl`
    logs the same step 2 (loss, rewards, evaluation), and metrics.jsonl holds the values the run returned."""
    from posttrain.models import tokenizer as tok_lib
    from posttrain.cli.main import main
    from posttrain.models.tiny import resolve_model_path

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    with open(tmp_path / "prompts.jsonl", "w") as f:  # the smoke prompts as plain strings
        for line in open(ROOT / "tests" / "data" / "rl_prompts_tiny.jsonl"):
            r = json.loads(line)
            f.write(json.dumps({"prompt": r["prompt"][0]["content"], "answer": r["answer"]}) + "\n")
    system = "Answer with a number."
    args = [str(ROOT / "configs" / "rl_smoke.yaml"), "model.path=tiny:llama", f"data.train={tmp_path / 'prompts.jsonl'}",
            f"data.eval={tmp_path / 'prompts.jsonl'}", f"data.system_prompt={system}", "trainer.max_steps=2",
            "trainer.save_every=1", "trainer.keep_checkpoints=1", "trainer.progress=false", "eval.at_start=false",
            "data.eval_limit=6", "rewards.num_workers=0", "lora.enabled=true", "lora.quantize=nf4", "lora.block_size=32",
            "optim.lr=1e-2", "learner.minibatches=2"]  # adapters that move: step 2 depends on step 1's update

    # chat=true renders "Q" as system + user turns with the generation prompt: too long for a limit one short
    tok = tok_lib.load(resolve_model_path("tiny:llama"))
    prompts = [json.loads(x)["prompt"] for x in open(tmp_path / "prompts.jsonl")]
    lengths = [len(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": p}],
                                           add_generation_prompt=True)) for p in prompts]
    assert all(n > len(tok.encode(p)) + 2 for n, p in zip(lengths, prompts))
    longest = int(np.argmax(lengths))
    assert main(["rl", *args, f"output_dir={tmp_path / 'short'}", f"data.max_prompt_tokens={lengths[longest] - 1}"]) == 2
    assert f"prompts.jsonl, line {longest + 1}: the prompt has {lengths[longest]} tokens" in capsys.readouterr().err

    assert main(["rl", *args, f"output_dir={tmp_path / 'cli'}"]) == 0
    assert "done: 2 steps, held-out accuracy" in capsys.readouterr().out
    rows = [json.loads(x) for x in open(tmp_path / "cli" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    (final_eval,) = [r for r in rows if "eval/pass@2" in r]
    assert final_eval["step"] == 2 and final_eval["eval/num_prompts"] == 6
    assert 0 <= final_eval["eval/pass@1_sampled"] <= final_eval["eval/pass@2"] <= 1
    # keep_checkpoints=1: only the last one (named by optimizer updates: 2 steps x 2 minibatches)
    assert sorted(p.name for p in (tmp_path / "cli" / "checkpoints").iterdir()) == ["4"]
    assert (tmp_path / "cli" / "hf" / "model.safetensors").exists()

    cfg = load_rl_config(args[0], [*args[1:], f"output_dir={tmp_path / 'resumed'}"])
    assert run_rl(cfg, stop_after=1).steps == 1
    second = run_rl(cfg)
    (h,) = second.history
    (logged,) = [r for r in rows if r["step"] == 2 and "loss" in r]
    np.testing.assert_allclose([h["loss"], h["grad_norm"]], [logged["loss"], logged["grad_norm"]], atol=1e-6)
    assert h["reward/mean"] == logged["reward/mean"]
    assert second.evals[-1]["eval/pass@2"] == final_eval["eval/pass@2"]
    from safetensors.numpy import load_file

    a, b = load_file(tmp_path / "cli" / "hf" / "model.safetensors"), load_file(second.hf_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)  # same weights
    # metrics.jsonl of the resumed run: the step it ran, with the values run_rl returned
    resumed_rows = [json.loads(x) for x in open(tmp_path / "resumed" / "metrics.jsonl")]
    (row2,) = [r for r in resumed_rows if r["step"] == 2 and "loss" in r]
    assert all(row2[k] == h[k] for k in ("loss", "grad_norm", "reward/mean", "entropy", "clip_fraction"))
    assert math.isfinite(row2["loss"])
