"""Pins of the packed RL batch's projected tokens (issue 41): `token_src` (the packed column that predicts each
loss-masked completion token), `token_tgt` (that token) and `token_dst` (its slot place) of sequence rows, computed
by hand for three sequences of different prompt and completion lengths sharing one row."""

from __future__ import annotations

import numpy as np

from posttrain.rl.batch import RLBatch
from posttrain.rl.packing import pack_rl_batch


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
