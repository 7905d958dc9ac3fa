"""Expert compute of a mixture-of-experts layer on this machine: grouped (`jax.lax.ragged_dot`, the accelerator
kernel set's) against dense (every token through every expert, the CPU set's); `posttrain.models.expert_kernels`.

    python benchmarks/bench_moe_experts.py

Prints, per shape (N tokens, D hidden, F expert width, E experts, top-k), the best of 5 jitted calls of the
forward and of forward + backward (gradients of x and of the three expert weights), float32, and the largest
difference between the two outputs.
"""

from __future__ import annotations

import time

import jax

from posttrain.models import expert_kernels
from posttrain.models.moe import route

SHAPES = [  # N, D, F, E, k
    (2304, 64, 96, 4, 2),  # tiny:qwen3_moe, the GRPO benchmark's update batch (8 rows x 288)
    (2048, 128, 128, 8, 2),
    (2048, 256, 256, 16, 2),
    (1024, 256, 128, 64, 8),  # Qwen3-30B-A3B's expert count and top-k, narrow
]


def _best(fn, args, reps=5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def bench(n, d, f, e, k) -> None:
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (n, d))
    ws = [jax.random.normal(kk, s) / s[1] ** 0.5 for kk, s in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])]
    top_w, top_idx = route(jax.random.normal(keys[4], (n, e)), k, True)
    args = (x, *ws, top_idx, top_w)
    line, outs = [], {}
    for name, impl in expert_kernels.IMPLEMENTATIONS.items():
        fwd = jax.jit(impl)
        grad = jax.jit(jax.grad(lambda *a, impl=impl: impl(*a).sum(), argnums=(0, 1, 2, 3)))
        line.append(f"{name} {_best(fwd, args):.1f} / {_best(grad, args):.1f} ms")
        outs[name] = fwd(*args)
    diff = float(abs(outs["grouped"] - outs["dense"]).max())
    print(f"N={n} D={d} F={f} E={e} k={k}: fwd / fwd+bwd: {', '.join(line)}; max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for shape in SHAPES:
        bench(*shape)
