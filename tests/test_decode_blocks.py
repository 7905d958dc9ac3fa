"""Decode blocks: decoding k tokens per dispatch (`Sampler(segment_steps=k)`, one `while_loop` on the device) gives
exactly the tokens and log-probs of step-by-step decoding (`segment_steps=1`, back on the host after every token):
greedy and seeded sampling, stops and token budgets mid-block, continuous batching, cache growth, tool calls
mid-block (multi-turn continuations), image prompts, and the sampler on an 8-device mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import xla_flags

from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.sampling import ProgramCache, Sampler, SamplingParams, TurnEnd

VOCAB = 96
BLOCKS = (1, 8, 64)  # 1 = the reference: one decode step per dispatch


@pytest.fixture(scope="module")
def model():
    return init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=256, num_layers=2), seed=7)


@pytest.fixture(scope="module")
def programs():
    return ProgramCache()


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _run(model, programs, prompts, params, block, **kw):
    sampler_kw = {k: kw.pop(k) for k in ("max_slots", "cache_step") if k in kw}
    sampler = Sampler(model, program_cache=programs, segment_steps=block, **{"max_slots": 8, **sampler_kw})
    out = sampler.generate(prompts, params, **kw)
    return out, sampler.last_stats


def _assert_same(got, want):
    """Token for token and bit for bit (log-probs compared exactly, not to a tolerance)."""
    assert [(c.prompt_index, c.sample_index) for c in got] == [(c.prompt_index, c.sample_index) for c in want]
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        assert a.sampling_logprobs == b.sampling_logprobs
        assert (a.finish_reason, a.mask, a.turns) == (b.finish_reason, b.mask, b.turns)


def _compare(model, programs, prompts, params, **kw):
    """Completions of every block size in BLOCKS, checked equal to block 1's; returns (completions, stats) of each."""
    runs = {k: _run(model, programs, prompts, params, k, **dict(kw)) for k in BLOCKS}
    for k in BLOCKS[1:]:
        _assert_same(runs[k][0], runs[1][0])
    assert runs[1][1]["decode_segments"] > runs[BLOCKS[-1]][1]["decode_segments"]  # the blocks were used
    return runs


@pytest.mark.slow
def test_greedy_blocks_equal_step_by_step_with_refills_and_cache_growth(model, programs):
    # 12 prompts through 8 slots: continuous batching admits at block boundaries; a 32-position growth step makes
    # the cache grow mid-call
    prompts = _prompts((5, 11, 3, 18, 9, 30, 2, 14, 7, 21, 4, 16))
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[])
    runs = _compare(model, programs, prompts, params, cache_step=32)
    assert all(len(c.token_ids) == 40 for c in runs[1][0])
    assert all(s["cache_resizes"] >= 1 for _, s in runs.values())


@pytest.mark.slow
def test_seeded_sampling_with_stops_mid_block(model, programs):
    prompts = _prompts((6, 13, 4, 9, 22), seed=1)
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.95, n=3, seed=5,
                            stop_token_ids=[5, 17, 29, 41])
    runs = _compare(model, programs, prompts, params)
    out = runs[1][0]
    stops = sorted(len(c.token_ids) for c in out if c.finish_reason == "stop")
    # sequences end inside blocks of 8 (not at block boundaries) and at different steps
    assert len(stops) >= 4 and any(n % 8 for n in stops) and len(set(stops)) >= 3, stops
    assert any(c.finish_reason == "length" for c in out)
    assert out[0].sampling_logprobs is not None


@pytest.mark.slow
def test_tool_calls_mid_block(model, programs):
    """Turns end on a stop token mid-block; the appended ids of the tool's answer are prefilled (extend) and the
    next turn decodes: the multi-turn completions are those of step-by-step decoding."""
    prompts = _prompts((7, 12, 3, 19), seed=2)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=2, seed=9, stop_token_ids=[11, 23, 37, 53])

    def on_turn_end(t: TurnEnd):
        if t.turn >= 2:
            return None
        return [3 + (t.prompt_index * 11 + t.sample_index * 3 + t.turn * 7 + j) % (VOCAB - 3)
                for j in range(2 + (t.prompt_index + t.turn) % 9)]

    runs = _compare(model, programs, prompts, params, on_turn_end=on_turn_end, max_len=160)
    out = runs[1][0]
    assert all(c.turns == 3 for c in out)
    turn_lengths = [run for c in out for run in _sampled_runs(c.mask)]
    assert any(n % 8 and n < 24 for n in turn_lengths)  # some turns ended mid-block on a stop token
    assert runs[8][1]["continuation_calls"] >= 2


def _sampled_runs(mask):
    runs, n = [], 0
    for m in mask + [0]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


@pytest.fixture(scope="module")
def vlm():
    from posttrain.models.tiny_vlm import VLM_SPECIAL_TOKENS, tiny_vlm_config

    cfg = tiny_vlm_config(len(VLM_SPECIAL_TOKENS) + 40, image_size=16, mm_tokens_per_image=4)
    return init_model(cfg, seed=1)


@pytest.mark.slow
def test_image_prompts(vlm, programs):
    vc = vlm.cfg.vision
    rng = np.random.default_rng(3)

    def text(n):  # ids past the special tokens
        return rng.integers(9, vlm.cfg.vocab_size, size=n).tolist()

    def pixels():
        return rng.normal(size=(3, vc.image_size, vc.image_size)).astype(np.float32)

    image = [vc.boi_token_id] + [vc.image_token_id] * vc.mm_tokens_per_image + [vc.eoi_token_id]
    prompts = [text(3) + image + text(5), text(8), image + text(2) + image + text(4)]
    images = [[pixels()], [], [pixels(), pixels()]]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=4, n=2, stop_token_ids=[12, 30])
    runs = {k: _run(vlm, programs, prompts, params, k, images=images) for k in BLOCKS}
    for k in BLOCKS[1:]:
        _assert_same(runs[k][0], runs[1][0])
    assert runs[1][1]["decode_segments"] > runs[BLOCKS[-1]][1]["decode_segments"]


MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    from posttrain import distributed
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    path = sys.argv[1]
    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, size=n).tolist() for n in (5, 9, 3, 12, 7, 15)]
    mesh = distributed.make_mesh(data=2, fsdp=2, tensor=2)
    model = from_pretrained(path, mesh=mesh)
    cases = {"greedy": SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[]),
             "sampled": SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, n=2, stop_token_ids=[7, 19, 31])}
    out = {}
    for name, params in cases.items():
        runs = {}
        for k in (1, 8):
            sampler = Sampler(model, max_slots=8, segment_steps=k)
            got = sampler.generate(prompts, params)
            runs[k] = dict(tokens=[c.token_ids for c in got], logprobs=[c.logprobs for c in got],
                           reasons=[c.finish_reason for c in got], segments=sampler.last_stats["decode_segments"],
                           cache_spec=str(sampler._state.cache.k[0].sharding.spec))
        out[name] = runs
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_blocks_on_a_mesh(hf_checkpoint, tmp_path):
    path = hf_checkpoint("llama")
    script = tmp_path / "mesh_blocks.py"
    script.write_text(MESH_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT"):])
    for name, runs in res.items():
        one, eight = runs["1"], runs["8"]
        assert eight["tokens"] == one["tokens"] and eight["logprobs"] == one["logprobs"], name
        assert eight["reasons"] == one["reasons"] and one["segments"] > eight["segments"], name
        assert "data" in one["cache_spec"] and "tensor" in one["cache_spec"], one["cache_spec"]
    assert "stop" in res["sampled"]["1"]["reasons"]
