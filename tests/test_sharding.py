"""A model loaded onto an FSDP x tensor mesh of 8 CPU devices gives the unsharded logits, and really is sharded."""

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
    assert len(jax.devices()) == 8, jax.devices()
    mesh = distributed.make_mesh(data=1, fsdp=4, tensor=2)
    ids = np.random.default_rng(0).integers(3, 96, size=(4, 12))
    mask = np.ones_like(ids); mask[1, :5] = 0
    ref = np.asarray(from_pretrained(path)(ids, attention_mask=mask))
    for scan in (True, False):
        model = from_pretrained(path, mesh=mesh, scan_layers=scan)
        ids_s = jax.device_put(ids, distributed.batch_sharding(mesh))
        out = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids_s, mask))
        diff = float(np.abs(out - ref).max())
        q = model.layers.self_attn.q_proj.kernel[...]
        up = model.layers.mlp.up_proj.kernel[...]
        emb = model.embed_tokens.embedding[...]
        print(json.dumps({
            "scan": scan, "diff": diff,
            "q_spec": list(q.sharding.spec), "q_shard": list(q.addressable_shards[0].data.shape), "q_shape": list(q.shape),
            "up_spec": list(up.sharding.spec), "up_shard": list(up.addressable_shards[0].data.shape),
            "emb_spec": list(emb.sharding.spec), "emb_shard": list(emb.addressable_shards[0].data.shape),
        }))
    """
)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.slow
def test_fsdp_tensor_mesh_matches_unsharded(family, hf_checkpoint):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(hf_checkpoint(family))], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        assert r["diff"] <= 1e-5, r
        # q kernel [layers, embed, heads, head_dim]: embed over fsdp (4), heads over tensor (2)
        assert r["q_spec"] == [None, "fsdp", "tensor", None], r
        assert r["q_shard"] == [r["q_shape"][0], r["q_shape"][1] // 4, r["q_shape"][2] // 2, r["q_shape"][3]]
        assert r["up_spec"] == [None, "fsdp", "tensor"], r
        assert r["emb_spec"] == ["tensor", "fsdp"], r
        assert r["emb_shard"] == [96 // 2, 64 // 4]
