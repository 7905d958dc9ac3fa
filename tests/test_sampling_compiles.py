"""The sampler's compile budget (issue 40): prefill at most twice and decode once per run, counted with JAX's own
compile events (`tests/compile_counter.py`): greedy and sampled calls share their programs, a call's refills run
at its first prefill shape or at its one refill shape whatever the prompt lengths, and the tokens do not change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from compile_counter import count_compiles

from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.sampling import Sampler, SamplingParams

VOCAB = 96
ROOT = Path(__file__).resolve().parents[1]


def _model(kernels: str = "auto"):
    return init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=512, num_layers=1, kernels=kernels), seed=2)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(n)).tolist() for n in lengths]


STOPS = [5, 17, 29, 41, 53]  # end about one sequence in ten per token: refills of one or two prompts


@pytest.mark.slow
def test_evaluation_and_rollouts_compile_two_prefills_and_one_decode():
    """An RL run's sampler: greedy evaluation (16 prompts), sampled pass@k (16 x 4 through 16 slots, refilled one or
    two prompts at a time) and three rollout steps (4 prompts x 4): one decode program, two prefill programs."""
    model = _model()
    sampler = Sampler(model, max_slots=16)
    held_out = _prompts(np.linspace(5, 28, 16).astype(int))
    with count_compiles() as compiles:
        sampler.generate(held_out, SamplingParams(max_new_tokens=12, temperature=0.0))
        sampled = sampler.generate(held_out, SamplingParams(max_new_tokens=12, n=4, seed=1, stop_token_ids=STOPS))
        refills = sampler.last_stats["prefill_calls"]
        for step in range(3):
            sampler.generate(_prompts((9, 14, 20, 30), seed=step), SamplingParams(max_new_tokens=12, n=4, seed=step))
    assert refills >= 4  # the sampled pass refilled its slots several times
    assert compiles["_decode"] == 1 and compiles["_prefill"] <= 2, compiles
    # the refills ran padded, the tokens are those of each prompt's samples generated on their own
    alone = Sampler(model, max_slots=16, program_cache=sampler.program_cache)
    for p in (0, 7, 15):
        one = alone.generate([held_out[p]], SamplingParams(max_new_tokens=12, n=4, seed=1, stop_token_ids=STOPS),
                             key_ids=[p])
        assert [c.token_ids for c in one] == [c.token_ids for c in sampled[4 * p: 4 * p + 4]]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.slow
def test_a_call_compiles_at_most_two_prefills_whatever_its_prompt_lengths(n):
    """Prompts of 3 to 300 tokens through 8 slots, refilled as sequences stop: the first prefill's shape and one
    refill shape (before: one program per (rows, length bucket) met); the same tokens as one admission of all."""
    model = _model()
    rng = np.random.default_rng(n)
    prompts = _prompts(rng.integers(3, 300, size=24 // n), seed=n)
    params = SamplingParams(max_new_tokens=16, n=n, seed=4, stop_token_ids=STOPS)
    sampler = Sampler(model, max_slots=8)
    with count_compiles() as compiles:
        out = sampler.generate(prompts, params)
    assert sampler.last_stats["prefill_calls"] >= 5
    assert compiles["_prefill"] <= 2 and compiles["_decode"] == 1, compiles
    whole = Sampler(model, max_slots=32).generate(prompts, params)  # every prompt in the first prefill
    assert [c.token_ids for c in out] == [c.token_ids for c in whole]


def test_generic_kernels_decode_every_call_in_all_slots():
    """The generic (accelerator) kernels: a greedy pass of 16 sequences and a sampled one of 64 in a sampler of 64
    slots (as `posttrain eval --n 4` on 16 problems) compile one prefill and one decode program."""
    sampler = Sampler(_model("generic"), max_slots=64)
    prompts = _prompts(np.linspace(4, 30, 16).astype(int))
    with count_compiles() as compiles:
        sampler.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
        assert sampler.last_stats["slots"] == 64
        sampler.generate(prompts, SamplingParams(max_new_tokens=6, n=4, seed=0))
    assert compiles["_decode"] == 1 and compiles["_prefill"] == 1, compiles
    assert Sampler(_model("cpu"), max_slots=64).slots_for(16) == 16  # cpu: request-sized slots


#: runs `posttrain ARGV` for each ARGV of its JSON argument in one fresh process and prints each run's sampler
#: programs by name (the programs of a run's samplers are their own: each run's counts are its own)
RUNNER = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from compile_counter import count_compiles
from posttrain.cli.main import main
from posttrain.models.tiny import resolve_model_path

if __name__ == "__main__":
    resolve_model_path("tiny:llama")
    out = []
    for argv in json.loads(sys.argv[1]):
        with count_compiles() as c:
            rc = main(["--no-compile-cache", *argv])
        out.append({{"rc": rc, "prefill": c["_prefill"], "decode": c["_decode"], "names": dict(c.names)}})
    print("COMPILES " + json.dumps(out))
"""


@pytest.mark.slow
def test_cli_runs_compile_two_prefills_and_one_decode(tmp_path):
    rng = np.random.default_rng(0)
    prompts = tmp_path / "varied.jsonl"
    text = "abcdefghij " * 30
    prompts.write_text("".join(json.dumps({"prompt": text[:n]}) + "\n" for n in rng.integers(3, 300, size=16)))
    runs = [["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(tmp_path / "g.jsonl"),
             "--max-new-tokens", "48", "--max-slots", "16", "--n", "3", "--no-progress"],
            ["rl", "configs/rl_smoke.yaml", f"output_dir={tmp_path / 'rl'}", "trainer.progress=false",
             "trainer.max_steps=4"],
            ["eval", "--model", "tiny:llama", "--data", "tests/data/rl_prompts_tiny.jsonl", "--n", "4",
             "--max-new-tokens", "16", "--reward-workers", "0", "--output", str(tmp_path / "e.jsonl"), "--no-progress"]]
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(runner), json.dumps(runs)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("COMPILES ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    generate, rl, evaluation = json.loads(lines[-1].removeprefix("COMPILES "))
    for r in (generate, rl, evaluation):
        assert r["rc"] == 0, r
    # generate: 16 prompts x 3 samples in 16 slots, refilled; rl: greedy evaluation at the start, sampled pass@k
    # (refilled) and 4 rollout steps
    for r in (generate, rl):
        assert r["prefill"] <= 2 and r["decode"] == 1, r
    # eval on CPU: the greedy pass in 16 slots, the sampled one in 64 (request-sized slots, the cpu kernels' choice)
    assert evaluation["prefill"] <= 2 and evaluation["decode"] <= 2, evaluation
