"""The sampler on a 4-device (fsdp=2, tensor=2) mesh of forced CPU devices, in a subprocess: same greedy and
sampled output as on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import xla_flags

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    from posttrain import distributed
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    path = sys.argv[1]
    assert len(jax.devices()) == 4
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, size=n).tolist() for n in (5, 9, 3, 12, 7)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    ref = Sampler(from_pretrained(path), max_slots=4).generate(prompts, params)
    long_params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[])
    long_ref = Sampler(from_pretrained(path), max_slots=4, cache_step=0).generate(prompts, long_params)
    # sample keys depend only on (seed, prompt, sample): one device with all 5 prompts in 8 slots is the reference
    sample_params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, n=2)
    sampled_ref = Sampler(from_pretrained(path), max_slots=8).generate(prompts, sample_params)
    out = {}
    for name, sizes in {"fsdp_tensor": dict(data=1, fsdp=2, tensor=2)}.items():
        mesh = distributed.make_mesh(**sizes)
        model = from_pretrained(path, mesh=mesh)
        weights_before = model.layers.mlp.up_proj.kernel[...]
        sampler = Sampler(model, max_slots=3)  # rounded up to a multiple of data x fsdp
        got = sampler.generate(prompts, params)
        sampled = sampler.generate(prompts, sample_params)
        grown = Sampler(model, max_slots=3, cache_step=8)  # the cache grows 24 -> 32 positions on the mesh
        long_got = grown.generate(prompts, long_params)
        out[name] = dict(
            same=[a.token_ids for a in got] == [b.token_ids for b in ref],
            logprob_diff=max(float(np.abs(np.subtract(a.logprobs, b.logprobs)).max()) for a, b in zip(got, ref)),
            slots=sampler.last_stats["slots"],
            cache_spec=str(sampler._state.cache.k[0].sharding.spec),
            weights_sharding=str(model.layers.mlp.up_proj.kernel[...].sharding.spec),
            weights_same_object=model.layers.mlp.up_proj.kernel[...] is weights_before,
            sampled_same=[a.token_ids for a in sampled] == [b.token_ids for b in sampled_ref],
            sampled_index=[(a.prompt_index, a.sample_index) for a in sampled],
            sampled_distinct=len({tuple(a.token_ids) for a in sampled}),
            sampled_logprob_diff=max(float(np.abs(np.subtract(a.logprobs, b.logprobs)).max())
                                     for a, b in zip(sampled, sampled_ref)),
            grown_same=[a.token_ids for a in long_got] == [b.token_ids for b in long_ref],
            grown_resizes=grown.last_stats.get("cache_resizes", 0),
            grown_cache_spec=str(grown._state.cache.k[0].sharding.spec),
        )
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_generate_on_a_mesh(hf_checkpoint, tmp_path):
    path = hf_checkpoint("llama")
    script = tmp_path / "mesh_run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    res = json.loads(line[len("RESULT"):])
    r = res["fsdp_tensor"]
    assert r["same"], res
    assert r["logprob_diff"] < 1e-4
    assert r["slots"] == 4  # max_slots=3 rounded up to a multiple of data x fsdp = 2
    assert "fsdp" in r["cache_spec"] and "tensor" in r["cache_spec"]  # slots over fsdp, kv heads over tensor
    assert "tensor" in r["weights_sharding"]  # weights keep the training layout...
    assert r["weights_same_object"]  # ...and are not copied or moved
    # sampled completions (4 slots on the mesh, refilled) are token for token the single-device ones
    assert r["sampled_index"] == [[p, i] for p in range(5) for i in range(2)]
    assert r["sampled_same"] and r["sampled_distinct"] > 5 and r["sampled_logprob_diff"] < 1e-4, res
    assert r["grown_same"] and r["grown_resizes"] >= 1, res  # a growing cache keeps its sharding and results
    assert r["grown_cache_spec"] == r["cache_spec"]
