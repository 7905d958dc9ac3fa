"""The host side of `Sampler.generate`: a slot scheduler that admits prompts, runs decode segments, ends turns,
parks slots waiting for their continuation and resumes them, and retires finished sequences.

One `SlotScheduler` serves one call. It owns the slots (which sequence each holds, where it writes next), the
waiting queue, every sequence's tokens and log-probs, and the decode state while the call runs; the compiled
programs (prefill, decode, extend, cache growth: `posttrain.sampling.engine`) are handed to it.

Loop (one iteration; every step below is skipped when it has nothing to do):
1. settle: decide the parked slots whose continuation is known (see "Multi-turn"); blocks only when nothing
   else could run (no slot decoding, no prompt admissible).
2. admit: prefill waiting prompts into free slots (prompt order; a prompt's samples together).
3. resume: one "extend" call prefills the appended ids of every slot whose continuation was decided.
4. decode: one segment (`engine._decode`) over all slots.
5. read: one `distributed.to_host` of the new tokens and the slots' `active` flags; a slot that stopped
   decoding has ended its turn: without `on_turn_end` it is finished, else the callback says what follows.
6. swap: with `between_segments` (partial rollouts), newer weights may replace the programs' weights before
   the next segment (see "Weight versions").

Weight versions. Every token (sampled or appended) is recorded with the policy version of the weights that
ran the iteration it was read in: the prefill, extend and decode calls of one iteration share one set of
weights, and `between_segments` runs only between iterations, so a sequence's versions change exactly at a
segment boundary. The caches of sequences in flight are kept across a swap (their earlier entries were
computed with the older weights); each token's log-prob is the one it was drawn with, i.e. its behaviour
log-prob under the weights (and cache) that produced it.

Multi-turn. `on_turn_end(TurnEnd)` returns None (finished), a list of ids to append, or a
`concurrent.futures.Future` of either. A slot waiting for its answer is parked: it keeps its cache but does
not decode (its `active` flag is off on device), and a decode segment does not count it as free. The answers
are taken at the settle step of each iteration, in slot order; appended ids are prefilled by the extend
program against the slot's kept cache (only the new ids and the turn's last sampled token, which decoding
would feed anyway, are computed), then the slot decodes its next turn with a fresh `max_new_tokens` budget
(less where the context limit is nearer). Sampling keys depend on (seed, key id, sample, index in the
sequence after the prompt) only, so a trajectory's tokens do not depend on when its answers arrive or which
other sequences share the call.

Multi-process meshes: every process runs this loop and calls the callback alike (its `TurnEnd`s come from
the gathered segment reads, so they are equal everywhere), but only process 0's answers count: at each settle
step with parked slots, process 0 takes the answers that are ready (waiting for one when blocked) and
broadcasts them (`distributed.broadcast_json`); every process applies that same list. A future that resolves
at different times on different processes therefore cannot desynchronise them (the other processes' futures
are never waited for). Whether a settle step broadcasts depends only on which slots are parked, which every
process knows alike.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from posttrain import distributed
from posttrain.sampling.params import Completion, SamplingParams, TurnEnd

MIN_BUCKET = 16


def pow2(n: int) -> int:
    """The next power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def length_bucket(n: int, cap: int, minimum: int = MIN_BUCKET) -> int:
    """Padded prefill length of a prompt of n tokens: the next power of two >= max(n, minimum), at most cap."""
    return min(pow2(max(n, minimum)), cap)


def continuation_bucket(n: int, cap: int, minimum: int = MIN_BUCKET) -> int:
    """Padded length of a continuation (appended ids + the pending token): the next of 2^k or 3 * 2^(k-1)
    >= max(n, minimum), at most cap. Appends are short, so their padding is a large share of the extend
    call's work (17 positions: 24, not 32); the half steps at most double its compiled shapes."""
    b = pow2(max(n, minimum))
    return min(b * 3 // 4 if b * 3 // 4 >= n and b >= 2 * minimum else b, cap)


class Programs(NamedTuple):
    """What the scheduler runs on device: the compiled programs of `posttrain.sampling.engine`, with the
    model state and the call's traced sampling values bound (see `Sampler.generate`)."""

    prefill: Callable  # (ds, ids, lens, a_row, a_slot, a_prompt, a_sample, max_new, rows) -> (ds, first)
    decode: Callable  # (ds, min_free, max_steps) -> (ds, record, steps)
    extend: Callable  # (ds, ids, lens, slot, n_after, max_new) -> (ds, first)
    grow: Callable  # (ds, new_len) -> ds


@dataclasses.dataclass
class _Seq:
    """One sequence in a slot: what it sampled and was appended, and where its current turn starts."""

    prompt: int
    sample: int
    prompt_len: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    slps: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    versions: list[int | None] = dataclasses.field(default_factory=list)
    turn: int = 0
    turn_start: int = 0
    reason: str = "length"

    def add(self, tok: list[int], lp: list[float], slp: list[float], version: int | None, sampled: bool = True):
        self.tokens.extend(tok)
        self.lps.extend(lp)
        self.slps.extend(slp)
        self.versions.extend([version] * len(tok))
        self.mask.extend([int(sampled)] * len(tok))


class SlotScheduler:
    """Runs one `generate` call over `slots` slots (see the module docstring).

    prompts: token id lists; params: the call's `SamplingParams`; max_len: the context limit of every sequence
    (prompt and all turns); caps: the cache capacities the call may grow through, starting at cache_len with
    the donated state ds; stop: the stop ids; key_ids: per-prompt ids replacing the prompt index in the sampling
    keys, or None; on_turn_end: the multi-turn callback or None; quantum: free slots that end a segment early
    for waiting prompts (or, in multi-turn calls with none waiting, turns that end one); progress: a `_Progress`-like object or None;
    version: the policy version of the programs' weights; between_segments: called after each segment while work
    remains, returns None or `(programs, version)` with newer weights (see "Weight versions").
    """

    def __init__(self, programs: Programs, ds, prompts: list[list[int]], params: SamplingParams, *, slots: int,
                 max_len: int, caps: list[int], cache_len: int, stop: list[int], vocab_size: int,
                 key_ids: list[int] | None = None, on_turn_end: Callable[[TurnEnd], object] | None = None,
                 quantum: int = 1, profile: bool = False, progress=None, decode_text: Callable | None = None,
                 version: int | None = None,
                 between_segments: Callable[[], tuple[Programs, int | None] | None] | None = None):
        self.programs, self.ds = programs, ds
        self.version, self.between_segments = version, between_segments
        self.prompts, self.params = prompts, params
        self.slots, self.max_len, self.caps, self.cache_len = slots, max_len, caps, cache_len
        self.stop_set, self.vocab_size = set(stop), vocab_size
        self.on_turn_end, self.quantum = on_turn_end, quantum
        self.profile, self.progress, self.decode_text = profile, progress, decode_text
        self.n = params.n
        self.key_ids = key_ids
        self.waiting = collections.deque([i, 0] for i in range(len(prompts)))  # [prompt index, next sample]
        self.waiting_samples = len(prompts) * self.n
        self.owner: list[_Seq | None] = [None] * slots
        self.decoding = [False] * slots  # the slot's sequence is active on device (not parked, not done)
        self.pos = [0] * slots  # where the slot's pending last token goes (its next write)
        self.answers: dict[int, object] = {}  # parked slot -> what on_turn_end returned (value or Future)
        self.ready: list[tuple[int, list[int]]] = []  # (slot, appended ids) to extend at the next resume step
        self.finished: dict[tuple[int, int], Completion] = {}
        self.stats: collections.Counter = collections.Counter()
        self.generated = 0

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[Completion]:
        """Generates every sequence; returns the completions in prompt order, a prompt's samples in a row."""
        t0 = time.perf_counter()
        while self.waiting or any(o is not None for o in self.owner):
            self._settle(block=self._stalled())
            first = self._admit()
            ext = self._resume()
            t_dec = time.perf_counter()
            record, steps = self._decode()
            if first is None and ext is None and record is None:
                continue
            # one read per segment; on a multi-host mesh a collective that every process runs alike
            host = distributed.to_host((first and first[1], ext and ext[1], record, steps, self.ds.active))
            self.stats["decode_seconds"] += time.perf_counter() - t_dec
            self._collect(first and first[0], host[0], ext and ext[0], host[1], host[2], int(host[3]), host[4])
            if self.progress is not None:
                self.progress.update(len(self.finished), self.generated, time.perf_counter() - t0)
            self._swap()
        self.stats["generated_tokens"] = self.generated
        self.stats["seconds"] = time.perf_counter() - t0
        return [self.finished[(p, i)] for p in range(len(self.prompts)) for i in range(self.n)]

    def _swap(self):
        """Between two segments: the weights `between_segments` offers, if any (see "Weight versions")."""
        if self.between_segments is None or not (self.waiting or any(o is not None for o in self.owner)):
            return
        new = self.between_segments()
        if new is not None:
            self.programs, self.version = new
            self.stats["weight_swaps"] += 1

    def _grow_to(self, n: int):
        """Pads the cache so that it holds n positions (the smallest capacity that does, at most max_len)."""
        if n > self.cache_len:
            self.cache_len = next((c for c in self.caps if c >= min(n, self.max_len)), self.max_len)
            self.ds = self.programs.grow(self.ds, self.cache_len)
            self.stats["cache_resizes"] += 1

    def _target(self) -> int:
        head = min(self.n - self.waiting[0][1], self.slots)
        return min(self.waiting_samples, max(head, self.quantum))

    def _free(self) -> list[int]:
        return [s for s in range(self.slots) if self.owner[s] is None]

    def _stalled(self) -> bool:
        """Nothing can run until a parked slot's answer arrives."""
        if not self.answers or any(self.decoding) or self.ready:
            return False
        return not (self.waiting and min(self.n - self.waiting[0][1], self.slots) <= len(self._free()))

    # ------------------------------------------------------------------ admission (prefill)
    def _admit(self):
        """Prefills waiting prompts into free slots when enough are free (or nothing else decodes)."""
        free = self._free()
        if not self.waiting or not (len(free) >= self._target() or not any(self.decoding)):
            return None
        rows, asg = [], []  # asg: (row, slot, prompt, sample)
        while self.waiting:
            p, nxt = self.waiting[0]
            chunk = min(self.n - nxt, self.slots)
            if chunk > len(free) - len(asg):
                break
            rows.append(p)
            for j in range(chunk):
                s = free[len(asg)]
                asg.append((len(rows) - 1, s, p, nxt + j))
                self.owner[s] = _Seq(p, nxt + j, len(self.prompts[p]))
                self.decoding[s], self.pos[s] = True, len(self.prompts[p])
            self.waiting_samples -= chunk
            if nxt + chunk == self.n:
                self.waiting.popleft()
            else:
                self.waiting[0][1] = nxt + chunk
        if not asg:
            return None
        self._grow_to(length_bucket(max(len(self.prompts[p]) for p in rows), self.max_len) + 1)
        return asg, self._run_prefill(rows, asg)

    def _run_prefill(self, rows, asg):
        slots, prompts = self.slots, self.prompts
        n_rows = min(pow2(len(rows)), slots)
        lb = length_bucket(max(len(prompts[p]) for p in rows), self.max_len)
        ids = np.zeros((n_rows, lb), np.int32)
        lens = np.ones((n_rows,), np.int32)
        for r, p in enumerate(rows):
            ids[r, : len(prompts[p])] = prompts[p]
            lens[r] = len(prompts[p])
        a_row = np.zeros((slots,), np.int32)
        a_slot = np.full((slots,), slots, np.int32)  # index `slots` = no assignment (dropped)
        a_prompt = np.zeros((slots,), np.int32)
        a_sample = np.zeros((slots,), np.int32)
        for a, (r, s, p, i) in enumerate(asg):
            a_row[a], a_slot[a], a_sample[a] = r, s, i
            a_prompt[a] = p if self.key_ids is None else self.key_ids[p]
        t = time.perf_counter()
        self.ds, first = self.programs.prefill(self.ds, ids, lens, a_row, a_slot, a_prompt, a_sample,
                                               np.int32(self.params.max_new_tokens), rows)
        if self.profile:
            jax.block_until_ready(first)
            self.stats["prefill_seconds"] += time.perf_counter() - t
        self.stats["prefill_calls"] += 1
        self.stats["prefill_rows"] += len(rows)
        self.stats["prefill_tokens"] += int(lens[: len(rows)].sum())
        return first

    # ------------------------------------------------------------------ continuation (extend)
    def _resume(self):
        """Prefills the appended ids of every decided slot in one extend call (rows and length bucketed)."""
        if not self.ready:
            return None
        ready, self.ready = self.ready, []
        n_rows = min(pow2(len(ready)), self.slots)
        lb = continuation_bucket(max(len(ids) + 1 for _, ids in ready), self.max_len)
        ids_arr = np.zeros((n_rows, lb), np.int32)
        lens = np.ones((n_rows,), np.int32)
        slot = np.full((n_rows,), self.slots, np.int32)  # index `slots` = padding row (dropped)
        n_after = np.zeros((n_rows,), np.int32)
        max_new = np.ones((n_rows,), np.int32)
        for r, (s, ids) in enumerate(ready):
            seq = self.owner[s]
            ids_arr[r, 1: len(ids) + 1] = ids
            lens[r], slot[r], n_after[r] = len(ids) + 1, s, len(seq.tokens)
            left = self.max_len - (seq.prompt_len + len(seq.tokens))  # positions left after the append
            max_new[r] = len(seq.tokens) + min(self.params.max_new_tokens, left)
            self.pos[s] += len(ids) + 1
            self.decoding[s] = True
        self._grow_to(max(self.pos[s] for s, _ in ready))
        t = time.perf_counter()
        self.ds, first = self.programs.extend(self.ds, ids_arr, lens, slot, n_after, max_new)
        if self.profile:
            jax.block_until_ready(first)
            self.stats["continuation_seconds"] += time.perf_counter() - t
        self.stats["continuation_calls"] += 1
        self.stats["continuation_tokens"] += int(lens.sum() - n_rows)
        self.stats["continuation_positions"] += int(lens[: len(ready)].sum())
        self.stats["continuation_padded_positions"] += n_rows * lb
        return [s for s, _ in ready], first

    # ------------------------------------------------------------------ decode
    def _decode(self):
        """One decode segment over all slots, or (None, 0) when no slot decodes."""
        if self.params.max_new_tokens <= 1 or not any(self.decoding):
            return None, 0  # every turn is complete after its first token
        lead = max(self.pos[s] for s in range(self.slots) if self.decoding[s])
        self._grow_to(lead + 1)
        parked = sum(o is not None and not d for o, d in zip(self.owner, self.decoding))
        if self.waiting:
            min_free = parked + self._target()
        elif self.on_turn_end is not None:
            min_free = parked + len(self._free()) + self.quantum
        else:
            min_free = self.slots + 1
        self.ds, record, steps = self.programs.decode(self.ds, np.int32(min_free), np.int32(self.cache_len - lead))
        self.stats["decode_segments"] += 1
        return record, steps

    # ------------------------------------------------------------------ reading a segment
    def _collect(self, admitted, first, extended, ext_first, record, steps, active):
        """Records a segment's tokens; slots that stopped decoding end their turn."""
        self.stats["decode_steps"] += steps
        if admitted:
            f_tok, f_lp, f_slp = (x.tolist() for x in first)
            for a, (_, s, _, _) in enumerate(admitted):
                self.owner[s].add([f_tok[a]], [f_lp[a]], [f_slp[a]], self.version)
            self.generated += len(admitted)
        if extended:
            f_tok, f_lp, f_slp = (x.tolist() for x in ext_first)
            for r, s in enumerate(extended):
                self.owner[s].add([f_tok[r]], [f_lp[r]], [f_slp[r]], self.version)
            self.generated += len(extended)
        for s, seq in enumerate(self.owner):
            if seq is None or not self.decoding[s]:
                continue
            emit = record[3][:steps, s] if steps else None
            if steps and emit.any():
                seq.add(record[0][:steps, s][emit].tolist(), record[1][:steps, s][emit].tolist(),
                        record[2][:steps, s][emit].tolist(), self.version)
                n = int(emit.sum())
                self.pos[s] += n
                self.generated += n
            if not active[s]:
                self._turn_end(s)

    def _turn_end(self, s: int):
        seq = self.owner[s]
        self.decoding[s] = False
        seq.reason = "stop" if seq.tokens and seq.tokens[-1] in self.stop_set else "length"
        if self.on_turn_end is None:
            self._finish(s)
            return
        length = seq.prompt_len + len(seq.tokens)
        sl = slice(seq.turn_start, None)
        turn = TurnEnd(prompt_index=seq.prompt, sample_index=seq.sample, turn=seq.turn, token_ids=seq.tokens[sl],
                       logprobs=seq.lps[sl], sampling_logprobs=seq.slps[sl] if self.params.modifies_distribution
                       else None, finish_reason=seq.reason, room=max(self.max_len - length - 1, 0), length=length)
        self.answers[s] = self.on_turn_end(turn)

    def _finish(self, s: int):
        seq = self.owner[s]
        multi = self.on_turn_end is not None
        self.finished[(seq.prompt, seq.sample)] = Completion(
            prompt_index=seq.prompt, sample_index=seq.sample, token_ids=seq.tokens, logprobs=seq.lps,
            sampling_logprobs=seq.slps if self.params.modifies_distribution else None, finish_reason=seq.reason,
            text=self.decode_text(seq.tokens) if self.decode_text is not None else None,
            mask=seq.mask if multi else None, turns=seq.turn + 1, versions=seq.versions,
        )
        self.owner[s] = None

    # ------------------------------------------------------------------ settling parked slots
    def _settle(self, block: bool):
        """Applies the answers that are known (process 0's on a multi-process mesh; see the module docstring)."""
        if not self.answers:
            return
        if jax.process_count() > 1:
            decided = _ready_answers(self.answers, block, catch=True) if distributed.is_primary() else None
            decided = distributed.broadcast_json(decided)
            if isinstance(decided, dict):
                raise RuntimeError(f"on_turn_end failed on process 0: {decided['error']}")
        else:
            decided = _ready_answers(self.answers, block)
        for s, ids in decided:
            s = int(s)
            del self.answers[s]
            if ids is None:
                self._finish(s)
            else:
                self._append(s, ids)

    def _append(self, s: int, ids: list[int]):
        seq = self.owner[s]
        room = self.max_len - (seq.prompt_len + len(seq.tokens)) - 1
        if len(ids) > room:
            raise ValueError(
                f"on_turn_end appended {len(ids)} ids to prompt {seq.prompt} sample {seq.sample} after turn "
                f"{seq.turn}, but only {max(room, 0)} fit (room) before the context limit of {self.max_len} "
                f"positions (the sequence holds {seq.prompt_len + len(seq.tokens)} tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"on_turn_end appended token id {bad[0]} to prompt {seq.prompt} sample {seq.sample}, "
                             f"outside the vocabulary [0, {self.vocab_size})")
        seq.add(ids, [0.0] * len(ids), [0.0] * len(ids), self.version, sampled=False)
        seq.turn += 1
        seq.turn_start = len(seq.tokens)
        self.ready.append((s, ids))


def _as_ids(value) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"on_turn_end must give None or a list of token ids, got {type(value).__name__}")
    return [int(t) for t in value]


def _ready_answers(answers: dict, block: bool, catch: bool = False):
    """[slot, ids or None] for the parked slots whose answer is known, in slot order; with `block`, waits until
    at least one is. catch: an exception becomes {"error": text} (to be broadcast)."""
    futures = [a for a in answers.values() if isinstance(a, concurrent.futures.Future)]
    if block and len(futures) == len(answers) and not any(f.done() for f in futures):
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
    out = []
    try:
        for s in sorted(answers):
            a = answers[s]
            if isinstance(a, concurrent.futures.Future):
                if not a.done():
                    continue
                a = a.result()
            out.append([s, _as_ids(a)])
    except Exception as e:  # noqa: BLE001 - reported on every process
        if not catch:
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    return out


