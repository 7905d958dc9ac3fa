"""The generation engine: `Sampler.generate` turns prompts into `Completion`s with continuous batching.

Cache design. The KV cache is *slot-indexed*: per layer, k and v arrays over (slots, max_len, kv_heads,
head_dim) in the layout of the model's kernel set (`posttrain.models.kernels`: [slots, max_len, kv_heads,
head_dim] for generic, keys transposed for cpu), plus a `valid` mask [slots, max_len]
(`posttrain.models.KVCache`). A slot holds one sequence; token p of slot b
lives at [b, p]. It is allocated once per (slots, max_len) configuration, lives in the sampler between
calls and is donated to every compiled call, so the sampler updates it in place and never copies it.
We do not page it: a page table buys memory sharing between sequences of very different lengths and
prefix sharing, at the price of gathers in every attention call and a host-side allocator; with RL's
workload (one length budget for every sample, groups of `n` samples per prompt) slots of `max_len` waste
little, keep every shape static for XLA, and the one thing paging would share (a prompt's prefix across
its `n` samples) is handled by prefilling once and copying the rows.

Cache growth. Attention reads the whole cache row each step (masked), so its cost follows the cache's
length, not the tokens written so far. The cache therefore grows with the sequences: its length is one of
a few capacities (multiples of `cache_step` up to `max_len`); a call starts at the smallest capacity that
holds its prompts' length bucket plus one token, a decode segment stops when the leading active slot
reaches the capacity, and the host pads the cache to the next one (one copy of the cache) before going on.
Each capacity is one more compiled decode program (the capacity a call meets depends only on its length
buckets and max_new_tokens, so repeated calls compile nothing new), so the steps are never shorter than
`MIN_CACHE_STEP` (256) positions: below that, reading a few more cache positions per step costs less than a
compilation. Measured on the CPU benchmark model (16 slots, 64-token prompts): 128 new tokens in a 192-position
cache, one capacity against three: steady state within 2%, first call 2 decode and 2 growth compilations
(~2.5 s) shorter; 448 new tokens in 512 positions: capacities [256, 512] within 2% of [128, 256, 384, 512]
(best of 3), one capacity 15% slower.

Prefill. Waiting prompts are right-padded to a length bucket (powers of two >= 16, capped at max_len) and
the number of prompt rows is rounded up to a power of two, so new prompt lengths within a bucket reuse the
compiled program. The rows are run through the model into a small temporary cache [rows, bucket]; its rows
are then scattered into the slots assigned to them (one prompt row to the `n` slots of its samples, which
is how a GRPO group shares one prefill), the rest of each slot's `valid` row is cleared, and the first
token of every sample is drawn from the prompt's last logits. Prefill shapes: every prefill of a call uses the
length bucket of the call's longest prompt; its first prefill (every slot free: up to slots / n prompts) its own
rows; a later one (a refill) the first one's rows when they hold its own with little padding (at most `pad_ratio`
times as many rows and `pad_positions` positions: `BackendChoices`), else the call's refill rows (the prompts of
one refill quantum), in several calls when more prompts are admitted at once. So a call compiles at most two
prefill programs whatever its prompt lengths and refill sizes (before: one per (rows, bucket) met, 5 and 12 for
80 prompts of 3-300 characters through 16 slots at n = 1 and 3), and a run whose evaluation and rollouts share
a slot count and a bucket two in all (RL smoke: 4 before; tests/test_sampling_compiles.py). Padding changes the
log-probs of the padded calls by float rounding only (the tokens are the same); a call whose prompts all fit its
first prefill (an RL step's rollouts) runs exactly as before. Measured on CPU, the longer bucket of refills cost
no time within the noise (a 0.1 B Llama, 48 prompts of 8-250 tokens, 16 slots: 19.1-20.1 s a call both ways).
Image prompts (`generate(images=...)`, a vision-language model): the call's own record (`Request`) holds each
prompt's pixel arrays, and a prefill whose rows have images runs the vision tower on them (their count padded to a
power of two with blank images); the sampler keeps nothing of a call on itself.

Decode. A `lax.while_loop` runs whole decode steps on device (all slots, one token each; the state is
donated): feed each slot's last token at its position, draw the next token, record it in a per-segment
buffer [steps, slots], and retire a slot on a stop token or when it reaches its token budget. The loop
ends when every slot is done, when enough slots are free to admit waiting prompts, when the cache is
full, or after `segment_steps` steps; only then does the host look at the results (one transfer per
segment, none per token).

Decode blocks. `segment_steps` (k) is the block: k tokens per dispatch at most, the same tokens and log-probs as
step-by-step decoding (k = 1) bit for bit (tests/test_decode_blocks.py). Its default follows the kernel set
(`backend_choices`), measured with benchmarks/bench_decode_blocks.py (16 prompts x 64 ids,
128 new, greedy, 16 slots, tokens/s for k = 1 / 8 / 32 / 128; 2-core CPU, shared, 2026-11-28): cpu kernels,
tiny:llama's shape 21,320 / 48,958 / 61,661 / 71,265, a 0.1 B Llama 64 / 146 / 178 / 181 (each dispatch slices
the per-layer weights once: a copy of the weights); the generic kernels on that CPU, tiny shape 16,712 / 31,043 /
37,216 / 40,610. Larger blocks only make the host see progress less often (progress bars; weight swaps between
segments have their own bound, `fleet.segment_steps`).

Continuous batching. The host loop (`posttrain.sampling.scheduler.SlotScheduler`) alternates prefill of
waiting prompts into free slots with decode segments, so a few long completions do not hold the other slots
idle: a finished slot takes the next prompt. Prompts are admitted in order; a prompt's samples are admitted
together (up to the slot count).

Slot count. With the cpu kernels a call uses `slots_for(sequences)` slots: the next power of two from 8, at most
`max_slots` (rounded to the mesh), so a small request never computes empty slots (on CPU a 0.1 B model's decode of
16 sequences took 2.3-3.4x as long in 64 slots as in 16), and the few sizes a workload meets are each compiled
once (the decode state is kept for the last (slots, cache length) used): `posttrain eval --n 4` decodes its greedy
pass in fewer slots than its sampled one, two decode programs. With the generic kernels (accelerators) every
call uses the sampler's `slots`: one decode program per cache capacity (issue 40's H200 figures: a decode step
1.41 / 2.19 ms at 16 / 64 sequences, while a decode program compiled in 4-8 s).

Continuation (multi-turn). When a turn ends and `on_turn_end` appends ids, the extend program (`_extend`)
computes only those ids, plus the turn's last sampled token (sampled but not yet fed), against the slot's
kept cache: rows of appended ids (rows bucketed to powers of two, lengths to `continuation_bucket`), the
slots' cache rows gathered (attention reads them) with a scratch tail for the padding columns; only the
computed positions are scattered back into the donated cache (in place, not whole rows); the next token
is drawn from the last appended id's logits. See the scheduler's docstring for parking and multi-process.

Compilation. What is static: slots, the cache capacity, the prefill (rows, bucket) shape, top_k, top-p on or
off and segment_steps. Greedy-or-not, temperature, top_p's value, min_p, seed, max_new_tokens and the stop ids
are traced values, so a sampler compiles one decode program per cache capacity and one prefill program per
(rows, bucket, capacity) it meets, for each sampling mode it meets (top-k, top-p); greedy calls (evaluation) and
sampled ones (rollouts) share their programs (`filters.choose_tokens`: `lax.cond`, same tokens and log-probs bit
for bit). That costs a greedy-only run's first call the sampling code's compile (benchmarks/bench_first_call.py's
generate worker: first call 4.4-5.1 s -> 6.0-6.6 s on CPU) and saves a mixed run a decode and a prefill program
(RL smoke, 4 steps: 10 programs -> 7). Compilation is most of a first call's cost on CPU. The programs live in
the sampler's `ProgramCache` (shared with the samplers given the same cache, for models of the same structure),
and the weights are read from the model at every call (RL updates them in place between calls). A test counts
compiles with JAX's compile events (tests/compile_counter.py).

Expert recording (routing replay, a mixture of experts). `generate(record_experts=True)` builds the programs
with `record` on (a static flag; off, they are exactly the plain programs): the prefill, extend and every decode
step also return the experts the router chose (`model(..., routing=True)`), and the scheduler appends them, per
sequence and in order, to its slot record: the prompt's positions from the prefill (a shared-prefill group's
samples each get the prompt row's), then each fed token (a decode step's active slot feeds its previous sampled
token; an extend feeds the pending token and the appended ids). `Completion.routed_experts` [n_positions,
L_sparse, k] (int8, int16 above 128 experts) thus covers len(prompt) + len(token_ids) - 1 positions (the last
sampled token is never fed), the experts a single uncached forward of prompt + token_ids[:-1] would choose.

Weight swaps within a call (partial rollouts). `generate(between_segments=f)` calls f between decode
segments; when it returns newer weights (`(weights, version)`) they are loaded into the model in place and the
next segment runs with them, while the slots in flight keep their KV caches (entries computed with the older
weights are not recomputed, as in PipelineRL's in-flight weight updates). Each `Completion` says per token which
version produced it (`versions`), and its log-probs are the ones each token was drawn with (the behaviour
policy's, older cache included), which is what an importance correction needs. The swap costs the copy of the
weights and nothing else: the new weights have the old ones' shapes, dtypes and shardings, so nothing
recompiles. The callback must give the same answer on every process of a multi-process mesh, so it is refused
there (rollout workers sample on their own devices).

Randomness: sample i of prompt p uses keys derived from (seed, p, i) and its token index only (the index
after the prompt, appended ids counted), so the same seed gives the same completions whatever the slot
count, scheduling or, in multi-turn calls, the time an answer arrives.

Multi-host: on a mesh over several processes every process runs this same host loop. Its decisions
(admissions, cache growth, when a slot is done) depend only on the prompts and on what the host reads
after each segment, which `distributed.to_host` gathers whole on every process (a collective), so every
process issues the same compiled calls in the same order and ends with the same completions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from posttrain import distributed
from posttrain.models import kernels as kernels_lib
from posttrain.models import multimodal
from posttrain.models.attention import KVCache
from posttrain.models.moe import experts_dtype
from posttrain.models.weights import flat_weights, load_flat_weights
from posttrain.sampling.filters import RowSampling, choose_tokens, choose_tokens_rows, top_logprobs
from posttrain.sampling.params import Completion, SamplingParams, TurnEnd
from posttrain.sampling.scheduler import MIN_BUCKET, Programs, Request, Setup, SlotScheduler, length_bucket
from posttrain.sampling.scheduler import pow2 as _pow2

MIN_CACHE_STEP = 256  # default cache growth step at least (see "Cache growth")


@dataclasses.dataclass(frozen=True)
class BackendChoices:
    """What the sampler chooses by backend, behind the one backend switch (the model's kernel set,
    `posttrain.models.kernels`): see "Decode blocks", "Slot count" and "Prefill shapes".

    segment_steps: the default decode block. request_sized_slots: a call uses `slots_for(its sequences)` slots
    (else always the sampler's `slots`: one decode program per cache capacity). pad_ratio, pad_positions: a
    refill runs at the rows of the call's first prefill when they are at most pad_ratio times its own rows and
    that shape holds at most pad_positions positions (else at the call's refill rows)."""

    segment_steps: int
    request_sized_slots: bool
    pad_ratio: float
    pad_positions: int


#: cpu: compute is dear (4x the slots: a 0.1 B model's decode 2.3-3.4x slower; refills of an n=4 evaluation padded
#: from 1 row to 4 rows of 128 positions: +30-50% on a 0.1 B model, +25% on a tiny one whose first shape is 4 x 32)
#: and a compile costs 1-3 s: request-sized slots, paddings of small prefills only.
CPU_CHOICES = BackendChoices(segment_steps=128, request_sized_slots=True, pad_ratio=4.0, pad_positions=256)
#: generic (accelerators): a compile costs seconds to tens of seconds (XLA's autotuning; issue 40's H200 figures:
#: 27.8 s for three prefills) while idle slots and padded rows cost little (a decode step 1.41 / 2.19 ms at 16 / 64
#: sequences): every call at the full slot count, refills at the call's first shape. The decode block: measured
#: on CPU (the module docstring's figures); on an accelerator fewer host round trips can only help (not measured).
GENERIC_CHOICES = BackendChoices(segment_steps=128, request_sized_slots=False, pad_ratio=8.0, pad_positions=1 << 30)


def backend_choices(kernels: str = "auto") -> BackendChoices:
    """The choices for a model of kernel set `kernels` (its `cfg.kernels`; `auto` resolved once)."""
    return CPU_CHOICES if kernels_lib.resolve(kernels) == "cpu" else GENERIC_CHOICES


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the device keeps per slot between compiled calls (donated to each of them)."""

    cache: KVCache
    last_token: jax.Array  # [S] int32: the newest token, not yet fed to the model
    position: jax.Array  # [S] int32: where last_token goes
    active: jax.Array  # [S] bool: still generating
    n_generated: jax.Array  # [S] int32
    max_new: jax.Array  # [S] int32: token budget of the slot
    key: jax.Array  # [S, *key_shape] uint32: the sample's PRNG key data


def _state_shardings(mesh, cache_dims, key_shape, kernels: str) -> DecodeState | None:
    """Slots over the batch mesh axes (data, fsdp); the cache's kv heads over `tensor` when it divides them.

    cache_dims: (layers, slots, kv_heads, max_len, head_dim); kernels: the model's kernel set (cache layout)."""
    if mesh is None:
        return None
    ks = kernels_lib.get(kernels)
    layers, slots, kv_heads, max_len, head_dim = cache_dims
    k_shape, v_shape = ks.cache_shapes(kv_heads, head_dim, slots, max_len)
    k = NamedSharding(mesh, distributed.logical_to_spec(ks.k_axes, k_shape, mesh))
    v = NamedSharding(mesh, distributed.logical_to_spec(ks.v_axes, v_shape, mesh))
    valid = NamedSharding(mesh, distributed.logical_to_spec(("batch", "seq"), (slots, max_len), mesh))
    per_slot = NamedSharding(mesh, distributed.logical_to_spec(("batch",), (slots,), mesh))
    key = NamedSharding(mesh, distributed.logical_to_spec(("batch",) + (None,) * len(key_shape),
                                                          (slots, *key_shape), mesh))
    return DecodeState(KVCache((k,) * layers, (v,) * layers, valid), per_slot, per_slot, per_slot, per_slot,
                       per_slot, key)


def _cache_dims(cache: KVCache) -> tuple[int, ...]:
    """(layers, slots, kv_heads, max_len, head_dim) of a cache (head_dim is the last axis of v in every layout)."""
    slots, max_len = cache.valid.shape
    head_dim = cache.v[0].shape[-1]
    return len(cache.v), slots, math.prod(cache.v[0].shape) // (slots * max_len * head_dim), max_len, head_dim


def _pin(ds: DecodeState, shardings: DecodeState | None) -> DecodeState:
    if shardings is None:
        return ds
    return jax.tree.map(jax.lax.with_sharding_constraint, ds, shardings)


def _is_stop(tok, stop_ids):
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)


def _sample_keys(seed, prompt_idx, sample_idx):
    if jnp.ndim(seed):  # one seed per row (the server's requests: `posttrain.sampling.serving`)
        return jax.vmap(lambda s, p, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), i))(
            seed, prompt_idx, sample_idx)
    base = jax.random.key(seed)
    return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompt_idx, sample_idx)


def _step_keys(key_data, n_generated):
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(jax.random.fold_in)(keys, n_generated)


def _init_state(cache_dims, cache_dtype, key_shape, mesh, kernels):
    layers, slots, kv_heads, max_len, head_dim = cache_dims
    z = jnp.zeros((slots,), jnp.int32)
    k_shape, v_shape = kernels_lib.get(kernels).cache_shapes(kv_heads, head_dim, slots, max_len)
    ds = DecodeState(
        cache=KVCache(tuple(jnp.zeros(k_shape, cache_dtype) for _ in range(layers)),
                      tuple(jnp.zeros(v_shape, cache_dtype) for _ in range(layers)),
                      jnp.zeros((slots, max_len), bool)),
        last_token=z, position=z, active=jnp.zeros((slots,), bool), n_generated=z, max_new=z,
        key=jnp.zeros((slots, *key_shape), jnp.uint32),
    )
    return _pin(ds, _state_shardings(mesh, cache_dims, key_shape, kernels))


def _seq_index(axis: int, rows, n: int):
    """The index of rows `rows` and the first n positions of a cache array whose sequence axis is `axis`."""
    return (rows,) + (slice(None),) * (axis - 1) + (slice(0, n),)


def _prefill(graphdef, state, ds: DecodeState, ids, lens, asg_row, asg_slot, asg_prompt, asg_sample, seed, max_new,
             stop_ids, temperature, top_p, min_p, pixels=None, *, top_k: int, greedy, nucleus: bool,
             record: bool = False):
    """Prefills prompt rows ids [P, Lb] (real lengths `lens`) and installs them in the assigned slots.

    Assignment a copies prompt row asg_row[a] into slot asg_slot[a] (slot index S = padding, dropped) as
    sample (asg_prompt[a], asg_sample[a]) and draws its first token. Returns the new state and the first
    tokens, their log-probs and sampling log-probs [A]. `pixels` [N, C, H, W]: the images of the rows'
    image placeholders, in order (vision-language models; None = text, the text-only program). `record`
    (a mixture of experts): the first values also hold the experts the router chose at every prompt row's
    position [P, Lb, L_sparse, k] (see "Expert recording").
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    tmp, logits, routing = _prefill_forward(model, ids, lens, pixels, record, ds.cache.k[0].dtype)
    keys = _sample_keys(seed, asg_prompt, asg_sample)
    first_keys = lambda: jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(asg_prompt))  # noqa: E731
    tok, lp, slp = choose_tokens(logits[asg_row], first_keys, top_k, greedy, temperature, top_p, min_p,
                                 nucleus=nucleus, kernels=cfg)
    done = _is_stop(tok, stop_ids) | (max_new <= 1)
    ds = _install(ds, tmp, asg_row, asg_slot, lens, tok, done, max_new, jax.random.key_data(keys), model.mesh,
                  cfg.kernels)
    return ds, (tok, lp, slp, *(r.experts for r in routing))


def _prefill_forward(model, ids, lens, pixels, record: bool, cache_dtype):
    """Runs prompt rows ids [P, Lb] (real lengths `lens`) through the model into a cache of their own: (that cache
    [P, Lb], the logits at each row's last real position [P, V], the routing when `record`)."""
    cfg = model.cfg
    n_rows, lb = ids.shape
    tmp = KVCache.create(cfg, n_rows, lb, dtype=cache_dtype)
    pos = jnp.broadcast_to(jnp.arange(lb, dtype=jnp.int32), (n_rows, lb))
    mask = pos < lens[:, None]
    h, tmp, *routing = model.hidden_states(ids, attention_mask=mask, positions=pos, cache=tmp, pixel_values=pixels,
                                           routing=record)
    h_last = h[jnp.arange(n_rows), lens - 1]  # [P, D]: logits only where they are needed
    return tmp, model.logits(h_last[:, None])[:, 0], routing


def _install(ds: DecodeState, tmp: KVCache, asg_row, asg_slot, lens, tok, done, max_new, key_data, mesh,
             kernels: str) -> DecodeState:
    """The state with prompt row asg_row[a] of the prefill cache `tmp` copied into slot asg_slot[a] (index S:
    dropped), its first token `tok[a]` pending at position lens[row], active unless `done`, with budget `max_new`
    and the sample's key data."""
    ks = kernels_lib.get(kernels)
    cache = ds.cache
    lb = tmp.valid.shape[1]
    slots, max_len = cache.valid.shape
    k_idx, v_idx = _seq_index(ks.k_seq_axis, asg_slot, lb), _seq_index(ks.v_seq_axis, asg_slot, lb)
    k = tuple(c.at[k_idx].set(t[asg_row], mode="drop") for c, t in zip(cache.k, tmp.k))
    v = tuple(c.at[v_idx].set(t[asg_row], mode="drop") for c, t in zip(cache.v, tmp.v))
    rows = tmp.valid[asg_row]
    if lb < max_len:
        rows = jnp.concatenate([rows, jnp.zeros((rows.shape[0], max_len - lb), bool)], axis=1)
    valid = cache.valid.at[asg_slot].set(rows, mode="drop")

    def put(arr, values):
        return arr.at[asg_slot].set(values, mode="drop")

    ds = DecodeState(
        cache=KVCache(k, v, valid),
        last_token=put(ds.last_token, tok),
        position=put(ds.position, lens[asg_row]),
        active=put(ds.active, ~done),
        n_generated=put(ds.n_generated, jnp.ones_like(tok)),
        max_new=put(ds.max_new, jnp.broadcast_to(max_new, tok.shape)),
        key=put(ds.key, key_data),
    )
    return _pin(ds, _state_shardings(mesh, _cache_dims(cache), ds.key.shape[1:], kernels))


def _prefill_rows(graphdef, state, ids, lens, seeds, samples, max_new, stop_ids, rows: RowSampling, pixels=None, *,
                  cache_dtype, n_top: int = 0):
    """The server's prefill, in two programs so that the costly one does not depend on the cache's length: this
    one runs prompt rows ids [P, Lb] (one sequence a row, its parameters in `rows`, its keys from (seeds[r],
    samples[r]), budget max_new[r]) and draws their first tokens; `_install_rows` puts them in their slots.
    Returns (the rows' cache, key data [P, ...], done [P], (tokens, log-probs, sampling log-probs[, top ids, top
    log-probs when n_top])."""
    model = nnx.merge(graphdef, state)
    tmp, logits, _ = _prefill_forward(model, ids, lens, pixels, False, cache_dtype)
    zeros = jnp.zeros_like(samples)
    keys = _sample_keys(seeds, zeros, samples)
    first_keys = lambda: jax.vmap(jax.random.fold_in)(keys, zeros)  # noqa: E731
    tok, lp, slp = choose_tokens_rows(logits, first_keys, rows, kernels=model.cfg)
    top = _top_record(logits, rows, jnp.ones(tok.shape, bool), n_top)
    done = (_is_stop(tok, stop_ids) & ~rows.ignore_stop) | (max_new <= 1)
    return tmp, jax.random.key_data(keys), done, (tok, lp, slp, *top)


def _install_rows(ds: DecodeState, tmp: KVCache, slot, lens, tok, done, max_new, key_data, mesh, kernels: str):
    """`_install` of a server prefill's rows: row r into slot slot[r] (index S: a padding row, dropped)."""
    return _install(ds, tmp, jnp.arange(slot.shape[0]), slot, lens, tok, done, max_new, key_data, mesh, kernels)


install_rows_jit = jax.jit(_install_rows, static_argnums=(8, 9), donate_argnums=(0,))


def _top_record(logits, rows: RowSampling | None, live, n_top: int) -> tuple:
    """() without top log-probs (`n_top` 0, static); else the `n_top` most likely tokens of each row of logits
    [R, V] and their log-probs (`filters.top_logprobs`), computed only when a live row asks (`rows.logprobs`), else
    zeros."""
    if not n_top:
        return ()
    r = logits.shape[0]
    zeros = (jnp.zeros((r, n_top), jnp.int32), jnp.zeros((r, n_top), jnp.float32))
    return jax.lax.cond(jnp.any(rows.logprobs & live), lambda x: top_logprobs(x, n_top), lambda x: zeros, logits)


def _gather_rows(cache: KVCache, rows, extra: int, ks) -> KVCache:
    """Rows `rows` [R] of a cache (clipped into range), each padded with `extra` empty positions."""
    def take(a, axis):
        a = jnp.take(a, rows, axis=0, mode="clip")
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, extra)
        return jnp.pad(a, widths)

    return KVCache(tuple(take(a, ks.k_seq_axis) for a in cache.k), tuple(take(a, ks.v_seq_axis) for a in cache.v),
                   take(cache.valid, 1))


def _columns(axis: int, rows, pos):
    """The index of positions pos [R, T] of rows `rows` [R] of a cache array whose sequence axis is `axis`."""
    return (rows[:, None],) + (slice(None),) * (axis - 1) + (pos,)


def _put_columns(c, t, axis: int, rows, slot, pos):
    """Copies positions pos [R, T] of gathered row r of `t` to the same positions of cache row slot[r] of `c`
    (a scatter into the donated cache: out-of-range slots and positions are dropped)."""
    return c.at[_columns(axis, slot, pos)].set(t[_columns(axis, rows, pos)], mode="drop")


def _extend(graphdef, state, ds: DecodeState, ids, lens, slot, n_after, max_new, stop_ids, temperature, top_p, min_p,
            *, top_k: int, greedy, nucleus: bool, record: bool = False):
    """Continues slots after a turn: computes only their new tokens against the slots' kept caches.

    Row r [Lb] of `ids` is for slot `slot[r]` (index S = padding row, dropped): column 0 is ignored and
    replaced by the slot's pending last token (sampled, not yet fed), columns 1..lens[r]-1 are the appended
    ids. They are written at the slot's positions position..position+lens[r]-1; padding columns go to
    positions past the cache (a scratch extension of the gathered rows, never written back). The next token
    is drawn from the last real column's logits with the sample's key at sequence index n_after[r] (the
    tokens after the prompt so far, appended ones included); max_new[r] is the slot's new total budget.
    Returns the state and the first tokens, log-probs and sampling log-probs [R] (with `record`, and the experts
    chosen at every column [R, Lb, L_sparse, k]).
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    ks = kernels_lib.get(cfg)
    cache = ds.cache
    slots, cap = cache.valid.shape
    n_rows, lb = ids.shape
    src = jnp.minimum(slot, slots - 1)
    ids = ids.at[:, 0].set(ds.last_token[src])
    col = jnp.arange(lb, dtype=jnp.int32)[None, :]
    real = col < lens[:, None]
    start = ds.position[src]
    pos = jnp.where(real, start[:, None] + col, cap + col)
    sub = _gather_rows(cache, src, lb, ks)
    h, sub, *routing = model.hidden_states(ids, attention_mask=real, positions=pos, cache=sub, routing=record)
    logits = model.logits(h[jnp.arange(n_rows), lens - 1][:, None])[:, 0]
    keys = lambda: _step_keys(ds.key[src], n_after)  # noqa: E731
    tok, lp, slp = choose_tokens(logits, keys, top_k, greedy, temperature, top_p, min_p, nucleus=nucleus,
                                 kernels=cfg)
    done = _is_stop(tok, stop_ids) | (n_after + 1 >= max_new)

    # write back only the computed columns, in place (padding rows and scratch positions >= cap are dropped)
    rows = jnp.arange(n_rows)
    k = tuple(_put_columns(c, t, ks.k_seq_axis, rows, slot, pos) for c, t in zip(cache.k, sub.k))
    v = tuple(_put_columns(c, t, ks.v_seq_axis, rows, slot, pos) for c, t in zip(cache.v, sub.v))
    valid = cache.valid.at[slot[:, None], pos].set(real, mode="drop")

    def put(arr, values):
        return arr.at[slot].set(values, mode="drop")

    ds = dataclasses.replace(
        ds, cache=KVCache(k, v, valid), last_token=put(ds.last_token, tok), position=put(ds.position, start + lens),
        active=put(ds.active, ~done), n_generated=put(ds.n_generated, n_after + 1), max_new=put(ds.max_new, max_new),
    )
    ds = _pin(ds, _state_shardings(model.mesh, _cache_dims(cache), ds.key.shape[1:], cfg.kernels))
    return ds, (tok, lp, slp, *(r.experts for r in routing))


def _decode(graphdef, state, ds: DecodeState, min_free, max_steps, stop_ids, temperature, top_p, min_p, *,
            top_k: int, greedy, nucleus: bool, budget: int, record: bool = False, rows: RowSampling | None = None,
            n_top: int = 0):
    """Decode steps in one `while_loop` until no slot is active, `min_free` slots are free, or
    min(`max_steps`, `budget`) steps (`max_steps`, traced: the steps left before the cache is full).

    Returns the state and the segment's record: tokens, log-probs, sampling log-probs and an `emitted`
    flag, each [budget, S] (row t = step t; only the first `steps` rows are filled), and `steps`. With
    `record` (a mixture of experts) the record also holds the experts chosen for the token each slot fed at
    each step [budget, S, L_sparse, k] (see "Expert recording"). Per-row sampling (the server): `rows` holds each
    slot's parameters (`RowSampling` [S]), and with `n_top` > 0 the record ends with each step's top log-probs (ids,
    log-probs) [budget, S, n_top] (computed at the steps where an active slot asks for them).
    """
    model = nnx.merge(graphdef, state)
    slots = ds.active.shape[0]
    ks = kernels_lib.get(model.cfg)
    shardings = _state_shardings(model.mesh, _cache_dims(ds.cache), ds.key.shape[1:], model.cfg.kernels)
    # The cpu kernel set slices the per-layer weights once per call, outside the loop (on CPU a slice inside
    # the loop is a copy every step); elsewhere the fused dynamic slices of the stacked weights cost nothing.
    layer_states = model.layer_states() if ks.preslice_decode_weights else None
    buffers = _segment_buffers(model.cfg, budget, slots, record, n_top)
    choose = _chooser(model.cfg, stop_ids, rows, top_k=top_k, greedy=greedy, temperature=temperature, top_p=top_p,
                      min_p=min_p, nucleus=nucleus)
    ones = jnp.ones((slots, 1), jnp.int32)

    def cond(carry):
        ds, _, step = carry
        n_free = slots - jnp.sum(ds.active.astype(jnp.int32))
        return (step < jnp.minimum(budget, max_steps)) & jnp.any(ds.active) & (n_free < min_free)

    def body(carry):
        ds, buffers, step = carry
        logits, cache, *routing = model(ds.last_token[:, None], attention_mask=ones, positions=ds.position[:, None],
                                        cache=ds.cache, layer_states=layer_states, routing=record)
        tok, lp, slp, stop = choose(logits[:, 0], lambda: _step_keys(ds.key, ds.n_generated))
        act = ds.active
        top = _top_record(logits[:, 0], rows, act, n_top)
        n_gen = ds.n_generated + act.astype(jnp.int32)
        done = stop | (n_gen >= ds.max_new)
        new = dataclasses.replace(
            ds,
            cache=cache,
            last_token=jnp.where(act, tok, ds.last_token),
            position=ds.position + act.astype(jnp.int32),
            active=act & ~done,
            n_generated=n_gen,
        )
        new = _pin(new, shardings)
        values = (tok, lp, slp, act, *([routing[0].experts[:, 0]] if record else []), *top)
        buffers = tuple(jax.lax.dynamic_update_index_in_dim(b, v, step, 0) for b, v in zip(buffers, values))
        return new, buffers, step + 1

    ds, buffers, steps = jax.lax.while_loop(cond, body, (ds, buffers, jnp.int32(0)))
    return ds, buffers, steps


def _segment_buffers(cfg, budget: int, slots: int, record: bool, n_top: int) -> tuple:
    """A decode segment's empty record: tokens, log-probs, sampling log-probs, emitted [budget, S]; with `record`
    the chosen experts; with `n_top` the top ids and log-probs [budget, S, n_top]."""
    out = (jnp.zeros((budget, slots), jnp.int32), jnp.zeros((budget, slots), jnp.float32),
           jnp.zeros((budget, slots), jnp.float32), jnp.zeros((budget, slots), bool))
    if record:
        out += (_experts_buffer(cfg, budget, slots),)
    if n_top:
        out += (jnp.zeros((budget, slots, n_top), jnp.int32), jnp.zeros((budget, slots, n_top), jnp.float32))
    return out


def _chooser(cfg, stop_ids, rows: RowSampling | None, **per_call):
    """(logits [S, V], keys) -> (tokens, log-probs, sampling log-probs, stopped [S]): with the call's sampling values
    (`choose_tokens`), or each slot's (`rows`: `choose_tokens_rows`; a slot with `ignore_stop` never stops)."""
    def choose(logits, keys):
        if rows is None:
            tok, lp, slp = choose_tokens(logits, keys, per_call["top_k"], per_call["greedy"], per_call["temperature"],
                                         per_call["top_p"], per_call["min_p"], nucleus=per_call["nucleus"],
                                         kernels=cfg)
            return tok, lp, slp, _is_stop(tok, stop_ids)
        tok, lp, slp = choose_tokens_rows(logits, keys, rows, kernels=cfg)
        return tok, lp, slp, _is_stop(tok, stop_ids) & ~rows.ignore_stop

    return choose


def _experts_buffer(cfg, steps: int, slots: int) -> jax.Array:
    """An empty record of chosen experts [steps, slots, L_sparse, k] (the model's compact expert-id dtype)."""
    return jnp.zeros((steps, slots, sum(cfg.moe_layers), cfg.num_experts_per_tok), experts_dtype(cfg.num_experts))


_init_jit = jax.jit(_init_state, static_argnums=(0, 1, 2, 3, 4))


def _grow_state(ds: DecodeState, new_len: int, mesh, kernels: str) -> DecodeState:
    """The state with its cache padded to `new_len` positions (new entries empty)."""
    ks = kernels_lib.get(kernels)
    extra = new_len - ds.cache.max_len

    def pad(a, axis):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, extra)
        return jnp.pad(a, widths)

    k = tuple(pad(a, ks.k_seq_axis) for a in ds.cache.k)
    v = tuple(pad(a, ks.v_seq_axis) for a in ds.cache.v)
    valid = jnp.pad(ds.cache.valid, ((0, 0), (0, extra)))
    ds = dataclasses.replace(ds, cache=KVCache(k, v, valid))
    return _pin(ds, _state_shardings(mesh, _cache_dims(ds.cache), ds.key.shape[1:], kernels))


_grow_jit = jax.jit(_grow_state, static_argnums=(1, 2, 3))


def _release_slots(ds: DecodeState, release: jax.Array, mesh, kernels: str) -> DecodeState:
    """The state with the slots of `release` [S] (bool) no longer active: a cancelled request's slot decodes no
    more and counts as free (`posttrain.sampling.serving`)."""
    ds = dataclasses.replace(ds, active=ds.active & ~release)
    return _pin(ds, _state_shardings(mesh, _cache_dims(ds.cache), ds.key.shape[1:], kernels))


release_jit = jax.jit(_release_slots, static_argnums=(2, 3), donate_argnums=(0,))
grow_jit = _grow_jit


def _check_key_ids(key_ids: Sequence[int] | None, n_prompts: int) -> list[int] | None:
    """`key_ids` as ints, one in [0, 2**31) per prompt (None stays None)."""
    if key_ids is None:
        return None
    key_ids = [int(k) for k in key_ids]
    if len(key_ids) != n_prompts or any(not 0 <= k < 2**31 for k in key_ids):
        raise ValueError(f"key_ids must hold one integer in [0, 2**31) per prompt ({n_prompts})")
    return key_ids


def _fit_len(longest: int, max_new: int, limit: int) -> int:
    """A call's context length when the sampler has no `max_len`: what its longest prompt (and that prompt's
    prefill bucket) plus `max_new` new tokens need, rounded up to a power of two or to 64 positions, whichever
    is less. Not always to a power of two: with 64-token prompts and 128 new tokens that gave 256 positions, 64
    of which no step could fill but every decode step attended over (15-21% slower, found bisecting the
    default sampler's regression to cbb36a7)."""
    need = max(longest + max_new, length_bucket(longest, limit) + 1, MIN_BUCKET)
    return min(_pow2(need), -(-need // 64) * 64)


def cache_capacities(max_len: int, step: int) -> list[int]:
    """The cache lengths a call may use: multiples of `step` below `max_len`, then `max_len`."""
    return [c for c in range(step, max_len, step)] + [max_len]


class _Jitted(NamedTuple):
    """The jitted programs of one model structure (`ProgramCache`); `prefill_rows`: the server's prefill
    (`posttrain.sampling.serving`)."""

    prefill: Callable
    decode: Callable
    extend: Callable
    prefill_rows: Callable


class ProgramCache:
    """The jitted prefill, decode and extend programs of the model structures a sampler meets.

    A `Sampler` holds one (`Sampler.program_cache`, its own unless it is given one): samplers given the same
    cache share their compiled programs, so a caller that builds several samplers over models of one structure
    (e.g. evaluating several checkpoints of one architecture) compiles each program once by passing the first
    sampler's cache to the others: `Sampler(model, program_cache=first.program_cache)`. Entries are found by
    graphdef equality rather than by hashing (a config holding lists, e.g. several eos ids, makes a graphdef
    unhashable); the graphdef is closed over, not a static argument. The `size` most recently used structures
    are kept. (The cache-allocation and cache-growth programs depend on shapes only: plain jitted functions.)
    """

    def __init__(self, size: int = 8):
        self.size = int(size)
        self._entries: list[tuple[object, _Jitted]] = []  # (graphdef, programs), most recent last

    def get(self, graphdef) -> _Jitted:
        """The jitted programs for one model structure (made on first use; compiled at their first calls)."""
        for i, entry in enumerate(self._entries):
            if entry[0] == graphdef:
                self._entries.append(self._entries.pop(i))
                return entry[1]
        jitted = _Jitted(
            prefill=jax.jit(functools.partial(_prefill, graphdef),
                            static_argnames=("top_k", "nucleus", "record"), donate_argnames=("ds",)),
            decode=jax.jit(functools.partial(_decode, graphdef),
                           static_argnames=("top_k", "nucleus", "budget", "record", "n_top"),
                           donate_argnames=("ds",)),
            extend=jax.jit(functools.partial(_extend, graphdef),
                           static_argnames=("top_k", "nucleus", "record"), donate_argnames=("ds",)),
            prefill_rows=jax.jit(functools.partial(_prefill_rows, graphdef), static_argnames=("cache_dtype", "n_top")),
        )
        self._entries.append((graphdef, jitted))
        del self._entries[:-self.size]
        return jitted


class _Progress:
    """A rich progress bar (completions done, tokens/s) or a user callback(done, total, tokens, seconds)."""

    def __init__(self, progress, total: int):
        self.callback = progress if callable(progress) else None
        self.bar = None
        if progress is True:
            self.bar = Progress(
                TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("completions"),
                TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), console=Console(stderr=True),
                transient=False,
            )
            self.task = self.bar.add_task("generate", total=total, tps="-")
            self.bar.start()
        self.total = total

    def update(self, done: int, tokens: int, seconds: float):
        if self.callback is not None:
            self.callback(done, self.total, tokens, seconds)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, tps=f"{tokens / max(seconds, 1e-9):,.0f}")

    def close(self):
        if self.bar is not None:
            self.bar.stop()


class Sampler:
    """Generates completions from a posttrain `Transformer`, reading its current weights at every call.

    max_slots: sequences decoded at once (the cache's batch size, rounded up to a multiple of the mesh's
      data x fsdp size). Every decode step computes all slots, so on CPU keep it near the request size.
    max_len: cache length (prompt + completion); None = chosen per call as the next power of two of the
      longest prompt plus max_new_tokens (at most the model's max_position_embeddings).
    segment_steps: decode steps per compiled segment at most, the decode block (the host sees progress after
      each); None = the kernel set's default (`backend_choices`).
    refill_fraction: a decode segment stops to admit waiting prompts once this fraction of the slots
      (at least one, at least the next prompt's samples) is free; larger values batch more prefills.
    cache_step: the cache grows in steps of this many positions up to max_len (see "Cache growth" in the
      module docstring); None = a quarter of max_len rounded up to a multiple of 16, at least
      MIN_CACHE_STEP (so a max_len of 256 or less is one capacity); 0 = always the full max_len (one
      decode program per max_len, no growth).
    program_cache: where the sampler's jitted programs live (`ProgramCache`); None = a cache of its own. Pass
      another sampler's `program_cache` to share its compiled programs (models of the same structure).
    """

    def __init__(self, model, tokenizer=None, *, max_slots: int = 32, max_len: int | None = None,
                 segment_steps: int | None = None, refill_fraction: float = 0.125, cache_step: int | None = None,
                 program_cache: ProgramCache | None = None):
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots} must be >= 1")
        if max_len is not None and max_len < 2:
            raise ValueError(f"max_len={max_len} must be >= 2")
        if segment_steps is None:
            segment_steps = backend_choices(model.cfg.kernels).segment_steps
        if segment_steps < 1:
            raise ValueError(f"segment_steps={segment_steps} must be >= 1")
        if not 0.0 <= refill_fraction <= 1.0:
            raise ValueError(f"refill_fraction={refill_fraction} must be in [0, 1]")
        if cache_step is not None and cache_step < 0:
            raise ValueError(f"cache_step={cache_step} must be >= 0 (0 = no growth) or None")
        self.model = model
        self.tokenizer = tokenizer
        self.max_slots = int(max_slots)
        self.max_len = max_len
        self.segment_steps = int(segment_steps)
        self.refill_fraction = float(refill_fraction)
        self.cache_step = cache_step
        self.program_cache = program_cache if program_cache is not None else ProgramCache()
        self._state: DecodeState | None = None
        self._state_config: tuple | None = None
        self.last_stats: dict = {}
        self.version: int | None = None  # the policy version of the loaded weights (see `load_weights`)
        self.profile = False  # block after each compiled call to time prefill and decode separately
        self.choices = backend_choices(model.cfg.kernels)  # slot count and prefill padding by backend

    # ------------------------------------------------------------------ configuration
    @property
    def cfg(self):
        return self.model.cfg

    def _default_stop_ids(self) -> list[int]:
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_ids", None):
            return list(self.tokenizer.eos_token_ids)
        return list(self.cfg.eos_token_ids)

    def round_slots(self, slots: int) -> int:
        """`slots` rounded up to a multiple of the mesh's data x fsdp size (the slots are split over it)."""
        return self._mesh_round(int(slots))

    def stop_ids(self) -> list[int]:
        """The ids that end a sequence by default: the tokenizer's EOS ids, else the model config's."""
        return self._default_stop_ids()

    def take_state(self, slots: int, cache_len: int) -> DecodeState:
        """A decode state of `slots` slots and a cache of `cache_len` positions, handed over to the caller (the
        serving engine, which donates it to the programs and keeps the newest); the sampler's kept state when it
        has that shape (every slot free, contents stale), else a new one."""
        ds = self._ensure_state(slots, cache_len)
        self._state, self._state_config = None, None
        return ds

    @property
    def slots(self) -> int:
        """Slots of the largest call: max_slots, rounded up to a multiple of the mesh's data x fsdp size
        (a call uses `slots_for(its sequences)`)."""
        return self._mesh_round(self.max_slots)

    def _mesh_round(self, slots: int) -> int:
        mesh = getattr(self.model, "mesh", None)
        if mesh is not None:
            ways = int(mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1))
            slots = -(-slots // ways) * ways
        return slots

    @property
    def context(self) -> int:
        """The most tokens a sequence may have, prompt and completion: the sampler's cache, else the model's positions."""
        limit = self.cfg.max_position_embeddings
        return limit if self.max_len is None else min(limit, self.max_len)

    def budget_for(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        """`max_new_tokens`, cut to the room the longest of `prompts` leaves in the `context`: what a command asks for
        by default may not fit a small model. Unchanged when a prompt leaves no room at all (then `generate` names
        that prompt)."""
        room = self.context - max((len(p) for p in prompts), default=0)
        return min(max_new_tokens, room) if room >= 1 else max_new_tokens

    def _validate(self, prompts, params: SamplingParams, max_len: int | None = None) -> tuple[int, str]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.cfg.vocab_size
        max_pos = self.cfg.max_position_embeddings
        limit, what = max_pos, f"model context (max_position_embeddings={max_pos})"
        if self.max_len is not None and self.max_len < limit:
            limit, what = self.max_len, f"sampler cache (max_len={self.max_len})"
        if max_len is not None:
            if not 2 <= max_len <= limit:
                raise ValueError(f"max_len={max_len} must be in [2, {limit}] (the {what})")
            limit, what = max_len, f"call's context limit (max_len={max_len})"
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + params.max_new_tokens > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                    f"{len(p) + params.max_new_tokens} positions, more than the {limit} of the {what} "
                    f"(prompts may have at most {max(limit - params.max_new_tokens, 0)} tokens)"
                )
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab})")
        return limit, what

    def capacities(self, max_len: int) -> list[int]:
        """The cache lengths a call with this max_len may use (see `cache_step`)."""
        step = self.cache_step
        if step is None:
            step = max(MIN_CACHE_STEP, -(-max_len // 4 // 16) * 16)
        return cache_capacities(max_len, step) if step else [max_len]

    def _state_config_for(self, slots: int, cache_len: int) -> tuple:
        """What identifies a decode state's shapes and placement (a state is reused when this matches)."""
        key_shape = tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)
        mesh = id(self.model.mesh) if self.model.mesh else None
        return (slots, cache_len, str(jnp.dtype(self.cfg.compute_dtype)), key_shape, mesh,
                kernels_lib.resolve(self.cfg.kernels))

    def _ensure_state(self, slots: int, cache_len: int) -> DecodeState:
        """A state with a cache of `cache_len` positions (the previous call's state when it has that shape;
        every slot is free at the start of a call, so its contents do not matter)."""
        cfg = self.cfg
        config = self._state_config_for(slots, cache_len)
        if self._state is None or self._state_config != config or self._state.last_token.is_deleted():
            self._state = None  # free the old cache before allocating the new one
            cache_dims = (cfg.num_layers, slots, cfg.num_kv_heads, cache_len, cfg.head_dim)
            state = _init_jit(cache_dims, jnp.dtype(cfg.compute_dtype), config[3], self.model.mesh, config[5])
            # committed to its device(s) from the start, as every later call's state (a decode output) is: the
            # programs are compiled for committed and uncommitted arguments apart, so an uncommitted first state
            # would compile the prefill again on the second call (RL: every run's second step)
            self._state = jax.device_put(state, jax.tree.map(lambda a: a.sharding, state))
            self._state_config = config
        return self._state

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights, version: int | None = None) -> None:
        """Copies `weights` into the sampler's model and records their policy `version`.

        weights: a flat `{path: array}` dict (`posttrain.models.weights.flat_weights`, numpy or device
        arrays) or an `nnx.State` of some of the model's variables (e.g. a trainer's trained parameters, or
        only its LoRA adapters). The values are copied, so the caller may donate or overwrite its own
        buffers afterwards. Called between calls; within a call only through `generate(between_segments=...)`.
        """
        flat = weights if isinstance(weights, dict) else flat_weights(weights)
        load_flat_weights(self.model, flat)
        self.version = version

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams | None = None, *,
                 images: Sequence[Sequence] | None = None,
                 progress: bool | Callable[[int, int, int, float], None] = False,
                 key_ids: Sequence[int] | None = None,
                 on_turn_end: Callable[[TurnEnd], object] | None = None,
                 max_len: int | None = None, between_segments: Callable | None = None,
                 record_experts: bool = False, on_finish: Callable[[Completion], None] | None = None
                 ) -> list[Completion]:
        """One `Completion` per prompt and sample: prompt order, the `n` samples of a prompt in a row.

        images: a vision-language model's image prompts: images[p] holds prompt p's preprocessed images, pixel
          arrays [C, H, W] (the processor's `pixel_values` rows), one per run of image placeholder tokens in the
          prompt, in order ([] for a text prompt). They stay in this call's own record (`Request`): only the
          prefill differs, running the vision tower on the prefilled rows' images. None: text prompts only.
        progress: True for a rich progress bar, or a callable(done, total, generated_tokens, seconds).
        key_ids: one integer per prompt that replaces its position in the sampling keys: sample i of prompt p
          draws from keys of (seed, key_ids[p], i), so a prompt's samples do not depend on which other
          prompts share the call (RL gives each prompt group a unique id).
        on_turn_end: multi-turn (token-in/token-out) rollouts. Each time a sequence's turn ends (a stop token,
          or the turn's `max_new_tokens`, or the context limit) it is called with a `TurnEnd` (the turn's
          sampled ids and log-probs, its finish reason, `room`: the most ids an append may hold). It returns
          None (the sequence is finished), a list of token ids to append (prefilled into the slot against
          its kept KV cache, then the next turn is sampled with a fresh max_new_tokens budget), or a
          `concurrent.futures.Future` of either: the slot is parked meanwhile and the other slots go on
          decoding. Appending more than `room` ids raises ValueError. The sequence's `Completion` then holds
          every id after the prompt (in order), log-probs 0.0 at appended ids, `mask` (1 sampled / 0
          appended) and `turns`. Sampling keys depend on (seed, key id, sample, index in the sequence) only.
          Multi-process meshes: every process calls it, process 0's answers count (`sampling.scheduler`).
        max_len: the context limit of each sequence (prompt and every turn) for this call; None = the
          sampler's max_len, else (multi-turn) the model's max_position_embeddings or (single turn) the
          next power of two of the longest prompt plus max_new_tokens.
        between_segments: partial rollouts: () -> None | (weights, version), loaded before the next decode segment.
        record_experts: a mixture of experts: each `Completion` gets `routed_experts` [n_positions, L_sparse, k],
          the experts the router chose at every position the sampler ran through the model (see "Expert
          recording"). Ignored for a dense model (`routed_experts` stays None); off, the programs are unchanged.
        on_finish: called with each `Completion` as its sequence finishes (on the host loop's thread: it must not
          block), so work on early finishers (scoring) overlaps the decoding of the others.
        """
        params = params or SamplingParams()
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        limit, _ = self._validate(prompts, params, max_len)
        images = self._check_images(prompts, images)
        key_ids = _check_key_ids(key_ids, len(prompts))
        if not prompts:
            return []
        total = len(prompts) * params.n
        max_len = max_len or self._call_max_len(prompts, params, limit, multi_turn=on_turn_end is not None)
        stop = self._default_stop_ids() if params.stop_token_ids is None else list(params.stop_token_ids)
        request = Request(prompts, params, stop, key_ids=key_ids, on_turn_end=on_turn_end, on_finish=on_finish,
                          progress=_Progress(progress, total) if progress else None, images=images,
                          record_experts=bool(record_experts) and self.cfg.is_moe)
        return self._run(request, self.slots_for(total), max_len, between_segments)

    def _call_max_len(self, prompts: list[list[int]], params: SamplingParams, limit: int, multi_turn: bool) -> int:
        """A call's context limit when it names none: `limit` (the sampler's max_len, or for multi-turn calls the
        model's context), else the next power of two of the longest prompt plus max_new_tokens."""
        if self.max_len is not None or multi_turn:
            return limit
        return min(_fit_len(max(len(p) for p in prompts), params.max_new_tokens, limit), limit)

    def _run(self, request: Request, slots: int, max_len: int, between_segments: Callable | None
             ) -> list[Completion]:
        """Runs a checked call on the slot scheduler: the decode state with a cache for its longest prompt (donated
        to the scheduler, the latest one kept again afterwards, also after an error), then `last_stats`."""
        params, stop, record = request.params, request.stop, request.record_experts
        caps = self.capacities(max_len)
        first = min(length_bucket(max(len(p) for p in request.prompts), max_len) + 1, max_len)
        cache_len = next((c for c in caps if c >= first), max_len)
        ds = self._ensure_state(slots, cache_len)
        self._state = None  # donated below; restored when the call completes
        setup = Setup(slots=slots, max_len=max_len, caps=tuple(caps), vocab_size=self.cfg.vocab_size,
                      quantum=max(1, math.ceil(self.refill_fraction * slots)), pad_ratio=self.choices.pad_ratio,
                      pad_positions=self.choices.pad_positions, profile=self.profile,
                      decode_text=self.tokenizer.decode if self.tokenizer is not None else None)
        sched = SlotScheduler(self._programs(params, stop, record), ds, request, setup,
                              swap=self._swapper(between_segments, params, stop, record))
        try:
            out = sched.run()
        finally:  # the latest state, also after an error (every slot is free again at the next call's start)
            if request.progress is not None:
                request.progress.close()
            self._state = sched.ds
            self._state_config = self._state_config_for(slots, sched.cache_len)  # the cache may have grown
        self.last_stats = dict(sched.stats, slots=slots, max_len=max_len, cache_len=sched.cache_len)
        return out

    def _swapper(self, between_segments, params: SamplingParams, stop: list[int], record: bool):
        """The scheduler's hook between segments (None without `between_segments`): newer weights, loaded in
        place, and the programs bound to them (the same compiled programs: the weights keep their shapes)."""
        if between_segments is None:
            return None
        if jax.process_count() > 1:
            raise ValueError("between_segments (weight swaps within a call) needs a single-process sampler")

        def swap() -> Programs | None:
            new = between_segments()
            if new is None:
                return None
            self.load_weights(*new)
            return self._programs(params, stop, record)

        return swap

    def slots_for(self, total: int) -> int:
        """The slot count of a call of `total` sequences: with request-sized slots (`BackendChoices`, the cpu
        kernels) the next power of two from 8 at least (so that a few static sizes cover every request), at most
        max_slots; else `slots`. Rounded up to a multiple of the mesh's data x fsdp size."""
        if not self.choices.request_sized_slots:
            return self.slots
        return self._mesh_round(min(self.max_slots, max(8, _pow2(total))))

    # ------------------------------------------------------------------ images (vision-language models)
    def _check_images(self, prompts: list[list[int]], images) -> list[list[np.ndarray]] | None:
        """`images` as float32 arrays, one list per prompt, each prompt's count that of its placeholder runs;
        None for a text-only call (`images` None)."""
        if images is None:
            return None
        vc = self.cfg.vision
        if vc is None:
            raise ValueError(f"this {self.cfg.model_type} model has no vision tower: it cannot take images")
        if len(images) != len(prompts):
            raise ValueError(f"images: one list per prompt expected ({len(prompts)}), got {len(images)}")
        out = []
        for i, (p, imgs) in enumerate(zip(prompts, images)):
            want = multimodal.count_placeholders(np.asarray([p], np.int64), vc)
            if want != len(imgs):
                raise ValueError(f"prompt {i} has {want} image(s) in its tokens but {len(imgs)} image(s) were given")
            out.append([np.asarray(x, np.float32) for x in imgs])
        return out

    def _programs(self, params: SamplingParams, stop: list[int], record: bool = False) -> Programs:
        """The compiled programs with the model state, its version and this call's sampling values bound;
        `record`: the programs that also return the chosen experts (without it, exactly the plain programs)."""
        stop_arr = np.full(max(8, _pow2(len(stop))), -1, np.int32)
        stop_arr[: len(stop)] = stop
        greedy = bool(params.greedy)
        top_k = 0 if greedy or params.top_k >= self.cfg.vocab_size else params.top_k
        kw = dict(top_k=top_k, greedy=np.bool_(greedy), nucleus=not greedy and params.top_p < 1.0,
                  temperature=np.float32(params.temperature if not greedy else 1.0),
                  top_p=np.float32(params.top_p), min_p=np.float32(params.min_p))
        if record:
            kw["record"] = True
        graphdef, state = nnx.split(self.model)
        prefill_fn, decode_fn, extend_fn, _ = self.program_cache.get(graphdef)
        seed = np.uint32(params.seed)
        mesh, kernels = self.model.mesh, kernels_lib.resolve(self.cfg.kernels)
        return Programs(
            prefill=lambda ds, ids, lens, a_row, a_slot, a_prompt, a_sample, max_new, pixels=None: prefill_fn(
                state, ds, ids, lens, a_row, a_slot, a_prompt, a_sample, seed, max_new, stop_arr, pixels=pixels, **kw),
            decode=lambda ds, min_free, max_steps: decode_fn(state, ds, min_free, max_steps, stop_arr, **kw,
                                                             budget=self.segment_steps),
            extend=lambda ds, ids, lens, slot, n_after, max_new: extend_fn(state, ds, ids, lens, slot, n_after,
                                                                           max_new, stop_arr, **kw),
            grow=lambda ds, new_len: _grow_jit(ds, new_len, mesh, kernels),
            version=self.version,
        )
