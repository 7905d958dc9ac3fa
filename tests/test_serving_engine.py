"""The serving engine (`posttrain.sampling.serving`): continuous batching of independent sequences with their own
sampling parameters, against `Sampler.generate` and the learner's log-probs; seeds, per-row filters (against the
per-call `filter_logits`), cancel, scoring, the compile budget (no request parameter compiles a program), refusals
and draining."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from compile_counter import count_compiles

from posttrain.algorithms.sft import token_logprobs
from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.sampling import Sampler, SamplingParams
from posttrain.sampling.filters import filter_logits, filter_rows
from posttrain.sampling.serving import (ContextLengthError, EngineStopped, QueueFull, SequenceRequest,
                                        ServingEngine, Tokens)

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=512, num_layers=1), seed=2)


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model)


@pytest.fixture(scope="module")
def engine(sampler):
    eng = ServingEngine({"m": sampler}, slots=4, segment_steps=4, max_waiting=64).start()
    eng.warmup("m")
    yield eng
    eng.stop()


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(n)).tolist() for n in lengths]


class Out:
    def __init__(self):
        self.ids, self.lps, self.top, self.done, self.event = [], [], [], None, threading.Event()

    def __call__(self, ev):
        if isinstance(ev, Tokens):
            self.ids += ev.token_ids
            self.lps += ev.logprobs
            self.top += ev.top or []
        else:
            self.done = ev
            self.event.set()


def run(engine, reqs, lane="m"):
    outs = [Out() for _ in reqs]
    engine.submit_all(lane, reqs, outs)
    for o in outs:
        assert o.event.wait(120)
    return outs


@pytest.mark.slow
def test_greedy_sequences_equal_generate_with_admissions_mid_flight(engine, model):
    prompts = _prompts((5, 9, 17, 3, 30, 12, 7))  # 7 sequences through 4 slots, two length buckets
    outs = run(engine, [SequenceRequest(p, 10 + 3 * i, temperature=0.0, logprobs=True) for i, p in enumerate(prompts)])
    refs = Sampler(model, max_slots=8).generate(prompts, SamplingParams(max_new_tokens=28, temperature=0.0,
                                                                         stop_token_ids=[]))
    for i, (o, ref) in enumerate(zip(outs, refs)):  # greedy: a shorter budget gives a prefix
        n = 10 + 3 * i
        assert o.ids == ref.token_ids[:n] and o.done.reason == "length"
        assert np.abs(np.asarray(o.lps) - ref.logprobs[:n]).max() <= 1e-5
        assert [t[0][0] for t in o.top] == o.ids  # greedy: the chosen token is the most likely
        assert all(a[1] >= b[1] for t in o.top for a, b in zip(t, t[1:]))


def test_seeded_sequences_do_not_depend_on_their_batch(engine):
    p = _prompts((11,), seed=4)[0]
    req = SequenceRequest(p, 24, temperature=0.9, top_k=30, top_p=0.95, seed=123, sample=1)
    alone = run(engine, [req])[0].ids
    crowd = run(engine, [SequenceRequest(q, 30, temperature=1.3, seed=i) for i, q in enumerate(_prompts((4, 20, 8)))]
                + [req])[-1].ids
    assert alone == crowd
    other = run(engine, [SequenceRequest(p, 24, temperature=0.9, top_k=30, top_p=0.95, seed=124, sample=1)])[0].ids
    assert other != alone


@pytest.mark.slow
def test_per_row_filters_equal_the_per_call_filters():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 50)).astype(np.float32)
    x[0, :3] = 2.0  # ties at the cut-off
    cases = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (3, 0.5, 0.0), (0, 1.0, 0.2), (10, 0.9, 0.05)]
    rows = filter_rows(x, np.asarray([c[0] for c in cases], np.int32), np.asarray([c[1] for c in cases], np.float32),
                       np.asarray([c[2] for c in cases], np.float32))
    for r, (k, p, m) in enumerate(cases):
        ref = filter_logits(x[r: r + 1], k, np.float32(p), np.float32(m))
        np.testing.assert_array_equal(np.asarray(rows[r]), np.asarray(ref[0]))


def test_top_k_one_and_tiny_top_p_sample_the_greedy_tokens(engine):
    p = _prompts((9,), seed=7)[0]
    greedy, k1, p0 = run(engine, [SequenceRequest(p, 16, temperature=0.0),
                                  SequenceRequest(p, 16, temperature=1.5, top_k=1, seed=5),
                                  SequenceRequest(p, 16, temperature=1.5, top_p=1e-6, seed=6)])
    assert greedy.ids == k1.ids == p0.ids


def test_request_parameters_compile_nothing(engine):
    run(engine, [SequenceRequest(p, 6, temperature=0.5) for p in _prompts((5, 6, 7, 8, 9))])
    with count_compiles() as compiles:
        reqs = [SequenceRequest(p, 5 + i, temperature=[0.0, 0.3, 1.0, 1.7][i % 4], top_k=[0, 1, 7, 50][i % 4],
                                top_p=[1.0, 0.9, 0.5, 0.99][(i + 1) % 4], min_p=[0.0, 0.1][i % 2], seed=i * 7919,
                                sample=i % 3, logprobs=bool(i % 2)) for i, p in enumerate(_prompts((3, 8, 12, 5, 14)))]
        run(engine, reqs)
    assert compiles.total == 0, compiles.names


def test_cancel_frees_the_slot(engine):
    longs, short = [Out() for _ in range(4)], Out()
    rids = engine.submit_all("m", [SequenceRequest([5, 6, 7], 480, temperature=1.0, seed=i) for i in range(4)], longs)
    engine.submit("m", SequenceRequest([8, 9], 3, temperature=0.0), short)  # waits: the 4 slots are busy
    while not longs[0].ids:
        threading.Event().wait(0.01)
    engine.cancel(rids[0])
    assert short.event.wait(60) and len(short.ids) == 3
    assert longs[0].done.reason == "cancelled" and len(longs[0].ids) < 480
    assert not any(o.event.is_set() for o in longs[1:])  # the others still decode
    for rid in rids[1:]:
        engine.cancel(rid)
    assert all(o.event.wait(60) and o.done.reason == "cancelled" for o in longs[1:])


def test_scores_are_the_learners_log_probs(engine, model):
    seqs = _prompts((7, 19, 2))
    scored = engine.score("m", seqs, 5).result(60)
    ids, mask = np.zeros((3, 19), np.int32), np.zeros((3, 19), np.int32)
    for r, s in enumerate(seqs):
        ids[r, : len(s)], mask[r, : len(s)] = s, 1
    refs = np.asarray(jax.jit(lambda i, m: token_logprobs(model, i, attention_mask=m))(ids, mask))
    for s, out, ref in zip(seqs, scored, refs):
        assert np.abs(np.asarray(out.logprobs) - ref[: len(s) - 1]).max() <= 1e-5
        assert out.top_ids.shape == (len(s) - 1, 5)
        assert np.all(np.diff(out.top_logprobs, axis=1) <= 0) and np.all(out.logprobs <= out.top_logprobs[:, 0] + 1e-6)


def test_refusals(engine, model):
    with pytest.raises(ContextLengthError, match="maximum context length is 512 tokens"):
        engine.submit("m", SequenceRequest([3] * 500, 20), Out())
    with pytest.raises(ValueError, match="top_p"):
        engine.submit("m", SequenceRequest([3], 2, top_p=0.0), Out())
    with pytest.raises(KeyError):
        engine.submit("other", SequenceRequest([3], 2), Out())
    small = ServingEngine({"m": Sampler(model)}, slots=1, max_waiting=2)  # not started: nothing leaves the queue
    small.submit_all("m", [SequenceRequest([3], 2)] * 2, [Out(), Out()])
    with pytest.raises(QueueFull):
        small.submit("m", SequenceRequest([3], 2), Out())


def test_stop_drains_what_is_in_flight(engine, model, sampler):
    # an engine of its own (the module's programs: nothing compiles)
    eng = ServingEngine({"m": Sampler(model, program_cache=sampler.program_cache)}, slots=4, segment_steps=4).start()
    outs = [Out() for _ in range(6)]
    eng.submit_all("m", [SequenceRequest(p, 12, temperature=0.0) for p in _prompts((4, 5, 6, 4, 5, 6))], outs)
    assert eng.stop(drain=True, timeout=120)
    assert [len(o.ids) for o in outs] == [12] * 6 and all(o.done.reason == "length" for o in outs)
    with pytest.raises(EngineStopped):
        eng.submit("m", SequenceRequest([3], 2), Out())


def test_lanes_added_and_removed_while_running(engine, model, sampler):
    """A lane added at run time (the Tinker API's sampling sessions) samples its own weights with the programs its
    structure compiled already; removing it cancels what it holds and refuses new work."""
    other = init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=512, num_layers=1), seed=3)
    engine.add_lane("b", Sampler(other, program_cache=sampler.program_cache)).result(60)
    with pytest.raises(ValueError, match="exists"):
        engine.add_lane("b", Sampler(other, program_cache=sampler.program_cache)).result(60)
    prompts = _prompts((5, 9))
    with count_compiles() as compiles:
        mine = run(engine, [SequenceRequest(p, 8, temperature=0.0, logprobs=True) for p in prompts], lane="b")
        base = run(engine, [SequenceRequest(p, 8, temperature=0.0, logprobs=True) for p in prompts])
    assert compiles.total == 0, compiles
    assert [o.ids for o in mine] != [o.ids for o in base]  # the lane's own weights
    ids = np.asarray([p + o.ids for p, o in zip(prompts[:1], mine)], np.int32)
    ref = np.asarray(jax.jit(lambda i: token_logprobs(other, i))(ids))[0, len(prompts[0]) - 1:]
    assert np.abs(np.asarray(mine[0].lps) - ref).max() <= 1e-5
    longs = [Out() for _ in range(8)]  # twice the slots: some of them still wait when the lane goes
    engine.submit_all("b", [SequenceRequest([3, 4], 250, temperature=0.0, ignore_stop=True)] * 8, longs)
    engine.remove_lane("b")
    assert all(o.event.wait(60) for o in longs) and any(o.done.reason == "cancelled" for o in longs)
    with pytest.raises(KeyError):
        engine.submit("b", SequenceRequest([3], 2), Out())
    assert run(engine, [SequenceRequest([3, 4], 2)])[0].done.reason == "length"  # the base lane is untouched


def test_a_caller_that_cancelled_its_future_does_not_end_the_engine_thread(sampler):
    """A scoring future its caller cancelled (an HTTP client that went away), then refused (its lane removed, the
    engine stopping): setting a cancelled future's exception raises, which ended the engine's thread (every later
    request, and a server's warmup, then waited forever)."""
    import concurrent.futures

    eng = ServingEngine({"m": sampler}, slots=2)  # not started: its thread's steps are called here
    gone = concurrent.futures.Future()
    gone.cancel()
    eng._apply(("score", "no-such-lane", [[3, 4]], 0, gone), True)
    added = concurrent.futures.Future()
    eng._add("x", sampler, added)
    assert added.result(0) is None
    eng._lanes["x"].scores.append(([[3, 4]], 0, gone))
    eng._remove("x")
    assert gone.cancelled() and "x" not in eng._lanes
