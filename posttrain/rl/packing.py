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

Image prompts (a vision-language batch: `RLBatch.pixel_values` and `image_counts`): a packed row's images are the
images of its sequences in row (column) order, blank images after them, [R, I, 3, H, W]: the model's placeholders
take a row's images in order (`posttrain.algorithms.sft.images_in_order`, `posttrain.models.multimodal`), so
each sequence's placeholders get its own images, and a shared-prompt row holds its prompt's images once. Prompts
share a row only when their tokens and their images are equal (one text with different pictures are different
prompts). I, the images a row, is a power of two that only grows (a fourth entry of `PackLayout.sizes`).

One shape a run (`PackPlan`, issue 40's compile budget): given the shortest prompt of the run, the first batch
keeps its cheapest layout and fixes L, S and M at what any batch of the run can need in it. Sequence rows: L = the
batch's P + C columns (which the batch builder pads to the run's longest prompt and completion budget), S = the most
sequences of at least `prompt_min` + 1 tokens a row holds, M = a row's columns after one prompt, and the row count
R the first batch's with 25% headroom. Shared-prompt rows of k completions (kept when they compute less than those):
L = P + k C, S = k, M = k C, and R the first batch's when batches hold whole groups, else what any split of its
groups can need. A later batch that needs more rows takes the worst case (every sequence a
row of its own). So the step
that trains (and the one that scores) on packed rows compiles once, at most twice, whatever the completion
lengths. Image batches keep growing I, the images a row.

Routing replay (`RLBatch.routed_experts`): the recorded experts are columns like the input ids, so they move with
their tokens ([R, L, L_sparse, k], -1 on padding); a shared-prompt row takes its prompt's from the row's first
sequence (equal tokens at equal positions: the same routing, up to the sampler's numerics).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from posttrain.data.packing import first_fit_decreasing
from posttrain.rl.batch import RLBatch, bucket_length

__all__ = ["PackedRLBatch", "PackLayout", "PackPlan", "pack_rl_batch", "pack_shared_prompts", "pack_cheapest",
           "prompt_groups", "row_cost", "attention_span", "bucket_rows", "fixed_sizes", "shared_sizes"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRLBatch:
    """One packed (micro-)batch (see the module docstring): R rows of L tokens, S sequence slots of C tokens per
    row, M projected tokens per row.

    input_ids, attention_mask, positions, segment_ids [R, L]: the model's inputs (a negative segment id: a shared
      prompt, seen by every completion of its row).
    token_src, token_dst [R, M] int32: where each projected token is predicted from / goes in the slots;
    token_tgt [R, M] int32: the token predicted there.
    loss_mask, behaviour_logp, old_logp, ref_logp, is_weight [R, S, C]; advantages [R, S] or [R, S, C].
    seq_valid [R, S] float: 1 where a slot holds a sequence.
    pixel_values [R, I, 3, H, W] | None: an image batch's images, row r's sequences' own in column order (a shared
      prompt's once), blanks after them (module docstring); None for text.
    routed_experts [R, L, L_sparse, k] | None: routing replay's recorded experts, aligned with input_ids (-1: none).
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
    is_weight: np.ndarray | None = None
    pixel_values: np.ndarray | None = None
    routed_experts: np.ndarray | None = None

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
    images: int = 0      # I, images per row (image batches; 0 for text)

    @property
    def sizes(self) -> tuple[int, ...]:
        """(L, S, M): row length, sequence slots and projected tokens per row (`pack_rl_batch`'s `at_least`), and
        for an image batch I, the images a row: (L, S, M, I)."""
        return (self.row_len, self.slots, self.proj) + ((self.images,) if self.images else ())

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
                  at_least: tuple[int, int, int] = (0, 0, 0), min_rows: int = 0) -> tuple[PackedRLBatch, PackLayout]:
    """Packs a padded `RLBatch` (its `old_logp`/`ref_logp` too, when set); returns the packed batch and the layout.

    `row_multiple`: the row count is a multiple of it (the trainer's micro-batches x data shards);
    `multiple`: row length L and projected tokens per row M are multiples of it; `at_least`: lower bounds of
    (L, S, M) or, for image batches, (L, S, M, I) (`PackLayout.sizes` of earlier batches: sizes that only grow
    compile a run's step a few times); `min_rows`: a lower bound of the row count R (a multiple of `row_multiple`).
    """
    n, t = np.shape(batch.input_ids)
    c = batch.completion_len
    start, end = _spans(batch.attention_mask)
    lengths = end - start
    row_len = max(bucket_length(int(lengths.max(initial=1)), multiple), at_least[0])
    bins = first_fit_decreasing(lengths.tolist(), row_len)
    proj, s, m, out = _allocate(batch, bins, row_len, row_multiple, multiple, at_least, min_rows)
    r = len(out.ids)
    row, slot = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for ri, members in enumerate(bins):
        col, k = 0, 0
        for si, i in enumerate(members):
            row[i], slot[i] = ri, si
            first_completion = col + (t - c) - start[i]  # the column of completion token 0 in the packed row
            out.place(ri, si, col, i, start[i], end[i], k, first_completion - 1 + proj[i], si * c + proj[i])
            col, k = col + lengths[i], k + len(proj[i])
    pixels = _row_images(batch, bins, r, at_least)
    layout = PackLayout(row=row, slot=slot, slots=s, row_len=row_len, proj=m, tokens=int(lengths.sum()),
                        packed_cells=r * row_len, padded_cells=n * t, images=_images_per_row(pixels))
    return out.build(pixels), layout


def _allocate(batch: RLBatch, rows: list[list[int]], row_len: int, row_multiple: int, multiple: int,
              at_least: tuple[int, int, int], min_rows: int = 0):
    """The projected completion tokens of each sequence (loss mask > 0), the slots S and projected tokens M a row
    for `rows` (lists of sequence indices; at least `at_least`'s), and the empty `_Rows` to fill (its row count
    rounded by `bucket_rows`, at least `min_rows`)."""
    proj = [np.flatnonzero(m > 0) for m in np.asarray(batch.loss_mask, np.float32)]
    s = max(1 << max(0, (max(len(x) for x in rows) - 1).bit_length()), at_least[1])
    m = max(bucket_length(max(sum(len(proj[i]) for i in x) for x in rows), multiple), at_least[2])
    out = _Rows(max(bucket_rows(len(rows), row_multiple), min_rows), row_len, s, batch.completion_len, m, batch)
    return proj, s, m, out


def prompt_groups(batch: RLBatch) -> list[list[int]]:
    """The sequences of `batch` grouped by identical prompts (in order of first appearance): equal prompt tokens
    and, in an image batch, equal images."""
    ids = np.asarray(batch.input_ids)
    p = ids.shape[1] - batch.completion_len
    start, _ = _spans(batch.attention_mask)
    by_tokens: dict[bytes, list[list[int]]] = {}
    groups: list[list[int]] = []
    for i in range(len(ids)):
        same = by_tokens.setdefault(ids[i, start[i]:p].tobytes(), [])
        g = next((g for g in same if _same_images(batch, g[0], i)), None)
        if g is None:
            g = []
            same.append(g)
            groups.append(g)
        g.append(i)
    return groups


def _own_images(batch: RLBatch, i: int) -> np.ndarray:
    """Sequence i's own images [k, 3, H, W] (its row of `pixel_values` without the blanks)."""
    if batch.image_counts is None:
        raise ValueError("an image batch without image_counts cannot be packed (`build_rl_batch` sets them)")
    return np.asarray(batch.pixel_values)[i, : int(np.asarray(batch.image_counts)[i])]


def _same_images(batch: RLBatch, a: int, b: int) -> bool:
    """Whether sequences a and b have the same images (always, in a text batch)."""
    return batch.pixel_values is None or np.array_equal(_own_images(batch, a), _own_images(batch, b))


def _row_images(batch: RLBatch, rows: list[list[int]], r: int, at_least: tuple[int, ...]) -> np.ndarray | None:
    """[r, I, 3, H, W]: row ri holds the own images of the sequences `rows[ri]` in order, blanks after them (rows
    past `rows` only blanks); I the most a row holds, rounded up to a power of two, at least `at_least[3]` when
    given. None for a text batch."""
    if batch.pixel_values is None:
        return None
    own = [[_own_images(batch, i) for i in members] for members in rows]
    most = max(sum(len(x) for x in row) for row in own)
    size = max(1 << max(0, (most - 1).bit_length()), at_least[3] if len(at_least) > 3 else 0)
    out = np.zeros((r, size, *np.shape(batch.pixel_values)[2:]), np.float32)
    for ri, row in enumerate(own):
        if row:
            x = np.concatenate(row)
            out[ri, : len(x)] = x
    return out


def _images_per_row(pixels: np.ndarray | None) -> int:
    return 0 if pixels is None else int(pixels.shape[1])


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
                        multiple: int = 16, at_least: tuple[int, int, int] = (0, 0, 0), min_rows: int = 0
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
    proj, s, m, out = _allocate(batch, rows, row_len, row_multiple, multiple, at_least, min_rows)
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
    pixels = _row_images(batch, [members[:1] for members in rows], r, at_least)  # the prompt's images, once
    layout = PackLayout(row=row, slot=slot, slots=s, row_len=row_len, proj=m, tokens=int(sum(lengths)),
                        packed_cells=r * row_len, padded_cells=n * t, images=_images_per_row(pixels))
    return out.build(pixels), layout


def _shared_rows(batch: RLBatch, groups: list[list[int]], per_row: int) -> tuple[list[list[int]], list[int]]:
    """The sequences of each shared-prompt row (each group cut into rows of `per_row`) and each row's tokens."""
    p = np.shape(batch.input_ids)[1] - batch.completion_len
    start, end = _spans(batch.attention_mask)
    rows = [g[k: k + per_row] for g in groups for k in range(0, len(g), per_row)]
    return rows, [p - int(start[r[0]]) + sum(int(end[i]) - p for i in r) for r in rows]


def pack_cheapest(batch: RLBatch, attn_span: float, *, row_multiple: int = 1, multiple: int = 16,
                  at_least: tuple[int, int, int] = (0, 0, 0), min_rows: int = 0,
                  row_len_cap: int | None = None) -> tuple[PackedRLBatch, PackLayout]:
    """The cheapest packing of `batch` by `row_cost`: sequence rows (`pack_rl_batch`), or shared-prompt rows
    (`pack_shared_prompts`) with the number of completions a row that computes least (sharing a prompt saves
    its layers once per extra completion; a longer row pays more attention). Only the chosen layout is built.
    `row_len_cap`: shared-prompt layouts with longer rows are not considered (a run's fixed row length)."""
    kw = dict(row_multiple=row_multiple, multiple=multiple, at_least=at_least, min_rows=min_rows)
    best = pack_rl_batch(batch, **kw)
    cost, per_row_best = row_cost(len(best[0]), best[1].row_len, attn_span), None
    groups = prompt_groups(batch)
    for per_row in range(2, max(len(g) for g in groups) + 1):
        rows, lengths = _shared_rows(batch, groups, per_row)
        row_len = max(bucket_length(max(lengths), multiple), at_least[0])
        if row_len_cap is not None and row_len > row_len_cap:
            break  # more completions a row only make it longer
        c = row_cost(max(bucket_rows(len(rows), row_multiple), min_rows), row_len, attn_span)
        if c < cost:
            cost, per_row_best = c, per_row
    return best if per_row_best is None else pack_shared_prompts(batch, per_row_best, groups=groups, **kw)


HEADROOM = 1.25  # the first batch's rows x this: the row count a run's packed batches start with


def fixed_sizes(batch: RLBatch, prompt_min: int, multiple: int = 16) -> tuple[int, int, int]:
    """(L, S, M) of sequence rows that hold any batch of `batch`'s columns (P + C) whose prompts have at least
    `prompt_min` tokens (module docstring): one sequence's columns, the sequences of at least `prompt_min` + 1
    tokens that fit (or a prompt group; at most the batch's), a row's columns after one prompt (at most S x C)."""
    n, t = np.shape(batch.input_ids)
    row_len = bucket_length(t, multiple)
    most = min(n, max(row_len // (prompt_min + 1), max(len(g) for g in prompt_groups(batch))))
    slots = 1 << max(0, (most - 1).bit_length())
    return row_len, slots, bucket_length(min(row_len - prompt_min, slots * batch.completion_len), multiple)


def shared_sizes(batch: RLBatch, per_row: int, multiple: int = 16) -> tuple[int, int, int]:
    """(L, S, M) of shared-prompt rows of `per_row` completions that hold any batch of `batch`'s columns: a prompt
    and `per_row` completions, `per_row` slots, `per_row` completions' tokens."""
    c = batch.completion_len
    row_len = bucket_length(np.shape(batch.input_ids)[1] + (per_row - 1) * c, multiple)
    return row_len, 1 << max(0, (per_row - 1).bit_length()), bucket_length(per_row * c, multiple)


class PackPlan:
    """How one kind of batch of a run (training, or scoring) is packed: `pack(batch) -> (packed, layout)`.

    `row_multiple`: the trainer's micro-batches x data shards; `attn_span`: rows may share a prompt
    (`pack_cheapest`); `prompt_min`: the run's shortest prompt, with which the first batch fixes the layout and its
    sizes (module docstring: one compile); `whole_groups`: every batch holds whole prompt groups (no minibatch
    split), so shared-prompt rows are as many as the first batch's. None: the sizes only grow as batches need."""

    def __init__(self, *, row_multiple: int = 1, attn_span: float | None = None, prompt_min: int | None = None,
                 multiple: int = 16, whole_groups: bool = True):
        self.row_multiple, self.attn_span, self.prompt_min, self.multiple = row_multiple, attn_span, prompt_min, multiple
        self.whole_groups = whole_groups
        self.sizes: tuple[int, ...] = (0, 0, 0)
        self.rows = 0
        self.per_row = 0  # shared-prompt rows of this many completions, once the first batch chose them

    def _pack(self, batch: RLBatch) -> tuple[PackedRLBatch, PackLayout]:
        kw = dict(row_multiple=self.row_multiple, multiple=self.multiple, at_least=self.sizes, min_rows=self.rows)
        if self.per_row:
            return pack_shared_prompts(batch, self.per_row, **kw)
        if self.attn_span is None:
            return pack_rl_batch(batch, **kw)
        cap = self.sizes[0] if self.prompt_min is not None and self.sizes[0] else None
        return pack_cheapest(batch, self.attn_span, row_len_cap=cap, **kw)

    def _fix(self, batch: RLBatch, packed: PackedRLBatch, layout: PackLayout) -> int:
        """Fixes the layout and sizes by the first batch; returns the rows every batch gets. Sequence rows: the
        first batch's with 25% headroom. Shared-prompt rows of the k completions a row its cheapest layout chose:
        as many as its own (whole groups), else as many as any split of its groups can need; kept only when
        they compute less than the sequence rows."""
        n, m = len(batch), self.row_multiple
        worst = bucket_rows(n, m)
        seq = fixed_sizes(batch, self.prompt_min, self.multiple)
        seq_rows = len(pack_rl_batch(batch, row_multiple=m, multiple=self.multiple, at_least=seq)[0].input_ids)
        self.sizes, rows = seq, min(worst, bucket_rows(math.ceil(seq_rows * HEADROOM), m))
        if (np.asarray(packed.segment_ids) < 0).any():  # the cheapest layout shares prompts
            k = int(layout.slot.max()) + 1
            shared = shared_sizes(batch, k, self.multiple)
            groups = len(prompt_groups(batch))
            need = len(packed.input_ids) if self.whole_groups else bucket_rows(groups + -(-(n - groups) // k), m)
            if row_cost(min(worst, need), shared[0], self.attn_span) < row_cost(rows, seq[0], self.attn_span):
                self.sizes, rows, self.per_row = shared, min(worst, need), k
        return rows

    def pack(self, batch: RLBatch) -> tuple[PackedRLBatch, PackLayout]:
        packed, layout = self._pack(batch)
        if self.prompt_min is not None:
            if not self.rows:  # the first batch: it fixes the layout, the sizes and the rows
                rows = self._fix(batch, packed, layout)
            elif len(packed.input_ids) > self.rows:  # more rows than planned: the worst case, once
                rows = bucket_rows(len(batch), self.row_multiple)
            else:
                rows = self.rows
            if rows != self.rows or not self.rows:
                self.rows = rows
                packed, layout = self._pack(batch)
        self.sizes = layout.sizes  # what a batch exceeded (its images a row, or a bound) grows from here on
        return packed, layout


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
        names = ["loss_mask", "behaviour_logp", "old_logp", "ref_logp", "is_weight"]
        self.tok = {k: np.zeros((r, s, c), np.float32) for k in names if getattr(batch, k) is not None}
        self.adv = np.zeros((r, s, *adv.shape[1:]), np.float32)
        exp = batch.routed_experts
        self.experts = None if exp is None else np.full((r, row_len, *np.shape(exp)[2:]), -1, np.asarray(exp).dtype)

    def place(self, ri, si, col, i, a, b, k, src, dst, seg=None, pos0=0):
        """Columns a:b of sequence i's padded row at column `col` of row ri (segment `seg`, default slot si + 1;
        positions from `pos0`). Projected tokens (when `src` is given): entries k.. of the row's compact list,
        predicted from columns `src`, going to slot places `dst`; sequence i's fields fill slot si."""
        n = b - a
        ids = np.asarray(self.batch.input_ids)
        self.ids[ri, col: col + n] = ids[i, a:b]
        self.seg[ri, col: col + n] = si + 1 if seg is None else seg
        self.pos[ri, col: col + n] = pos0 + np.arange(n)
        if self.experts is not None:
            self.experts[ri, col: col + n] = np.asarray(self.batch.routed_experts)[i, a:b]
        if src is None:
            return
        self.src[ri, k: k + len(src)] = src
        self.dst[ri, k: k + len(dst)] = dst
        self.tgt[ri, k: k + len(dst)] = ids[i, (self.t - self.c) + dst - si * self.c]  # completion token j of i
        self.valid[ri, si] = 1.0
        for name, arr in self.tok.items():
            arr[ri, si] = np.asarray(getattr(self.batch, name))[i]
        self.adv[ri, si] = np.asarray(self.batch.advantages)[i]

    def build(self, pixel_values: np.ndarray | None = None) -> PackedRLBatch:
        return PackedRLBatch(pixel_values=pixel_values,
            input_ids=self.ids, attention_mask=(self.seg != 0).astype(np.int32), positions=self.pos,
            segment_ids=self.seg, token_src=self.src, token_dst=self.dst, token_tgt=self.tgt,
            loss_mask=self.tok["loss_mask"],
            advantages=self.adv, behaviour_logp=self.tok["behaviour_logp"], seq_valid=self.valid,
            old_logp=self.tok.get("old_logp"), ref_logp=self.tok.get("ref_logp"), is_weight=self.tok.get("is_weight"),
            routed_experts=self.experts)
