"""Sharded training on 8 CPU devices (data=2, fsdp=2, tensor=2) follows the single-device loss curve, with
full fine-tuning and with LoRA adapters.

Runs in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8`, since the pytest process
may already have initialised JAX with one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from posttrain import distributed
    from posttrain.algorithms.sft import make_sft_loss
    from posttrain.models import lora
    from posttrain.models.config import llama_like
    from posttrain.models.transformer import init_model
    from posttrain.training.checkpoint import Checkpointer
    from posttrain.training.trainer import Trainer

    assert jax.device_count() == 8, jax.devices()
    cfg = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    rng = np.random.default_rng(0)
    B, T = 8, 24
    batches = []
    for _ in range(2):
        mask = (rng.random((B, T)) < 0.7).astype(np.float32)
        mask[:, 0] = 0
        batches.append({"input_ids": rng.integers(3, 64, size=(B, T)).astype(np.int32), "loss_mask": mask,
                        "attention_mask": np.ones((B, T), np.int32)})

    graphdef, state = nnx.split(init_model(cfg, seed=0))

    def run(mesh, use_lora, steps=6):
        model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
        if use_lora:
            lora.attach(model, rank=4, alpha=8.0, init="gaussian", target=r".*(q_proj|v_proj|up_proj|down_proj)")
        tr = Trainer(model, optax.adamw(3e-3), loss_fn=make_sft_loss(chunk_size=40), grad_accum=2, mesh=mesh)
        return tr, [tr.step(batches[i % 2])["loss"] for i in range(steps)]

    out = {}
    mesh = distributed.make_mesh(data=2, fsdp=2, tensor=2)
    _, single = run(None, False)
    tr, sharded = run(mesh, False)
    out["full"] = {"single": single, "sharded": sharded}
    # Parameters really are sharded by their logical axes, and so are the Adam moments.
    k = tr.params["layers"]["mlp"]["up_proj"]["kernel"][...]
    mu = tr.opt_state[0].mu["layers"]["mlp"]["up_proj"]["kernel"][...]
    out["spec"] = [str(k.sharding.spec), str(mu.sharding.spec)]
    # LoRA on the mesh: adapters (and their moments) placed by their logical axes, base weights frozen.
    _, lora_single = run(None, True)
    tl, lora_sharded = run(mesh, True)
    out["lora"] = {"single": lora_single, "sharded": lora_sharded}
    up = tl.params["layers"]["mlp"]["up_proj"]
    out["lora_spec"] = [str(up["lora_a"][...].sharding.spec), str(up["lora_b"][...].sharding.spec),
                        str(tl.opt_state[0].mu["layers"]["mlp"]["up_proj"]["lora_a"][...].sharding.spec)]
    out["lora_base_kernel_spec"] = str(tl.rest["layers"]["mlp"]["up_proj"]["kernel"][...].sharding.spec)
    out["lora_b_moved"] = float(np.abs(np.asarray(up["lora_b"][...])).max())
    flat = lambda t: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}  # noqa: E731
    before, after = flat(state), flat(tl.rest)
    out["base_compared"] = len(after.keys() & before.keys())
    out["base_max_change"] = max(float(np.abs(np.asarray(after[n]) - np.asarray(before[n])).max())
                                 for n in after.keys() & before.keys())
    # A checkpoint written on the mesh restores onto it and continues the same way.
    ck = Checkpointer(sys.argv[1], keep=1, async_save=False)
    ck.save(tr)
    ref = [tr.step(b)["loss"] for b in batches[:2]]
    tr2, _ = run(mesh, False, steps=1)
    ck.restore(tr2)
    out["resume"] = {"ref": ref, "got": [tr2.step(b)["loss"] for b in batches[:2]]}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_sharded_loss_curve_matches_single_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # The restored trainer's step is the same program: compile it once.
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT"):])
    for kind in ("full", "lora"):
        single, sharded = out[kind]["single"], out[kind]["sharded"]
        print(f"\n{kind}: single {[round(x, 6) for x in single]}\n{kind}: sharded {[round(x, 6) for x in sharded]}")
        assert single[-1] < single[0]
        assert max(abs(a - b) for a, b in zip(single, sharded)) < 1e-5
    assert out["spec"] == ["P(None, 'fsdp', 'tensor')"] * 2
    # lora_a [layers, embed, rank] -> (None, fsdp, None); lora_b [layers, rank, mlp] -> (None, None, tensor)
    assert out["lora_spec"] == ["P(None, 'fsdp', None)", "P(None, None, 'tensor')", "P(None, 'fsdp', None)"]
    assert out["lora_base_kernel_spec"] == "P(None, 'fsdp', 'tensor')"
    assert out["lora_b_moved"] > 1e-4 and out["base_compared"] >= 9 and out["base_max_change"] == 0.0
    assert max(abs(a - b) for a, b in zip(out["resume"]["ref"], out["resume"]["got"])) < 1e-6
