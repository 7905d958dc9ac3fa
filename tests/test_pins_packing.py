"""Pins of the packed RL batch's projected tokens (issue 41): `token_src` (the packed column that predicts each
loss-masked completion token), `token_tgt` (that token) and `token_dst` (its slot place) of sequence rows, computed
by hand for three sequences of different prompt and completion lengths sharing one row."""

from __future__ import annotations

import math

import jax
import numpy as np

from posttrain.rl.batch import RLBatch, build_rl_batch
from posttrain.rl.packing import PackPlan, bucket_rows, pack_rl_batch, pack_shared_prompts
from posttrain.rollout.rollouts import Rollouts


def test_sequence_rows_token_src_and_tgt_by_hand():
    # P = 3 prompt columns (left-padded), C = 4 completion columns; 0 is padding
    ids = np.array([[0, 11, 12, 21, 22, 23, 0],     # seq 0: prompt 11 12, completion 21 22 23 (5 tokens)
                    [31, 32, 33, 41, 42, 0, 0],     # seq 1: prompt 31 32 33, completion 41 42 (5 tokens)
                    [0, 51, 52, 61, 62, 63, 64]],   # seq 2: prompt 51 52, completion 61 62 63 64 (6 tokens)
                   np.int32)
    am = (ids != 0).astype(np.int32)
    mask = np.array([[1, 0, 1, 0],                  # a hole (a tool token, say) inside seq 0's completion
                     [1, 1, 0, 0],
                     [0, 1, 1, 1]], np.float32)     # seq 2's first completion token not trained
    positions = np.maximum(np.cumsum(am, axis=1) - 1, 0).astype(np.int32)
    logp = -np.arange(1, 13, dtype=np.float32).reshape(3, 4) / 10 * mask
    batch = RLBatch(input_ids=ids, attention_mask=am, positions=positions, loss_mask=mask,
                    advantages=np.array([0.5, -1.0, 2.0], np.float32), behaviour_logp=logp)
    packed, layout = pack_rl_batch(batch)
    # first-fit decreasing into one row of 16: seq 2 (6 tokens) at columns 0-5, seq 0 at 6-10, seq 1 at 11-15
    assert layout.row.tolist() == [0, 0, 0] and layout.slot.tolist() == [1, 2, 0]
    assert (layout.row_len, layout.slots, layout.proj) == (16, 4, 16) and len(packed) == 1
    assert packed.input_ids[0].tolist() == [51, 52, 61, 62, 63, 64, 11, 12, 21, 22, 23, 31, 32, 33, 41, 42]
    assert packed.segment_ids[0].tolist() == [1] * 6 + [2] * 5 + [3] * 5
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    # projected entries, in row order: seq 2's completion tokens 1-3 (62 63 64, predicted from columns 2-4, i.e.
    # from 61 62 63), seq 0's tokens 0 and 2 (21 from column 7 = 12, 23 from column 9 = 22), seq 1's tokens 0 and
    # 1 (41 from column 13 = 33, 42 from column 14 = 41); dst = slot * C + completion index; unused: S * C = 16
    unused = 16 - 7
    assert packed.token_src[0].tolist() == [2, 3, 4, 7, 9, 13, 14] + [0] * unused
    assert packed.token_tgt[0].tolist() == [62, 63, 64, 21, 23, 41, 42] + [0] * unused
    assert packed.token_dst[0].tolist() == [1, 2, 3, 4, 6, 8, 9] + [16] * unused
    # the invariant behind them: each target is the token right after its source column, in the same segment
    src, tgt = packed.token_src[0, :7], packed.token_tgt[0, :7]
    assert (packed.input_ids[0, src + 1] == tgt).all()
    assert (packed.segment_ids[0, src] == packed.segment_ids[0, src + 1]).all()
    # the slots hold each sequence's per-token fields as its padded row did
    np.testing.assert_array_equal(packed.loss_mask[0, :3], mask[[2, 0, 1]])
    np.testing.assert_array_equal(packed.behaviour_logp[0, :3], logp[[2, 0, 1]])
    assert packed.seq_valid[0].tolist() == [1, 1, 1, 0] and packed.advantages[0].tolist() == [2.0, 0.5, -1.0, 0.0]
    np.testing.assert_array_equal(layout.unpack(packed.loss_mask), mask)


# ---------------------------------------------------------------------------------------- PackPlan's bounds
def _run_batch(seed: int, completions: tuple[int, int], prompts: tuple[int, int] = (3, 15), groups: int = 8,
               group_size: int = 8) -> RLBatch:
    """A GRPO batch of `groups` x `group_size` sequences (one prompt a group), prompt and completion lengths drawn
    from the ranges given, padded to the run's bounds (P, C) = (16, 24) as the batch builder pads every batch."""
    rng = np.random.default_rng(seed)
    n = groups * group_size
    lengths = rng.integers(completions[0], completions[1] + 1, size=n).tolist()
    prompt = [rng.integers(3, 64, size=int(rng.integers(prompts[0], prompts[1] + 1))).tolist() for _ in range(groups)]
    ro = Rollouts(group_size=group_size, record_index=[i // group_size for i in range(n)],
                  prompt_ids=[prompt[i // group_size] for i in range(n)],
                  completion_ids=[rng.integers(3, 64, size=k).tolist() for k in lengths],
                  logprobs=[(-rng.uniform(0.5, 4.0, size=k)).tolist() for k in lengths], finish_reasons=["stop"] * n,
                  texts=[""] * n, prompts_text=[""] * n, rewards=np.zeros(n, np.float32), per_reward={},
                  reward_stats={})
    return build_rl_batch(ro, rng.normal(size=n).astype(np.float32), multiple=8, at_least=(16, 24))


def _shapes(packed) -> tuple:
    return tuple(np.shape(x) for x in jax.tree.leaves(packed))


def _rows_used(layout) -> int:
    return int(layout.row.max()) + 1


def test_pack_plan_first_batch_rows_have_the_stated_headroom():
    """The first batch fixes the row count at its own (packed at the plan's sizes) + 25%, bucketed, so a later
    batch that fills somewhat more rows keeps the first batch's shape."""
    plan = PackPlan(prompt_min=3, multiple=8, row_multiple=2)
    first = _run_batch(0, completions=(1, 4))
    packed, layout = plan.pack(first)
    own = len(pack_rl_batch(first, row_multiple=2, multiple=8, at_least=layout.sizes)[0])
    assert own >= 16 and len(first) == 64  # enough rows that 25% is more than the bucket's rounding
    assert math.ceil(1.25 * own) <= len(packed) <= bucket_rows(math.ceil(1.25 * own), 2) < len(first)
    assert packed.input_ids.shape == (len(packed), 40) and packed.loss_mask.shape[:2] == packed.seq_valid.shape
    later_packed, later = plan.pack(_run_batch(10, completions=(1, 6)))
    assert _rows_used(layout) < _rows_used(later) <= len(packed)  # more rows than the first, within its headroom
    assert _shapes(later_packed) == _shapes(packed)


def test_pack_plan_overflow_moves_to_the_worst_case_once():
    """Batches that need more rows than planned (longer and longer completions) move the plan to the worst case,
    one sequence a row (64 rows), at the first of them, and every later batch keeps that shape: not each overflow
    to its own row count, which would be a new shape (a new compile) per overflow."""
    plan = PackPlan(prompt_min=3, multiple=8, row_multiple=2)
    shapes, rows = [], []
    for seed, completions in enumerate([(1, 4), (8, 24), (14, 24), (20, 24), (1, 4)]):
        batch = _run_batch(seed, completions)
        packed, layout = plan.pack(batch)
        shapes.append(_shapes(packed))
        rows.append(len(packed))
        np.testing.assert_array_equal(layout.unpack(packed.loss_mask), batch.loss_mask)
    assert rows[0] < 48 and rows[1:] == [bucket_rows(64, 2)] * 4, rows  # batch 1 needs more than 48, not 64
    assert len(set(shapes)) == 2 and shapes[1:] == [shapes[1]] * 4, rows


def test_pack_plan_shared_prompt_rows_are_capped_at_the_first_row_length():
    """The first batch (short completions) packs one sequence after another in rows of P + C = 40 columns. A later
    batch of long completions would compute less in shared-prompt rows of two completions (56 columns) that fit
    the planned row count; the plan keeps its row length instead (it overflows to the worst case: 64 rows of 40)."""
    plan = PackPlan(prompt_min=3, multiple=8, attn_span=1000.0)
    packed, _ = plan.pack(_run_batch(0, completions=(4, 12), prompts=(3, 6)))
    assert packed.input_ids.shape[1] == 40 and not (packed.segment_ids < 0).any()
    for seed in (1, 2, 3):
        batch = _run_batch(seed, completions=(16, 24), prompts=(3, 6))
        shared, _ = pack_shared_prompts(batch, 2, multiple=8)  # what these batches would pack to, uncapped
        assert shared.input_ids.shape[1] > 40 and len(shared) <= len(packed)
        later, layout = plan.pack(batch)
        assert later.input_ids.shape == (64, 40), later.input_ids.shape
        np.testing.assert_array_equal(layout.unpack(later.loss_mask), batch.loss_mask)
