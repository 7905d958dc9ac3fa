"""A mixture-of-experts model loaded onto an FSDP x tensor mesh of 8 CPU devices gives the unsharded logits, with its
expert weights read shard by shard (embed over fsdp, expert width over tensor; the expert axis is not split yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import xla_flags

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from posttrain import distributed
    from posttrain.models import from_pretrained

    path = sys.argv[1]
    mesh = distributed.make_mesh(data=1, fsdp=4, tensor=2)
    ids = np.random.default_rng(0).integers(3, 96, size=(4, 12))
    mask = np.ones_like(ids); mask[1, :5] = 0
    ref = from_pretrained(path)
    want = np.asarray(ref(ids, attention_mask=mask))
    for kernels in ("cpu", "generic"):
        model = from_pretrained(path, mesh=mesh, kernels=kernels)
        ids_s = jax.device_put(ids, distributed.batch_sharding(mesh))
        out = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids_s, mask))
        up = model.layers.moe.experts.up_proj[...]
        same = bool(np.array_equal(np.asarray(up), np.asarray(ref.layers.moe.experts.up_proj[...])))
        print(json.dumps({"kernels": kernels, "diff": float(np.abs(out - want).max()), "same_weights": same,
                          "up_spec": [str(s) for s in up.sharding.spec], "up_shard": list(up.addressable_shards[0].data.shape),
                          "up_shape": list(up.shape)}))
    """
)


@pytest.mark.full_optimization
def test_fsdp_tensor_mesh_matches_unsharded(tmp_path):
    from test_moe_parity import build_hf

    build_hf("qwen2_moe").save_pretrained(tmp_path / "ckpt")
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        assert r["diff"] <= 1e-5 and r["same_weights"], r
        # experts [layers, expert, embed, mlp]: embed over fsdp (4), mlp over tensor (2)
        assert r["up_spec"] == ["None", "None", "fsdp", "tensor"], r
        l, e, d, f = r["up_shape"]
        assert r["up_shard"] == [l, e, d // 4, f // 2], r
