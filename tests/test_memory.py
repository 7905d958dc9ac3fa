"""Remat policies really save memory: the compiled training step's temporary bytes (abstract shapes, nothing run)."""

from __future__ import annotations

import pytest

from posttrain.models.config import llama_like
from posttrain.training.memory import step_memory


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["generic", "cpu"])
def test_remat_policies_order_temporary_memory(kernels):
    def temp(remat):
        cfg = llama_like(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
                         num_kv_heads=2, remat=remat, kernels=kernels, max_position_embeddings=512)
        return step_memory(cfg, 2, 256, chunk_size=None)["temp"]

    none, full, dots_nb, dots = temp("none"), temp("full"), temp("dots_no_batch"), temp("dots")
    # full recomputes everything, dots_no_batch keeps the linear layers' outputs, dots also the attention products
    assert full < dots_nb < dots < none, dict(none=none, full=full, dots_no_batch=dots_nb, dots=dots)
    assert full < 0.5 * none
