"""The host side of `Sampler.generate`: a slot scheduler that admits prompts, runs decode segments, ends turns,
parks slots waiting for their continuation and resumes them, and retires finished sequences.

One `SlotScheduler` serves one call. It owns the slots (one `_Slot` record per busy slot: the sequence it holds,
its tokens and log-probs, where it writes next, whether it decodes or waits for its continuation), the waiting
queue, and the decode state while the call runs. What it is given comes in a few records: the compiled programs
with their weights' version (`Programs`: prefill, decode, extend, cache growth of `posttrain.sampling.engine`),
what the call asks (`Request`: prompts, sampling parameters, the prompts' images...) and what the sampler fixes
for it (`Setup`). The slot records are the one record of the tokens: a finished slot becomes its `Completion`
(a multi-turn trajectory reads its token buffer from it, `posttrain.agent.buffer.TokenBuffer.from_completion`).

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
    model state and the call's traced sampling values bound (see `Sampler.generate`), and the policy version
    of those weights (what every token they produce is recorded with)."""

    prefill: Callable  # (ds, ids, lens, a_row, a_slot, a_prompt, a_sample, max_new, pixels) -> (ds, first)
    decode: Callable  # (ds, min_free, max_steps) -> (ds, record, steps)
    extend: Callable  # (ds, ids, lens, slot, n_after, max_new) -> (ds, first)
    grow: Callable  # (ds, new_len) -> ds
    version: int | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """What one `generate` call passes: its prompts (token id lists), `SamplingParams` and stop ids; key_ids:
    per-prompt ids replacing the prompt index in the sampling keys, or None; on_turn_end: the multi-turn
    callback or None; progress: a `_Progress`-like object or None; images: prompt p's pixel arrays [C, H, W]
    (float32, one per run of image placeholders in its ids, in order), or None for a text-only call;
    record_experts: the programs return the chosen experts and each completion gets `routed_experts`; on_finish:
    called with each `Completion` as its sequence finishes (on the host loop's thread: it must not block)."""

    prompts: list[list[int]]
    params: SamplingParams
    stop: list[int]
    key_ids: list[int] | None = None
    on_turn_end: Callable[[TurnEnd], object] | None = None
    progress: object = None
    images: list[list[np.ndarray]] | None = None
    record_experts: bool = False
    on_finish: Callable[[Completion], None] | None = None

    def pixels(self, rows: list[int]) -> np.ndarray | None:
        """The pixel values of the images of prompt rows `rows` (in row order: the prefill's placeholders take
        images in order), the count padded to a power of two with blank images (computed, then ignored), or None
        when those rows have no image (the text-only prefill program)."""
        if self.images is None:
            return None
        pix = [x for p in rows for x in self.images[p]]
        if not pix:
            return None
        pix += [np.zeros_like(pix[0])] * (pow2(len(pix)) - len(pix))
        return np.stack(pix)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the sampler fixes for a call: `slots` (sequences at once), `max_len` (the context limit of every
    sequence, prompt and all turns), `caps` (the cache capacities the call may grow through), `quantum` (free
    slots that end a segment early for waiting prompts or, in multi-turn calls with none waiting, turns that
    end one), the model's `vocab_size` (appended ids are checked against it), `pad_ratio` and `pad_positions`
    (when a later prefill runs at the call's first prefill shape: `SlotScheduler._prefill_shape`), `profile`
    (time prefill and extend apart) and `decode_text` (the tokenizer's decode, for `Completion.text`, or None)."""

    slots: int
    max_len: int
    caps: tuple[int, ...]
    vocab_size: int
    quantum: int = 1
    pad_ratio: float = 1.0
    pad_positions: int = 0
    profile: bool = False
    decode_text: Callable[[list[int]], str] | None = None


@dataclasses.dataclass
class _Slot:
    """A busy slot (one record per slot; None = free): the sequence it holds (prompt, sample, what it sampled
    and was appended, where its current turn starts) and where that sequence stands: `pos` (where its pending
    last token goes, the slot's next write), `decoding` (active on device: neither parked nor done) and, while
    parked, on_turn_end's `answer` (ids, None or a Future of either). `experts`: with expert recording, the
    chosen experts [n, L_sparse, k] of the positions fed so far, in chunks (prompt, then each fed token)."""

    prompt: int
    sample: int
    prompt_len: int
    pos: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    slps: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    versions: list[int | None] = dataclasses.field(default_factory=list)
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)
    turn: int = 0
    turn_start: int = 0
    reason: str = "length"
    decoding: bool = True
    parked: bool = False
    answer: object = None

    def add(self, tok: list[int], lp: list[float], slp: list[float], version: int | None, sampled: bool = True):
        self.tokens.extend(tok)
        self.lps.extend(lp)
        self.slps.extend(slp)
        self.versions.extend([version] * len(tok))
        self.mask.extend([int(sampled)] * len(tok))


class SlotScheduler:
    """Runs one `generate` call (see the module docstring): `programs` (with their weights' version) on the
    donated decode state `ds` (its cache length is where the call starts), for `request` with the `setup` the
    sampler chose; `swap`: called after each segment while work remains (`between_segments`), returns None or
    `Programs` with newer weights (see "Weight versions")."""

    def __init__(self, programs: Programs, ds, request: Request, setup: Setup,
                 swap: Callable[[], Programs | None] | None = None):
        self.programs, self.ds, self.swap = programs, ds, swap
        self.request, self.setup = request, setup
        self.cache_len = ds.cache.max_len
        self.n = request.params.n
        self.stop_set = set(request.stop)
        self.waiting = collections.deque([i, 0] for i in range(len(request.prompts)))  # [prompt, next sample]
        self.waiting_samples = len(request.prompts) * self.n
        self.slot: list[_Slot | None] = [None] * setup.slots
        self.ready: list[tuple[int, list[int]]] = []  # (slot, appended ids) to extend at the next resume step
        self.finished: dict[tuple[int, int], Completion] = {}
        self.stats: collections.Counter = collections.Counter()
        self.generated = 0
        self.first_shape: tuple[int, int] | None = None  # (rows, bucket) of the call's first prefill
        longest = max((len(p) for p in request.prompts), default=1)
        # the shape of later prefills that do not fit the first one at a small cost (see `_prefill_shapes`)
        self.refill_shape = (pow2(max(1, -(-setup.quantum // self.n))), length_bucket(longest, setup.max_len))

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[Completion]:
        """Generates every sequence; returns the completions in prompt order, a prompt's samples in a row."""
        t0 = time.perf_counter()
        while self.waiting or self._busy():
            self._settle(block=self._stalled())
            admitted = self._admit()  # [(assignments, first tokens)] per prefill call
            ext = self._resume()
            t_dec = time.perf_counter()
            record, steps = self._decode()
            if not admitted and ext is None and record is None:
                continue
            # one read per segment; on a multi-host mesh a collective that every process runs alike
            host = distributed.to_host(([f for _, f in admitted], ext and ext[1], record, steps, self.ds.active))
            self.stats["decode_seconds"] += time.perf_counter() - t_dec
            self._collect([a for a, _ in admitted], host[0], ext and ext[0], host[1], host[2], int(host[3]), host[4])
            if self.request.progress is not None:
                self.request.progress.update(len(self.finished), self.generated, time.perf_counter() - t0)
            self._swap()
        self.stats["generated_tokens"] = self.generated
        self.stats["seconds"] = time.perf_counter() - t0
        return [self.finished[(p, i)] for p in range(len(self.request.prompts)) for i in range(self.n)]

    def _busy(self) -> bool:
        return any(sl is not None for sl in self.slot)

    def _swap(self):
        """Between two segments: the weights `swap` offers, if any (see "Weight versions")."""
        if self.swap is None or not (self.waiting or self._busy()):
            return
        new = self.swap()
        if new is not None:
            self.programs = new
            self.stats["weight_swaps"] += 1

    def _grow_to(self, n: int):
        """Pads the cache so that it holds n positions (the smallest capacity that does, at most max_len)."""
        max_len = self.setup.max_len
        if n > self.cache_len:
            self.cache_len = next((c for c in self.setup.caps if c >= min(n, max_len)), max_len)
            self.ds = self.programs.grow(self.ds, self.cache_len)
            self.stats["cache_resizes"] += 1

    def _target(self) -> int:
        head = min(self.n - self.waiting[0][1], self.setup.slots)
        return min(self.waiting_samples, max(head, self.setup.quantum))

    def _free(self) -> list[int]:
        return [s for s, sl in enumerate(self.slot) if sl is None]

    def _decoding(self) -> bool:
        return any(sl is not None and sl.decoding for sl in self.slot)

    def _parked(self) -> dict[int, object]:
        """Parked slot -> what on_turn_end returned (value or Future), in slot order."""
        return {s: sl.answer for s, sl in enumerate(self.slot) if sl is not None and sl.parked}

    def _stalled(self) -> bool:
        """Nothing can run until a parked slot's answer arrives."""
        if not self._parked() or self._decoding() or self.ready:
            return False
        return not (self.waiting and min(self.n - self.waiting[0][1], self.setup.slots) <= len(self._free()))

    # ------------------------------------------------------------------ admission (prefill)
    def _admit(self) -> list:
        """Prefills waiting prompts into free slots when enough are free (or nothing else decodes): a list of
        (assignments, first tokens) per prefill call."""
        free = self._free()
        if not self.waiting or not (len(free) >= self._target() or not self._decoding()):
            return []
        prompts = self.request.prompts
        rows, asg = [], []  # asg: (row, slot, prompt, sample)
        while self.waiting:
            p, nxt = self.waiting[0]
            chunk = min(self.n - nxt, self.setup.slots)
            if chunk > len(free) - len(asg):
                break
            rows.append(p)
            for j in range(chunk):
                s = free[len(asg)]
                asg.append((len(rows) - 1, s, p, nxt + j))
                self.slot[s] = _Slot(p, nxt + j, len(prompts[p]), pos=len(prompts[p]))
            self.waiting_samples -= chunk
            if nxt + chunk == self.n:
                self.waiting.popleft()
            else:
                self.waiting[0][1] = nxt + chunk
        if not asg:
            return []
        shape = self._prefill_shape(rows)
        self._grow_to(shape[1] + 1)
        out = []
        for lo in range(0, len(rows), shape[0]):  # chunks of the shape's rows (one chunk unless a refill shape)
            part = [(r - lo, s, p, i) for r, s, p, i in asg if lo <= r < lo + shape[0]]
            out.append((part, self._run_prefill(rows[lo: lo + shape[0]], part, shape)))
        return out

    def _prefill_shape(self, rows: list[int]) -> tuple[int, int]:
        """(rows, length bucket) of the prefill of prompt rows `rows` (see "Prefill shapes" in
        `posttrain.sampling.engine`), always at the bucket of the call's longest prompt: the call's first prefill
        at its rows (to a power of two; with all of a call's prompts, its own shape); a later one at the first
        shape's rows when they hold its rows with at most `Setup.pad_ratio` times as many and at most
        `Setup.pad_positions` positions, else at the call's refill rows (the prompts of one refill quantum), in as
        many calls as its rows need."""
        need, bucket = min(pow2(len(rows)), self.setup.slots), self.refill_shape[1]
        first = self.first_shape
        if first is None:
            self.first_shape = (need, bucket)
            return self.first_shape
        if need <= first[0] <= self.setup.pad_ratio * need and first[0] * bucket <= self.setup.pad_positions:
            return first
        return min(self.refill_shape[0], first[0]), bucket

    def _run_prefill(self, rows, asg, shape):
        slots, prompts, key_ids = self.setup.slots, self.request.prompts, self.request.key_ids
        n_rows, lb = shape
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
            a_prompt[a] = p if key_ids is None else key_ids[p]
        t = time.perf_counter()
        self.ds, first = self.programs.prefill(self.ds, ids, lens, a_row, a_slot, a_prompt, a_sample,
                                               np.int32(self.request.params.max_new_tokens),
                                               self.request.pixels(rows))
        if self.setup.profile:
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
        slots, max_len = self.setup.slots, self.setup.max_len
        n_rows = min(pow2(len(ready)), slots)
        lb = continuation_bucket(max(len(ids) + 1 for _, ids in ready), max_len)
        ids_arr = np.zeros((n_rows, lb), np.int32)
        lens = np.ones((n_rows,), np.int32)
        slot = np.full((n_rows,), slots, np.int32)  # index `slots` = padding row (dropped)
        n_after = np.zeros((n_rows,), np.int32)
        max_new = np.ones((n_rows,), np.int32)
        for r, (s, ids) in enumerate(ready):
            sl = self.slot[s]
            ids_arr[r, 1: len(ids) + 1] = ids
            lens[r], slot[r], n_after[r] = len(ids) + 1, s, len(sl.tokens)
            left = max_len - (sl.prompt_len + len(sl.tokens))  # positions left after the append
            max_new[r] = len(sl.tokens) + min(self.request.params.max_new_tokens, left)
            sl.pos += len(ids) + 1
            sl.decoding = True
        self._grow_to(max(self.slot[s].pos for s, _ in ready))
        t = time.perf_counter()
        self.ds, first = self.programs.extend(self.ds, ids_arr, lens, slot, n_after, max_new)
        if self.setup.profile:
            jax.block_until_ready(first)
            self.stats["continuation_seconds"] += time.perf_counter() - t
        self.stats["continuation_calls"] += 1
        self.stats["continuation_tokens"] += int(lens.sum() - n_rows)
        self.stats["continuation_positions"] += int(lens[: len(ready)].sum())
        self.stats["continuation_padded_positions"] += n_rows * lb
        return [(s, len(ids) + 1) for s, ids in ready], first

    # ------------------------------------------------------------------ decode
    def _decode(self):
        """One decode segment over all slots, or (None, 0) when no slot decodes."""
        if self.request.params.max_new_tokens <= 1 or not self._decoding():
            return None, 0  # every turn is complete after its first token
        lead = max(sl.pos for sl in self.slot if sl is not None and sl.decoding)
        self._grow_to(lead + 1)
        parked = sum(sl is not None and not sl.decoding for sl in self.slot)
        if self.waiting:
            min_free = parked + self._target()
        elif self.request.on_turn_end is not None:
            min_free = parked + len(self._free()) + self.setup.quantum
        else:
            min_free = self.setup.slots + 1
        self.ds, record, steps = self.programs.decode(self.ds, np.int32(min_free), np.int32(self.cache_len - lead))
        self.stats["decode_segments"] += 1
        return record, steps

    # ------------------------------------------------------------------ reading a segment
    def _collect(self, admitted, first, extended, ext_first, record, steps, active):
        """Records a segment's tokens; slots that stopped decoding end their turn."""
        self.stats["decode_steps"] += steps
        version = self.programs.version
        for asg, f in zip(admitted, first):
            f_tok, f_lp, f_slp = (x.tolist() for x in f[:3])
            for a, (r, s, _, _) in enumerate(asg):
                sl = self.slot[s]
                if self.request.record_experts:  # the prompt's positions (row r of the prefill)
                    sl.experts.append(f[3][r, : sl.prompt_len])
                sl.add([f_tok[a]], [f_lp[a]], [f_slp[a]], version)
            self.generated += len(asg)
        if extended:
            f_tok, f_lp, f_slp = (x.tolist() for x in ext_first[:3])
            for r, (s, n_fed) in enumerate(extended):
                if self.request.record_experts:  # the pending token and the appended ids
                    self.slot[s].experts.append(ext_first[3][r, :n_fed])
                self.slot[s].add([f_tok[r]], [f_lp[r]], [f_slp[r]], version)
            self.generated += len(extended)
        for s, sl in enumerate(self.slot):
            if sl is None or not sl.decoding:
                continue
            emit = record[3][:steps, s] if steps else None
            if steps and emit.any():
                sl.add(record[0][:steps, s][emit].tolist(), record[1][:steps, s][emit].tolist(),
                       record[2][:steps, s][emit].tolist(), version)
                if self.request.record_experts:  # each step's fed token (the slot's previous one)
                    sl.experts.append(record[4][:steps, s][emit])
                n = int(emit.sum())
                sl.pos += n
                self.generated += n
            if not active[s]:
                self._turn_end(s)

    def _turn_end(self, s: int):
        sl = self.slot[s]
        sl.decoding = False
        sl.reason = "stop" if sl.tokens and sl.tokens[-1] in self.stop_set else "length"
        on_turn_end = self.request.on_turn_end
        if on_turn_end is None:
            self._finish(s)
            return
        length = sl.prompt_len + len(sl.tokens)
        part = slice(sl.turn_start, None)
        turn = TurnEnd(prompt_index=sl.prompt, sample_index=sl.sample, turn=sl.turn, token_ids=sl.tokens[part],
                       logprobs=sl.lps[part], sampling_logprobs=sl.slps[part]
                       if self.request.params.modifies_distribution else None, finish_reason=sl.reason,
                       room=max(self.setup.max_len - length - 1, 0), length=length)
        sl.parked, sl.answer = True, on_turn_end(turn)

    def _finish(self, s: int):
        sl = self.slot[s]
        decode_text = self.setup.decode_text
        self.finished[(sl.prompt, sl.sample)] = Completion(
            prompt_index=sl.prompt, sample_index=sl.sample, token_ids=sl.tokens, logprobs=sl.lps,
            sampling_logprobs=sl.slps if self.request.params.modifies_distribution else None,
            finish_reason=sl.reason, text=decode_text(sl.tokens) if decode_text is not None else None,
            mask=sl.mask if self.request.on_turn_end is not None else None, turns=sl.turn + 1,
            versions=sl.versions,
            routed_experts=np.concatenate(sl.experts) if self.request.record_experts else None,
        )
        self.slot[s] = None
        if self.request.on_finish is not None:
            self.request.on_finish(self.finished[(sl.prompt, sl.sample)])

    # ------------------------------------------------------------------ settling parked slots
    def _settle(self, block: bool):
        """Applies the answers that are known (process 0's on a multi-process mesh; see the module docstring)."""
        answers = self._parked()
        if not answers:
            return
        if jax.process_count() > 1:
            decided = _ready_answers(answers, block, catch=True) if distributed.is_primary() else None
            decided = distributed.broadcast_json(decided)
            if isinstance(decided, dict):
                raise RuntimeError(f"on_turn_end failed on process 0: {decided['error']}")
        else:
            decided = _ready_answers(answers, block)
        for s, ids in decided:
            s = int(s)
            sl = self.slot[s]
            sl.parked, sl.answer = False, None
            if ids is None:
                self._finish(s)
            else:
                self._append(s, ids)

    def _append(self, s: int, ids: list[int]):
        sl, max_len = self.slot[s], self.setup.max_len
        room = max_len - (sl.prompt_len + len(sl.tokens)) - 1
        if len(ids) > room:
            raise ValueError(
                f"on_turn_end appended {len(ids)} ids to prompt {sl.prompt} sample {sl.sample} after turn "
                f"{sl.turn}, but only {max(room, 0)} fit (room) before the context limit of {max_len} "
                f"positions (the sequence holds {sl.prompt_len + len(sl.tokens)} tokens)")
        vocab = self.setup.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"on_turn_end appended token id {bad[0]} to prompt {sl.prompt} sample {sl.sample}, "
                             f"outside the vocabulary [0, {vocab})")
        sl.add(ids, [0.0] * len(ids), [0.0] * len(ids), self.programs.version, sampled=False)
        sl.turn += 1
        sl.turn_start = len(sl.tokens)
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


