"""Sampling engine: greedy parity with `transformers`, continuous batching, n samples, recompiles, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compile_counter import count_compiles

from posttrain.models import from_pretrained
from posttrain.sampling import Completion, ProgramCache, Sampler, SamplingParams
from posttrain.sampling import engine

TOL = 1e-4
NEW = 12
LENGTHS = (5, 9, 17, 3, 12)  # > sliding_window=5 of gemma 2/3, across two prefill buckets (16, 32)


def _prompts(lengths=LENGTHS, seed=0, vocab=96):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def _hf_greedy(hf, prompt, eos):
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, eos_token_id=eos,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _hf_logprobs(hf, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, -1).numpy()
    at = np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[at, completion]


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return from_pretrained(hf_checkpoint("llama"))


@pytest.fixture(scope="module")
def programs():
    """One program cache for the module's samplers of its model, as a caller's samplers of one model share one
    (the tests that count compiles build samplers with caches of their own)."""
    return ProgramCache()


@pytest.mark.full_optimization
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])  # gemma: sliding windows, soft-caps
def test_greedy_matches_transformers(family, hf_checkpoint):
    import transformers

    path = hf_checkpoint(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    sampler = Sampler(from_pretrained(path), max_slots=8)
    prompts = _prompts()

    # 1) no stop token: every sequence runs the full NEW tokens, on both sides
    ours = sampler.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[]))
    assert [(c.prompt_index, c.sample_index) for c in ours] == [(i, 0) for i in range(len(prompts))]
    for p, c in zip(prompts, ours):
        assert c.token_ids == _hf_greedy(hf, p, None)
        assert c.finish_reason == "length" and len(c.token_ids) == NEW
        assert c.sampling_logprobs is None and c.text is None
        ref = _hf_logprobs(hf, p, c.token_ids)
        assert np.abs(np.asarray(c.logprobs) - ref).max() <= TOL

    # 2) a stop token that some sequences produce mid-way: both stop on it and include it
    stop = ours[1].token_ids[4]
    stopped = sampler.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[stop]))
    for p, c in zip(prompts, stopped):
        assert c.token_ids == _hf_greedy(hf, p, stop)
        if stop in c.token_ids:
            assert c.finish_reason == "stop" and c.token_ids.index(stop) == len(c.token_ids) - 1
        else:
            assert c.finish_reason == "length"
    assert stopped[1].finish_reason == "stop" and len(stopped[1].token_ids) <= 5


def test_default_stop_ids_are_the_model_eos(llama, programs):
    prompts = _prompts()
    free = Sampler(llama, max_slots=8, program_cache=programs).generate(
        prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[]))
    eos_of = free[2].token_ids[3]
    model = llama
    old = model.cfg
    model.cfg = old.replace(eos_token_id=[eos_of])
    try:
        out = Sampler(model, max_slots=8).generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0))
    finally:
        model.cfg = old
    cut = free[2].token_ids.index(eos_of) + 1
    assert out[2].finish_reason == "stop" and out[2].token_ids == free[2].token_ids[:cut]

    class Tok:  # a tokenizer's eos ids win over the config's
        eos_token_ids = [free[0].token_ids[0]]

        def decode(self, ids):
            return " ".join(map(str, ids))

    out = Sampler(llama, Tok(), max_slots=8, program_cache=programs).generate(
        prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0))
    assert out[0].token_ids == free[0].token_ids[:1] and out[0].finish_reason == "stop"
    assert out[0].text == str(free[0].token_ids[0])


@pytest.mark.slow
def test_continuous_batching_matches_plain_batching(llama, programs):
    """10 prompts through 3 slots (slots are refilled as sequences stop) == all 10 at once."""
    prompts = _prompts(lengths=(3, 16, 7, 11, 4, 15, 9, 2, 13, 6), seed=1)
    plain = Sampler(llama, max_slots=16, program_cache=programs)
    free = plain.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[]))
    # stop ids that end several sequences early, at different steps
    stops = [free[0].token_ids[2], free[3].token_ids[6], free[7].token_ids[9]]
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=stops)
    ref = plain.generate(prompts, params)
    assert plain.last_stats["prefill_calls"] == 1
    cont = Sampler(llama, max_slots=3, program_cache=programs)
    out = cont.generate(prompts, params)
    reasons = [c.finish_reason for c in ref]
    assert "stop" in reasons and "length" in reasons
    assert cont.last_stats["slots"] == 3 and cont.last_stats["prefill_calls"] >= 4
    assert cont.last_stats["max_len"] == 32
    for a, b in zip(out, ref):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # sampled completions do not depend on the slot count either (keys come from (seed, prompt, sample))
    sp = SamplingParams(max_new_tokens=NEW, temperature=1.0, stop_token_ids=stops, seed=7)
    a, b = cont.generate(prompts, sp), plain.generate(prompts, sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.slow
def test_cache_growth_gives_the_same_completions(llama, programs):
    """A cache that grows with the sequences (here in steps of 8 positions, so several times per call, also
    while continuous batching admits new prompts) gives what a full-length cache gives."""
    assert engine.cache_capacities(32, 8) == [8, 16, 24, 32] and engine.cache_capacities(30, 16) == [16, 30]
    # default steps: a quarter of max_len, never below MIN_CACHE_STEP (256) positions
    assert Sampler(llama).capacities(192) == [192] and Sampler(llama).capacities(32) == [32]
    assert Sampler(llama).capacities(512) == [256, 512] and Sampler(llama).capacities(2048) == [512, 1024, 1536, 2048]
    assert Sampler(llama, cache_step=0).capacities(192) == [192]
    prompts = _prompts(lengths=(3, 16, 7, 11, 4, 15, 9, 2, 13, 6), seed=1)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    full = Sampler(llama, max_slots=16, cache_step=0, program_cache=programs)
    ref = full.generate(prompts, params)
    assert full.last_stats.get("cache_resizes", 0) == 0 and full.last_stats["cache_len"] == 32
    stops = [ref[0].token_ids[2], ref[3].token_ids[6], ref[7].token_ids[9]]
    grew = 0
    for slots in (16, 3):
        for sp in (params, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=stops),
                   SamplingParams(max_new_tokens=NEW, temperature=1.0, stop_token_ids=stops, seed=3)):
            grown = Sampler(llama, max_slots=slots, cache_step=8, program_cache=programs)
            out = grown.generate(prompts, sp)
            # the first capacity holds the prompt bucket (16) + 1, i.e. 24 positions: longer sequences grow it
            if max(len(p) + len(c.token_ids) for p, c in zip(prompts, out)) > 24:
                assert grown.last_stats["cache_resizes"] >= 1 and grown.last_stats["cache_len"] == 32
                grew += 1
            expect = full.generate(prompts, sp)
            for a, b in zip(out, expect):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert grew >= 2  # the stop-free calls at least
    # a call starts again from the smallest capacity holding its prompt bucket (16) + 1 (the last cache is replaced)
    short = Sampler(llama, max_slots=4, max_len=32, cache_step=8, program_cache=programs)
    short.generate(prompts[:2], params)
    short.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=[]))
    assert short.last_stats["cache_len"] == 24 and short.last_stats.get("cache_resizes", 0) == 0
    with pytest.raises(ValueError, match="cache_step"):
        Sampler(llama, cache_step=-1)


@pytest.mark.slow
def test_n_samples_share_prefill_and_come_in_a_row(llama, programs):
    prompts = _prompts(lengths=(6, 14), seed=2)
    sampler = Sampler(llama, max_slots=8, program_cache=programs)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=1.0, n=4, seed=3))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, i) for p in range(2) for i in range(4)]
    assert sampler.last_stats["prefill_calls"] == 1 and sampler.last_stats["prefill_rows"] == 2
    assert len({tuple(c.token_ids) for c in out[:4]}) > 1  # independent samples
    assert all(c.sampling_logprobs is None for c in out)  # temperature 1, no filter: same distribution
    # copied cache rows are right: n greedy samples equal the single greedy completion
    g1 = sampler.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[]))
    g3 = sampler.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[], n=3))
    assert sampler.last_stats["prefill_rows"] == 2
    for p in range(2):
        for i in range(3):
            assert g3[3 * p + i].token_ids == g1[p].token_ids
            np.testing.assert_allclose(g3[3 * p + i].logprobs, g1[p].logprobs, atol=1e-5)
    # more samples than slots: still complete and ordered (groups split into slot-sized chunks)
    big = Sampler(llama, max_slots=3, program_cache=programs).generate(
        prompts, SamplingParams(max_new_tokens=NEW, n=5, seed=1))
    assert [(c.prompt_index, c.sample_index) for c in big] == [(p, i) for p in range(2) for i in range(5)]


@pytest.mark.slow
def test_seed_repeats_and_sampling_logprobs(llama, programs):
    prompts = _prompts(lengths=(4, 10, 7), seed=4)
    sampler = Sampler(llama, max_slots=8, program_cache=programs)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9, n=2, seed=11)
    a = sampler.generate(prompts, params)
    b = sampler.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    c = sampler.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9, n=2,
                                                 seed=12))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # both log-probs against a reference from a plain forward: log_softmax(logits) of the drawn token, and
    # its log-prob under softmax(logits / T) restricted to the top-k, then the top-p nucleus of those
    for comp in a:
        assert len(comp.sampling_logprobs) == len(comp.logprobs) == len(comp.token_ids)
        prompt = prompts[comp.prompt_index]
        logits = np.asarray(llama(np.asarray([prompt + comp.token_ids])))[0, len(prompt) - 1:-1].astype(np.float64)
        raw, samp = [], []
        for row, tok in zip(logits, comp.token_ids):
            raw.append(row[tok] - np.logaddexp.reduce(row))
            x = row / 0.7
            x = np.where(x >= np.sort(x)[-20], x, -np.inf)  # top-k = 20
            srt = np.sort(x[np.isfinite(x)])[::-1]
            p = np.exp(srt - np.logaddexp.reduce(srt))
            keep = int(np.sum(np.cumsum(p) - p < 0.9))  # the nucleus: smallest prefix with mass >= 0.9
            x = np.where(x >= srt[keep - 1], x, -np.inf)
            samp.append(x[tok] - np.logaddexp.reduce(x[np.isfinite(x)]))
        np.testing.assert_allclose(comp.logprobs, raw, atol=1e-4)
        np.testing.assert_allclose(comp.sampling_logprobs, samp, atol=1e-4)


@pytest.mark.slow
def test_reads_current_weights_without_recompiling(llama, hf_checkpoint):
    """RL updates weights in place between calls: the next generate must use them, with no new compile."""
    from flax import nnx

    model = from_pretrained(hf_checkpoint("llama"))
    sampler = Sampler(model, max_slots=8)
    prompts = _prompts(lengths=(5, 9), seed=5)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    before = sampler.generate(prompts, params)
    emb = model.embed_tokens.embedding
    emb[...] = emb[...][::-1]  # a different model, same shapes
    with count_compiles() as compiles:
        after = sampler.generate(prompts, params)
    assert compiles.total == 0, compiles
    for p, c in zip(prompts, after):
        logits = np.asarray(model(np.asarray([p])))[0, -1]
        assert c.token_ids[0] == int(np.argmax(logits))
    assert [c.token_ids for c in before] != [c.token_ids for c in after]
    del nnx


def test_committed_weights_compile_once(hf_checkpoint):
    """A trainer's weights are committed to their device; the sampler's own state must be too from its first
    call, else the second call (a decode output, committed, replacing the fresh state) compiles the prefill
    again (an RL run's second step did; a trace counter does not see it: JAX's compile events do)."""
    import jax
    from flax import nnx

    model = from_pretrained(hf_checkpoint("llama"))
    device = jax.devices()[0]
    for var in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        var[...] = jax.device_put(var[...], device)  # committed, as a jitted training step's outputs are
    sampler = Sampler(model, max_slots=8, max_len=32)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[])
    sampler.generate(_prompts(lengths=(5, 9), seed=5), params)
    with count_compiles() as compiles:
        for seed in (1, 2):
            sampler.generate(_prompts(lengths=(7, 3), seed=seed), params)
    assert compiles.total == 0, compiles


def test_samplers_given_one_program_cache_share_compiled_programs(llama):
    """The compiled programs belong to a sampler's `ProgramCache`: samplers given the same cache (e.g. evaluations
    of several checkpoints of one architecture) compile each program once; a sampler with its own compiles its own."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[])
    prompts = _prompts(lengths=(5, 9), seed=7)
    first = Sampler(llama, max_slots=8, max_len=32)
    want = first.generate(prompts, params)
    with count_compiles() as compiles:
        shared = Sampler(llama, max_slots=8, max_len=32, program_cache=first.program_cache).generate(prompts, params)
    assert compiles.total == 0, compiles
    with count_compiles() as compiles:
        own = Sampler(llama, max_slots=8, max_len=32).generate(prompts, params)
    assert compiles["_prefill"] == 1 and compiles["_decode"] == 1, compiles
    assert [c.token_ids for c in shared] == [c.token_ids for c in own] == [c.token_ids for c in want]


@pytest.mark.slow
def test_no_recompilation_within_a_bucket(llama):
    sampler = Sampler(llama, max_slots=8, max_len=64)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9)
    sampler.generate(_prompts(lengths=(17, 20, 3)), params)  # warm-up: bucket 32
    with count_compiles() as compiles:
        for lengths in [(25, 31, 18), (32, 1, 29), (19, 19, 19)]:
            sampler.generate(_prompts(lengths=lengths), params)
        # other values of temperature / top_p / seed / max_new_tokens are traced values, not constants
        sampler.generate(_prompts(lengths=(20, 21, 22)),
                         SamplingParams(max_new_tokens=9, temperature=1.3, top_p=0.5, seed=5))
    assert compiles.total == 0, compiles
    # the counter does see compilations: a prompt in the next bucket (64) compiles one new prefill
    with count_compiles() as compiles:
        sampler.generate(_prompts(lengths=(40, 3, 5)), params)
    assert compiles["_prefill"] == 1 and compiles["_decode"] == 0, compiles
    # top-p on or off is static: the first greedy call (top-p off) compiles programs without its sort, exactly one
    # new program each (the sampler has a program cache of its own)...
    with count_compiles() as compiles:
        sampler.generate(_prompts(lengths=(25, 31, 18)), SamplingParams(max_new_tokens=6, temperature=0.0))
    assert compiles["_prefill"] == 1 and compiles["_decode"] == 1, compiles
    with count_compiles() as compiles:
        sampler.generate(_prompts(lengths=(20, 21, 22)), SamplingParams(max_new_tokens=9, temperature=0.0, seed=4))
    assert compiles.total == 0, compiles
    # ...and greedy-or-not is traced: sampling without top-p, at any temperature, reuses the greedy call's programs
    # (issue 40: an evaluation's greedy pass and the rollouts share one decode program)
    with count_compiles() as compiles:
        sampler.generate(_prompts(lengths=(25, 31, 18)), SamplingParams(max_new_tokens=6, temperature=0.8))
        sampler.generate(_prompts(lengths=(25, 31, 18)), SamplingParams(max_new_tokens=6, temperature=1.2, seed=2))
    assert compiles.total == 0, compiles


def test_bad_input(llama):
    sampler = Sampler(llama, max_slots=8)
    params = SamplingParams(max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[5, 6], [], [7]], params)
    # the tiny checkpoints have max_position_embeddings=256
    with pytest.raises(ValueError, match=r"prompt 2 has 250 tokens.*max_new_tokens=8.*258.*256"):
        sampler.generate([[5], [6], [7] * 250], params)
    with pytest.raises(ValueError, match=r"prompt 0 has 30 tokens.*max_len=32"):
        Sampler(llama, max_len=32).generate([[5] * 30], params)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 96 outside"):
        sampler.generate([[5, 96]], params)
    assert sampler.generate([], params) == []
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"top_p={bad}"):
            SamplingParams(top_p=bad)
    for field, value in [("temperature", -1.0), ("n", 0), ("max_new_tokens", 0), ("top_k", -1), ("min_p", 1.0),
                         ("min_p", -0.5)]:
        with pytest.raises(ValueError, match=rf"{field}={value}"):
            SamplingParams(**{field: value})
    # the sampler is still usable after a rejected call
    out = sampler.generate([[5, 6, 7]], SamplingParams(max_new_tokens=NEW, temperature=0.0))
    assert isinstance(out[0], Completion) and 1 <= len(out[0].token_ids) <= NEW


def test_progress_callback(llama, programs):
    seen = []
    out = Sampler(llama, max_slots=3, program_cache=programs).generate(  # continuous batching's slots: no compile
        _prompts(lengths=(3, 4, 5, 6)), SamplingParams(max_new_tokens=NEW, stop_token_ids=[]),
        progress=lambda done, total, tokens, secs: seen.append((done, total, tokens)))
    assert seen[-1] == (4, 4, 4 * NEW) and len(out) == 4 and len(seen) >= 2
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_key_ids_make_a_prompts_samples_independent_of_its_batch(llama, programs):
    s = Sampler(llama, max_slots=8, program_cache=programs)
    p = SamplingParams(max_new_tokens=NEW, temperature=1.0, n=3, seed=5)
    a, b = _prompts((6, 11), seed=3)
    together = s.generate([a, b], p, key_ids=[70, 91])
    alone = s.generate([b], p, key_ids=[91])
    assert [c.token_ids for c in together[3:]] == [c.token_ids for c in alone]
    by_position = s.generate([b], p)  # without key_ids, the keys follow the prompt's position in the call
    assert [c.token_ids for c in by_position] != [c.token_ids for c in alone]
    with pytest.raises(ValueError, match="key_ids"):
        s.generate([a, b], p, key_ids=[1])


@pytest.mark.slow
def test_load_weights_copies_and_switches_the_policy(hf_checkpoint):
    import jax
    from flax import nnx

    from posttrain.models.weights import flat_weights

    path = hf_checkpoint("llama")
    s = Sampler(from_pretrained(path), max_slots=4)
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    prompts = _prompts((7, 10))
    before = [c.token_ids for c in s.generate(prompts, greedy)]
    other = from_pretrained(path)
    state = nnx.state(other, nnx.Param)
    flat = {k: v * 1.5 for k, v in flat_weights(state).items()}  # a different policy
    s.load_weights(flat, version=3)
    after = [c.token_ids for c in s.generate(prompts, greedy)]
    assert s.version == 3 and after != before
    for x in flat.values():  # the caller's buffers may go (a trainer donates its own): the sampler copied them
        x.delete()
    assert [c.token_ids for c in s.generate(prompts, greedy)] == after
    with pytest.raises(ValueError, match="not in the model"):
        s.load_weights({"layers/nope": jax.numpy.zeros(3)})
