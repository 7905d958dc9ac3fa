"""Multi-turn (token-in/token-out) continuation in the sampler: exactness against generating from scratch,
prefill counts, parked slots, timing-independent sampling, the completion's layout; and request-sized slots."""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading

import numpy as np
import pytest
from conftest import xla_flags

from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.sampling import ProgramCache, Sampler, SamplingParams, TurnEnd

VOCAB = 96
NEW = 5
LENGTHS = (5, 11, 3, 18)


@pytest.fixture(scope="module")
def model():
    return init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=128, num_layers=2), seed=3)


@pytest.fixture(scope="module")
def programs():
    """One program cache for the module's samplers of its model, as a caller's samplers of one model share one
    (the tests that count compiles build samplers with caches of their own)."""
    return ProgramCache()


def _prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _tool(prompt: int, turn: int, k: int = 0) -> list[int]:
    """The ids a fake tool appends after `turn` of `prompt` (lengths vary: 1 to 20)."""
    n = k or 1 + (7 * prompt + 5 * turn) % 20
    return [3 + (prompt * 11 + turn * 13 + j * 5) % (VOCAB - 3) for j in range(n)]


def _appender(turns: int, log: list | None = None):
    def on_turn_end(t: TurnEnd):
        if log is not None:
            log.append(t)
        return None if t.turn + 1 >= turns else _tool(t.prompt_index, t.turn)
    return on_turn_end


def _turn_tokens(c):
    """The sampled turns of a multi-turn completion, split at the appended (mask 0) runs."""
    turns, cur = [], []
    for tok, m in zip(c.token_ids, c.mask):
        if m:
            cur.append(tok)
        elif cur:
            turns.append(cur)
            cur = []
    return turns + ([cur] if cur else [])


@pytest.mark.parametrize("turns", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_greedy_continuation_equals_generation_from_scratch(model, turns, programs):
    sampler = Sampler(model, max_slots=8, program_cache=programs)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    prompts = _prompts()
    out = sampler.generate(prompts, params, on_turn_end=_appender(turns), max_len=96)
    stats = sampler.last_stats
    ref = Sampler(model, max_slots=8, program_cache=programs)
    for p, (prompt, c) in enumerate(zip(prompts, out)):
        assert c.turns == turns and len(_turn_tokens(c)) == turns
        prefix, pos = list(prompt), 0
        for t in range(turns):
            want = ref.generate([prefix], params)[0]
            assert c.token_ids[pos: pos + NEW] == want.token_ids, (p, t)
            np.testing.assert_allclose(c.logprobs[pos: pos + NEW], want.logprobs, atol=1e-5)
            prefix += want.token_ids
            pos += NEW
            if t + 1 < turns:
                app = _tool(p, t)
                assert c.token_ids[pos: pos + len(app)] == app
                prefix += app
                pos += len(app)
        assert pos == len(c.token_ids)
    # (b) only the appended ids (and each turn's last sampled token, never fed by a decode step) are computed
    appended = sum(len(_tool(p, t)) for p in range(len(prompts)) for t in range(turns - 1))
    assert stats["prefill_tokens"] == sum(LENGTHS)
    assert stats["continuation_tokens"] == appended
    assert stats["continuation_positions"] == appended + len(prompts) * (turns - 1)
    assert stats["continuation_padded_positions"] >= stats["continuation_positions"]
    assert stats["continuation_calls"] == turns - 1  # the slots' turns end together: one extend call per turn


@pytest.mark.slow
def test_layout_room_and_errors(model, programs):
    sampler = Sampler(model, max_slots=8, program_cache=programs)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    prompts = _prompts(lengths=(6, 9))
    log: list[TurnEnd] = []
    out = sampler.generate(prompts, params, on_turn_end=_appender(3, log), max_len=64)
    for p, c in enumerate(out):
        a0, a1 = _tool(p, 0), _tool(p, 1)
        assert c.mask == [1] * NEW + [0] * len(a0) + [1] * NEW + [0] * len(a1) + [1] * NEW
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(c.logprobs, c.mask) if m)
        assert c.finish_reason == "length" and c.sampling_logprobs is None
        ends = [t for t in log if t.prompt_index == p]
        assert [t.turn for t in ends] == [0, 1, 2]
        assert [t.length for t in ends] == [6 + 3 * p + NEW, 6 + 3 * p + 2 * NEW + len(a0),
                                            6 + 3 * p + 3 * NEW + len(a0) + len(a1)]
        assert all(t.room == 64 - t.length - 1 and t.finish_reason == "length" for t in ends)
        assert ends[1].token_ids == c.token_ids[NEW + len(a0): 2 * NEW + len(a0)]
    # plain calls keep mask None
    plain = sampler.generate(prompts, params)
    assert all(c.mask is None and c.turns == 1 for c in plain)
    assert [c.token_ids for c in plain] == [c.token_ids[:NEW] for c in out]
    # an append larger than room is refused, naming the room
    with pytest.raises(ValueError, match=r"appended 60 ids .* only 52 fit"):
        sampler.generate(prompts[:1], params, on_turn_end=lambda t: [5] * 60, max_len=64)
    # the context limit caps a turn: a turn ending there says room 0
    log.clear()
    out = sampler.generate(prompts[:1], params, max_len=20, on_turn_end=lambda t: log.append(t) or (
        [7] * t.room if t.room else None))
    assert len(out[0].token_ids) == 20 - 6 and log[-1].room == 0


def _future_after(delay: float, value):
    fut: concurrent.futures.Future = concurrent.futures.Future()
    threading.Timer(delay, fut.set_result, args=(value,)).start()
    return fut


@pytest.mark.slow
def test_parked_slot_does_not_stall_the_others(model, programs):
    sampler = Sampler(model, max_slots=8, program_cache=programs)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    prompts = _prompts()
    others_done = threading.Event()
    finished_others = []
    events = []

    def on_turn_end(t: TurnEnd):
        events.append((t.prompt_index, t.turn))
        if t.prompt_index == 0 and t.turn == 0:  # answered only once every other sequence has finished
            fut: concurrent.futures.Future = concurrent.futures.Future()

            def resolve():
                ok = others_done.wait(timeout=120)
                fut.set_result(_tool(0, 0) if ok else None)
            threading.Thread(target=resolve, daemon=True).start()
            return fut
        if t.turn + 1 >= 2:
            if t.prompt_index != 0:
                finished_others.append(t.prompt_index)
                if len(finished_others) == len(prompts) - 1:
                    others_done.set()
            return None
        return _tool(t.prompt_index, t.turn)

    out = sampler.generate(prompts, params, on_turn_end=on_turn_end, max_len=96)
    assert others_done.is_set() and out[0].turns == 2  # the others finished while prompt 0 was parked
    assert events.index((0, 1)) > max(events.index((p, 1)) for p in range(1, len(prompts)))
    ref = sampler.generate(prompts, params, on_turn_end=_appender(2), max_len=96)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]


@pytest.mark.slow
def test_sampled_turns_do_not_depend_on_answer_timing(model, programs):
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, n=2, seed=7, stop_token_ids=[9, 17, 33])
    prompts = _prompts(lengths=(5, 11, 3))
    now = Sampler(model, max_slots=8, program_cache=programs).generate(prompts, params, on_turn_end=_appender(3),
                                                                       max_len=96)
    rng = random.Random(0)

    def late(t: TurnEnd):
        value = None if t.turn + 1 >= 3 else _tool(t.prompt_index, t.turn)
        return _future_after(rng.uniform(0.0, 0.3), value)

    # fewer slots than sequences too: continuous batching and parked slots interleave
    for slots in (8, 4):
        later = Sampler(model, max_slots=slots, program_cache=programs).generate(
            prompts, params, on_turn_end=late, max_len=96, key_ids=[0, 1, 2])
        assert [c.token_ids for c in later] == [c.token_ids for c in now]
        assert [c.mask for c in later] == [c.mask for c in now]
        for a, b in zip(later, now):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert any(c.finish_reason == "stop" for c in now)


@pytest.mark.slow
def test_slot_count_follows_the_request(model, programs):
    sampler = Sampler(model, program_cache=programs)  # max_slots=32 by default
    if not sampler.choices.request_sized_slots:
        pytest.skip("request-sized slots are the cpu kernels' choice (the generic kernels use every slot)")
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    small = sampler.generate(_prompts(lengths=(4, 5, 6)), params)
    assert sampler.last_stats["slots"] == 8 and sampler._state.cache.valid.shape[0] == 8
    sampler.generate(_prompts(lengths=(4,) * 16), params)
    assert sampler.last_stats["slots"] == 16 and sampler._state.cache.valid.shape[0] == 16
    sampler.generate(_prompts(lengths=(4,) * 20), SamplingParams(max_new_tokens=3, temperature=0.0, n=3))
    assert sampler.last_stats["slots"] == 32  # at most max_slots
    assert Sampler(model, max_slots=12).slots_for(40) == 12 and Sampler(model, max_slots=12).slots_for(9) == 12
    # the slot count does not change the completions
    three = Sampler(model, max_slots=3, program_cache=programs).generate(_prompts(lengths=(4, 5, 6)), params)
    assert [c.token_ids for c in three] == [c.token_ids for c in small]


MULTI_PROCESS = """
import concurrent.futures, json, sys, threading
from posttrain import distributed
distributed.initialize()
from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.sampling import Sampler, SamplingParams

pid = int(sys.argv[1])
model = distributed.shard_model(init_model(llama_like(vocab_size=96, max_position_embeddings=128), seed=3),
                                distributed.make_mesh())
params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=[])

def on_turn_end(t):
    # process 1 answers late and wrongly: process 0's answers must be the ones used, whenever they come
    ids = None if t.turn >= 2 else [3 + (t.prompt_index * 7 + t.turn) % 50] * (2 + t.prompt_index)
    if pid == 1:
        ids = None if t.turn == 0 and t.prompt_index == 1 else [90] * 3
    fut = concurrent.futures.Future()
    delay = (0.3 if pid == 1 else 0.05 * t.prompt_index)
    threading.Timer(delay, fut.set_result, args=(ids,)).start()
    return fut

out = Sampler(model, max_slots=4).generate([[5, 6, 7], [8] * 9, [9, 10], [11] * 4, [12] * 6], params,
                                           on_turn_end=on_turn_end, max_len=64)
print("RESULT" + json.dumps([[c.token_ids, c.mask] for c in out]), flush=True)
distributed.finish()
"""


@pytest.mark.slow
def test_multi_process_turns_follow_process_0(tmp_path):
    """Two processes (4 CPU devices each) on one mesh: their futures resolve at different times and process
    1's callback answers differently; both end with the completions of one process running process 0's."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4),
               PYTHONPATH=str(root), POSTTRAIN_COMPILE_CACHE="0", POSTTRAIN_COORDINATOR=f"127.0.0.1:{port}",
               POSTTRAIN_NUM_PROCESSES="2")
    ps = [subprocess.Popen([sys.executable, "-c", MULTI_PROCESS, str(i)], env={**env, "POSTTRAIN_PROCESS_ID": str(i)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in ps]
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ps] == [0, 0], logs
    got = [json.loads(next(x for x in log.splitlines() if x.startswith("RESULT"))[6:]) for log in logs]

    def on_turn_end(t):
        return None if t.turn >= 2 else [3 + (t.prompt_index * 7 + t.turn) % 50] * (2 + t.prompt_index)

    ref = Sampler(init_model(llama_like(vocab_size=96, max_position_embeddings=128), seed=3), max_slots=4).generate(
        [[5, 6, 7], [8] * 9, [9, 10], [11] * 4, [12] * 6], SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                         stop_token_ids=[]),
        on_turn_end=on_turn_end, max_len=64)
    assert got[0] == got[1] == [[c.token_ids, c.mask] for c in ref]


def test_continuation_bucket_pads_appends_by_at_most_half_a_power_of_two():
    from posttrain.sampling.scheduler import continuation_bucket

    got = {n: continuation_bucket(n, 4096) for n in (1, 16, 17, 24, 25, 33, 48, 49, 65, 100)}
    assert got == {1: 16, 16: 16, 17: 24, 24: 24, 25: 32, 33: 48, 48: 48, 49: 64, 65: 96, 100: 128}
    assert continuation_bucket(17, 20) == 20  # capped at the context limit
    # few shapes: lengths 1..4096 meet 2 per octave above the minimum
    assert len({continuation_bucket(n, 4096) for n in range(1, 4097)}) == 1 + 2 * 8
