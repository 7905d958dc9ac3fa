"""Packed RL batches: an `RLBatch`'s prompt+completion sequences packed into fixed rows (`PackedRLBatch`).

The padded `RLBatch` gives every sequence a row of P + C columns (the longest prompt and completion); packing
places whole sequences one after another in rows of L columns (first-fit decreasing, L = the longest
sequence rounded up to a multiple of 16), each with its own segment id (1, 2, ... in a row, 0 on padding;
attention never crosses segments) and positions restarting at 0, so the forward pass computes only the rows
that hold tokens. Shapes stay static: the row count is rounded up to a few buckets (a multiple of the
trainer's micro-batches and data shards), as are the other sizes below.

Per-token fields (loss mask, behaviour/old/ref log-probs, per-token advantages) are laid out by *sequence
slot*: [R, S, C], slot s of row r holding the s-th sequence of that row exactly as its padded row held it
(an arbitrary loss mask, e.g. 0 on a multi-turn buffer's appended tool tokens, is carried as it is). Reshaped
to [R*S, C] they are a padded per-sequence batch with some empty slots (loss mask 0), so the policy loss and
its per-sequence aggregations (sequence means, GSPO's sequence ratio, the KL) are the padded path's; only
Dr. GRPO's sequence count needs `seq_valid` (which slots hold a sequence). The vocabulary is projected only
at the tokens with loss mask > 0 (`token_src`: the column that predicts compact entry m of a row, at most M
per row; `token_dst`: its place s*C + j in the row's slots; S*C for an unused entry), so the packed forward
never projects prompts or padding. Every leaf has the row count R first, so the trainer moves, shards and
splits a packed batch into micro-batches by rows, and no sequence straddles two.

Shared-prompt rows (`pack_shared_prompts`, `learner.share_prompts`): a row holds one prompt (segment id -1, which
the model lets every segment of the row attend to) and then up to `per_row` completions of it (segments 1, 2, ...;
positions continuing from the prompt's), so a group's prompt goes through the layers once a row. Completion token 0
of every member is predicted from the prompt's last column, so each projected entry carries its target token
(`token_tgt`). `pack_cheapest` picks, per batch, the layout (sequence rows or shared rows of some `per_row`) that
computes least by `row_cost`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from posttrain.data.packing import first_fit_decreasing
from posttrain.rl.batch import RLBatch, bucket_length

__all__ = ["PackedRLBatch", "PackLayout", "pack_rl_batch", "pack_shared_prompts", "pack_cheapest", "prompt_groups",
           "row_cost", "attention_span", "bucket_rows"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRLBatch:
    """One packed (micro-)batch (see the module docstring): R rows of L tokens, S sequence slots of C tokens per
    row, M projected tokens per row.

    input_ids, attention_mask, positions, segment_ids [R, L]: the model's inputs (a negative segment id: a shared
      prompt, seen by every completion of its row).
    token_src, token_dst [R, M] int32: where each projected token is predicted from / goes in the slots;
    token_tgt [R, M] int32: the token predicted there.
    loss_mask, behaviour_logp, old_logp, ref_logp [R, S, C]; advantages [R, S] or [R, S, C].
    seq_valid [R, S] float: 1 where a slot holds a sequence.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    token_src: np.ndarray
    token_dst: np.ndarray
    token_tgt: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    behaviour_logp: np.ndarray
    seq_valid: np.ndarray
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None

    def __len__(self) -> int:
        return int(np.shape(self.input_ids)[0])

    def by_sequence(self, name: str):
        """Field `name` as a padded per-sequence array: [R*S, C] (or [R*S] for per-sequence advantages)."""
        v = getattr(self, name)
        if v is None:
            return None
        r, s = np.shape(self.seq_valid)
        return v.reshape(r * s, *np.shape(v)[2:])


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each sequence of the padded batch went (`row[i]`, `slot[i]`), and token counts."""

    row: np.ndarray
    slot: np.ndarray
    slots: int           # S, sequence slots per row
    row_len: int         # L
    proj: int            # M, projected tokens per row
    tokens: int          # real tokens in the rows (prompt + completion; a shared prompt once a row)
    packed_cells: int    # R * L: what the packed forward computes
    padded_cells: int    # N * (P + C): what the padded forward computes

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(L, S, M): row length, sequence slots and projected tokens per row (`pack_rl_batch`'s `at_least`)."""
        return self.row_len, self.slots, self.proj

    def unpack(self, slots: np.ndarray) -> np.ndarray:
        """[R*S, C] or [R, S, C] per-slot values -> the padded batch's [N, C] (0 where nothing was projected)."""
        slots = np.asarray(slots)
        return slots.reshape(-1, self.slots, slots.shape[-1])[self.row, self.slot]


def bucket_rows(rows: int, multiple: int = 1) -> int:
    """`rows` rounded up to a multiple of `multiple` and to a quarter-octave step (rows in [2^k, 2^(k+1)) move
    in steps of 2^(k-2)), so a run sees few distinct row counts and at most ~25% padding rows."""
    step = math.lcm(max(1, 2 ** max(0, int(rows).bit_length() - 3)), max(1, multiple))
    return max(step, -(-rows // step) * step)


def _spans(attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first real column and one past its last (the padded layout keeps real tokens contiguous)."""
    am = np.asarray(attention_mask) > 0
    t = am.shape[1]
    start = np.argmax(am, axis=1)
    end = t - np.argmax(am[:, ::-1], axis=1)
    return start, np.where(am.any(axis=1), end, start)


def pack_rl_batch(batch: RLBatch, *, row_multiple: int = 1, multiple: int = 16,
                  at_least: tuple[int, int, int] = (0, 0, 0)) -> tuple[PackedRLBatch, PackLayout]:
    """Packs a padded `RLBatch` (its `old_logp`/`ref_logp` too, when set); returns the packed batch and the layout.

    `row_multiple`: the row count is a multiple of it (the trainer's micro-batches x data shards);
    `multiple`: row length L and projected tokens per row M are multiples of it; `at_least`: lower bounds of
    (L, S, M) (`PackLayout.sizes` of earlier batches: sizes that only grow compile a run's step a few times).
    """
    n, t = np.shape(batch.input_ids)
    c = batch.completion_len
    start, end = _spans(batch.attention_mask)
    lengths = end - start
    row_len = max(bucket_length(int(lengths.max(initial=1)), multiple), at_least[0])
    bins = first_fit_decreasing(lengths.tolist(), row_len)
    proj, s, m, out = _allocate(batch, bins, row_len, row_multiple, multiple, at_least)
    r = len(out.ids)
    row, slot = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for ri, members in enumerate(bins):
        col, k = 0, 0
        for si, i in enumerate(members):
            row[i], slot[i] = ri, si
            first_completion = col + (t - c) - start[i]  # the column of completion token 0 in the packed row
            out.place(ri, si, col, i, start[i], end[i], k, first_completion - 1 + proj[i], si * c + proj[i])
            col, k = col + lengths[i], k + len(proj[i])
    layout = PackLayout(row=row, slot=slot, slots=s, row_len=row_len, proj=m, tokens=int(lengths.sum()),
                        packed_cells=r * row_len, padded_cells=n * t)
    return out.build(), layout


def _allocate(batch: RLBatch, rows: list[list[int]], row_len: int, row_multiple: int, multiple: int,
              at_least: tuple[int, int, int]):
    """The projected completion tokens of each sequence (loss mask > 0), the slots S and projected tokens M a row
    for `rows` (lists of sequence indices; at least `at_least`'s), and the empty `_Rows` to fill (its row count
    rounded by `bucket_rows`)."""
    proj = [np.flatnonzero(m > 0) for m in np.asarray(batch.loss_mask, np.float32)]
    s = max(1 << max(0, (max(len(x) for x in rows) - 1).bit_length()), at_least[1])
    m = max(bucket_length(max(sum(len(proj[i]) for i in x) for x in rows), multiple), at_least[2])
    out = _Rows(bucket_rows(len(rows), row_multiple), row_len, s, batch.completion_len, m, batch)
    return proj, s, m, out


def prompt_groups(batch: RLBatch) -> list[list[int]]:
    """The sequences of `batch` grouped by identical prompt tokens (in order of first appearance)."""
    ids = np.asarray(batch.input_ids)
    p = ids.shape[1] - batch.completion_len
    start, _ = _spans(batch.attention_mask)
    groups: dict[bytes, list[int]] = {}
    for i in range(len(ids)):
        groups.setdefault(ids[i, start[i]:p].tobytes(), []).append(i)
    return list(groups.values())


def attention_span(cfg) -> float:
    """`row_cost`'s attention span of a model config: a layer's weights / (2 x heads x head_dim) (attention's two
    products cost 4 x heads x head_dim x L per token against 2 x the weights)."""
    return cfg.layer_matmul_params() / (2.0 * cfg.num_heads * cfg.head_dim)


def row_cost(rows: int, row_len: int, attn_span: float) -> float:
    """What a forward over `rows` x `row_len` computes, in units of one token through the layers' weights: each
    row costs L (1 + L / attn_span), attention over the row (computed whole, masked) adding L^2 / attn_span
    (`attn_span` = the layer weights / (2 x heads x head_dim): the row length where attention costs as much)."""
    return rows * row_len * (1.0 + row_len / attn_span)


def pack_shared_prompts(batch: RLBatch, per_row: int, *, groups: list[list[int]] | None = None, row_multiple: int = 1,
                        multiple: int = 16, at_least: tuple[int, int, int] = (0, 0, 0)
                        ) -> tuple[PackedRLBatch, PackLayout]:
    """Packs `batch` into shared-prompt rows: each row holds one prompt (segment -1) and then up to `per_row` of
    its completions (segments 1, 2, ...), each completion's positions continuing from the prompt's, so a prompt's
    layers are computed once a row instead of once a sequence (attention keeps the completions apart; the mask
    rule is in `posttrain.models.transformer`). Completion token 0 of every member is predicted from the
    prompt's last column. Same per-slot fields, sizes and layout as `pack_rl_batch` (same arguments)."""
    n, t = np.shape(batch.input_ids)
    c, p = batch.completion_len, t - batch.completion_len
    start, end = _spans(batch.attention_mask)
    rows, lengths = _shared_rows(batch, prompt_groups(batch) if groups is None else groups, per_row)
    row_len = max(bucket_length(max(lengths), multiple), at_least[0])
    proj, s, m, out = _allocate(batch, rows, row_len, row_multiple, multiple, at_least)
    r = len(out.ids)
    row, slot = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for ri, members in enumerate(rows):
        plen = p - start[members[0]]
        out.place(ri, 0, 0, members[0], start[members[0]], p, 0, None, None, seg=-1)  # the shared prompt
        col, k = plen, 0
        for si, i in enumerate(members):
            row[i], slot[i] = ri, si
            src = np.where(proj[i] == 0, plen - 1, col + proj[i] - 1)
            out.place(ri, si, col, i, p, end[i], k, src, si * c + proj[i], pos0=plen)
            col, k = col + int(end[i]) - p, k + len(proj[i])
    layout = PackLayout(row=row, slot=slot, slots=s, row_len=row_len, proj=m, tokens=int(sum(lengths)),
                        packed_cells=r * row_len, padded_cells=n * t)
    return out.build(), layout


def _shared_rows(batch: RLBatch, groups: list[list[int]], per_row: int) -> tuple[list[list[int]], list[int]]:
    """The sequences of each shared-prompt row (each group cut into rows of `per_row`) and each row's tokens."""
    p = np.shape(batch.input_ids)[1] - batch.completion_len
    start, end = _spans(batch.attention_mask)
    rows = [g[k: k + per_row] for g in groups for k in range(0, len(g), per_row)]
    return rows, [p - int(start[r[0]]) + sum(int(end[i]) - p for i in r) for r in rows]


def pack_cheapest(batch: RLBatch, attn_span: float, *, row_multiple: int = 1, multiple: int = 16,
                  at_least: tuple[int, int, int] = (0, 0, 0)) -> tuple[PackedRLBatch, PackLayout]:
    """The cheapest packing of `batch` by `row_cost`: sequence rows (`pack_rl_batch`), or shared-prompt rows
    (`pack_shared_prompts`) with the number of completions a row that computes least (sharing a prompt saves
    its layers once per extra completion; a longer row pays more attention). Only the chosen layout is built."""
    kw = dict(row_multiple=row_multiple, multiple=multiple, at_least=at_least)
    best = pack_rl_batch(batch, **kw)
    cost, per_row_best = row_cost(len(best[0]), best[1].row_len, attn_span), None
    groups = prompt_groups(batch)
    for per_row in range(2, max(len(g) for g in groups) + 1):
        rows, lengths = _shared_rows(batch, groups, per_row)
        c = row_cost(bucket_rows(len(rows), row_multiple),
                     max(bucket_length(max(lengths), multiple), at_least[0]), attn_span)
        if c < cost:
            cost, per_row_best = c, per_row
    return best if per_row_best is None else pack_shared_prompts(batch, per_row_best, groups=groups, **kw)


class _Rows:
    """The host arrays of a packed batch being filled (`pack_rl_batch`)."""

    def __init__(self, r: int, row_len: int, s: int, c: int, m: int, batch: RLBatch):
        self.batch, self.c, self.t = batch, c, np.shape(batch.input_ids)[1]
        self.ids = np.zeros((r, row_len), np.int32)
        self.seg = np.zeros((r, row_len), np.int32)
        self.pos = np.zeros((r, row_len), np.int32)
        self.src = np.zeros((r, m), np.int32)
        self.tgt = np.zeros((r, m), np.int32)
        self.dst = np.full((r, m), s * c, np.int32)
        self.valid = np.zeros((r, s), np.float32)
        adv = np.asarray(batch.advantages, np.float32)
        names = ["loss_mask", "behaviour_logp", "old_logp", "ref_logp"]
        self.tok = {k: np.zeros((r, s, c), np.float32) for k in names if getattr(batch, k) is not None}
        self.adv = np.zeros((r, s, *adv.shape[1:]), np.float32)

    def place(self, ri, si, col, i, a, b, k, src, dst, seg=None, pos0=0):
        """Columns a:b of sequence i's padded row at column `col` of row ri (segment `seg`, default slot si + 1;
        positions from `pos0`). Projected tokens (when `src` is given): entries k.. of the row's compact list,
        predicted from columns `src`, going to slot places `dst`; sequence i's fields fill slot si."""
        n = b - a
        ids = np.asarray(self.batch.input_ids)
        self.ids[ri, col: col + n] = ids[i, a:b]
        self.seg[ri, col: col + n] = si + 1 if seg is None else seg
        self.pos[ri, col: col + n] = pos0 + np.arange(n)
        if src is None:
            return
        self.src[ri, k: k + len(src)] = src
        self.dst[ri, k: k + len(dst)] = dst
        self.tgt[ri, k: k + len(dst)] = ids[i, (self.t - self.c) + dst - si * self.c]  # completion token j of i
        self.valid[ri, si] = 1.0
        for name, arr in self.tok.items():
            arr[ri, si] = np.asarray(getattr(self.batch, name))[i]
        self.adv[ri, si] = np.asarray(self.batch.advantages)[i]

    def build(self) -> PackedRLBatch:
        return PackedRLBatch(
            input_ids=self.ids, attention_mask=(self.seg != 0).astype(np.int32), positions=self.pos,
            segment_ids=self.seg, token_src=self.src, token_dst=self.dst, token_tgt=self.tgt,
            loss_mask=self.tok["loss_mask"],
            advantages=self.adv, behaviour_logp=self.tok["behaviour_logp"], seq_valid=self.valid,
            old_logp=self.tok.get("old_logp"), ref_logp=self.tok.get("ref_logp"))
