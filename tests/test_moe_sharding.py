"""A mixture-of-experts model on meshes of 8 CPU devices gives the unsharded results: on an FSDP x tensor mesh
(expert weights read shard by shard, embed over fsdp, expert width over tensor), and with expert parallelism (the
`expert` axis, with data and fsdp: logits and gradients to 1e-5, the expert weights split by expert)."""

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
@pytest.mark.slow
def test_fsdp_tensor_mesh_matches_unsharded(tmp_path):
    from test_moe_parity import build_hf

    build_hf("qwen2_moe").save_pretrained(tmp_path / "ckpt")
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        assert r["diff"] <= 1e-5 and r["same_weights"], r
        # experts [layers, expert, embed, mlp]: embed over fsdp (4), mlp over tensor (2)
        assert r["up_spec"] == ["None", "None", "fsdp", "tensor"], r
        l, e, d, f = r["up_shape"]
        assert r["up_shard"] == [l, e, d // 4, f // 2], r


EP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from posttrain import distributed
    from posttrain.models import expert_parallel, from_pretrained

    calls = []
    run_ep = expert_parallel.experts
    expert_parallel.experts = lambda *a, **k: calls.append(1) or run_ep(*a, **k)
    path = sys.argv[1]
    ids = np.random.default_rng(0).integers(3, 96, size=(8, 12))
    mask = np.ones_like(ids); mask[1, :5] = 0; mask[6, :3] = 0

    def loss(m, i, a):
        lp = jax.nn.log_softmax(m(i, attention_mask=a)[:, :-1], -1)
        return -(jnp.take_along_axis(lp, i[:, 1:, None], -1)[..., 0] * a[:, 1:]).sum() / a[:, 1:].sum()

    def run(model, mesh=None):
        i, a = ids, mask
        if mesh is not None:
            i, a = (jax.device_put(x, distributed.batch_sharding(mesh)) for x in (ids, mask))
        out, g = nnx.jit(lambda m, i, a: (m(i, attention_mask=a), nnx.grad(loss)(m, i, a)))(model, i, a)
        return np.asarray(out), {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(g)}

    reference = {}
    for kernels, sizes in (("cpu", dict(data=2, expert=4)), ("cpu", dict(data=2, fsdp=2, expert=2)),
                           ("generic", dict(data=2, expert=4))):
        if kernels not in reference:
            reference[kernels] = run(from_pretrained(path, kernels=kernels))
        want, gwant = reference[kernels]
        mesh = distributed.make_mesh(**{"fsdp": 1, **sizes})
        model = from_pretrained(path, mesh=mesh, kernels=kernels)
        calls.clear()
        out, g = run(model, mesh)
        up = model.layers.moe.experts.up_proj[...]
        print(json.dumps({"kernels": kernels, "sizes": sizes, "ep_calls": len(calls),
                          "diff": float(np.abs(out - want)[mask.astype(bool)].max()),
                          "grad_diff": max(float(np.abs(g[k] - gwant[k]).max()) for k in gwant),
                          "grad_max": max(float(np.abs(gwant[k]).max()) for k in gwant),
                          "router_grad": float(np.abs(g["layers/moe/gate/kernel"]).max()),
                          "up_spec": [str(s) for s in up.sharding.spec], "up_shard": list(up.addressable_shards[0].data.shape),
                          "up_shape": list(up.shape)}), flush=True)
    # 2 rows on data=2 x expert=4: the batch is not split over `expert` (each device of it holds the rows): no gather
    mesh = distributed.make_mesh(data=2, fsdp=1, expert=4)
    small = nnx.jit(lambda m, i, a: m(i, attention_mask=a))(from_pretrained(path, mesh=mesh), ids[:2], mask[:2])
    want = from_pretrained(path)(ids[:2], attention_mask=mask[:2])
    print(json.dumps({"unsplit_rows_diff": float(np.abs(np.asarray(small) - np.asarray(want))[mask[:2] > 0].max()),
                      "batch_spec": str(distributed.logical_to_spec(("batch",), (2,), mesh))}))
    """
)


@pytest.mark.slow  # ~1-2 min: six programs compiled over 8 devices
@pytest.mark.full_optimization
def test_expert_parallel_mesh_matches_unsharded(tmp_path):
    """Qwen3-MoE with a dense first layer on data=2 x expert=4 and data=2 x fsdp=2 x expert=2 (both kernel sets):
    the expert-parallel path runs (`posttrain.models.expert_parallel`), logits and every gradient equal the one-device
    run to 1e-5, and the expert weights [layers, experts, embed, mlp] hold E / expert experts per device."""
    from test_moe_parity import build_hf

    build_hf("qwen3_moe").save_pretrained(tmp_path / "ckpt")
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", EP_SCRIPT, str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    assert rows[-1]["unsplit_rows_diff"] <= 1e-5 and rows[-1]["batch_spec"] == "P('data',)", rows[-1]
    for r in rows[:-1]:
        assert r["ep_calls"] > 0 and r["diff"] <= 1e-5 and r["grad_diff"] <= 1e-5, r
        assert r["grad_max"] > 1e-2 and r["router_grad"] > 1e-4, r  # gradients that mean something
        l, e, d, f = r["up_shape"]
        ep, fsdp = r["sizes"]["expert"], r["sizes"].get("fsdp", 1)
        assert r["up_spec"] == ["None", "expert"] + (["fsdp"] if fsdp > 1 else []), r
        assert r["up_shard"] == [l, e // ep, d // fsdp, f], r
