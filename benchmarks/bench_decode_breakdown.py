"""Where a CPU decode step's time goes: ablations of our compiled decode in one process, and the machine's read
bandwidth, beside the bytes a step must read.

Workload: the generation comparison's (`bench_peers.py`, `bench_first_call.py`): `bench_generate.py`'s Llama-shaped
float32 checkpoint (vocab 8192, hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads), 16 prompts of 64
ids, 128 new tokens each, greedy, `Sampler(model, max_slots=16, max_len=192)`.

Variants, each compiled once and then timed in interleaved rounds in this one process (so the machine's drift
hits all of them alike; a variant's programs are swapped into the engine's program cache before its call):
  * full: `Sampler.generate` as shipped.
  * prefill only: the same call with max_new_tokens=1 (prefill, the first token, host work).
  * no attention: the cpu kernel set's cached attention replaced, in this process only, by the identity on the
    queries; the decode step still writes every layer's K and V into the cache, but never reads the cache.
  * cache read only: as "no attention", plus one read of every layer's whole K and V cache (their sums).
  * matmuls only: the step's products alone on [16, d] rows (q, k, v, o, gate, up, down per layer, the LM head),
    in a `fori_loop` of 127 steps, on weights of the model's shapes; no attention, norms or sampling.
Per decode step: (call - prefill-only call) / 127 for the variants of `generate`, the loop's time / 127 for
"matmuls only". The ablated variants' tokens differ (their outputs are wrong on purpose); their step count
does not (no stop token).

Bandwidth: a jitted sum over a float32 array of 8 .. 256 MB, repeated in a `fori_loop` (the best of 5); and the
bytes a decode step must read: the weights it multiplies (the LM head and every layer's; the embedding table is
read one row a token) and the KV cache rows over which attention runs (the whole 192-position row of the 16
slots; 2/3 of it live on average over this call).

Profile (`--profile`): one call of the shipped decode under JAX's profiler, with XLA:CPU's per-operation trace
events on (`--xla_cpu_enable_xprof_traceme`); each event's operation is classed by the optimized program's
metadata: the weight products (the LM head apart), attention's two products over the cache, the rest. Per class:
ms a decode step (events' durations summed over both threads, so two operations running at once both count), and
the weight products' rate in GFLOP/s (2 x slots x their weights' parameters a step); beside them the summed
durations over the call's wall time (1.0: one core busy at a time) and a jitted 2048^3 float32 matmul's rate.

Run: `python benchmarks/bench_decode_breakdown.py [--rounds 8] [--profile]` (about 2 minutes; the checkpoint is
written with transformers and torch, so it needs the test extra like the other benchmarks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

PROMPTS, PROMPT_LEN, NEW, MAX_LEN, VOCAB = 16, 64, 128, 192, 8192


def read_bandwidth(mbs=(8, 16, 24, 32, 64, 256), reps: int = 20) -> dict[int, float]:
    """GB/s of a jitted float32 sum over an array of each size (best of 5 loops of `reps` sums)."""
    import jax
    import jax.numpy as jnp

    out = {}
    for mb in mbs:
        a = jnp.ones((mb * 2**20 // 4,), jnp.float32)
        f = jax.jit(lambda a: jax.lax.fori_loop(0, reps, lambda i, c: c + jnp.sum(a * c), jnp.float32(1)))
        f(a).block_until_ready()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = min(best, time.perf_counter() - t)
        out[mb] = mb * 2**20 * reps / best / 1e9
    return out


def matmul_loop(cfg, steps: int):
    """A jitted loop of the decode step's products alone on [16, d] rows, and its argument."""
    import jax
    import jax.numpy as jnp

    d, f, v, h = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    qd, kd = cfg.num_heads * h, cfg.num_kv_heads * h
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    layers = [dict(q=w(d, qd), k=w(d, kd), v=w(d, kd), o=w(qd, d), g=w(d, f), u=w(d, f), dn=w(f, d))
              for _ in range(cfg.num_layers)]
    head = w(d, v)

    def step(_, x):
        for p in layers:
            a = x @ p["q"] + jnp.sum(x @ p["k"]) * 0 + jnp.sum(x @ p["v"]) * 0
            x = x + a @ p["o"]
            x = x + (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["dn"]
        return x + 1e-3 * jnp.max(x @ head, axis=-1, keepdims=True)  # every logit used: no product is cut

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x))
    return loop, jnp.asarray(rng.normal(size=(PROMPTS, d)), jnp.float32)


def attention_variants():
    """{name: replacement for CpuKernels.attend_cached (None = as shipped)}."""
    import jax.numpy as jnp

    from posttrain.models import kernels

    shipped = kernels.CpuKernels.attend_cached

    def no_attention(self, q, k_c, v_c, mask, cfg):
        if q.shape[1] != 1:
            return shipped(self, q, k_c, v_c, mask, cfg)
        return q * 1.0001

    def cache_read_only(self, q, k_c, v_c, mask, cfg):
        if q.shape[1] != 1:
            return shipped(self, q, k_c, v_c, mask, cfg)
        return q * 1.0001 + 1e-9 * (jnp.sum(k_c) + jnp.sum(v_c))

    return {"full": None, "no attention": no_attention, "cache read only": cache_read_only}


def measure(path: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds a call per variant, interleaved over `rounds` (the order reversed every other round)."""
    import bench_first_call

    from posttrain.models import from_pretrained, kernels
    from posttrain.sampling import ProgramCache, Sampler, SamplingParams

    model = from_pretrained(path)
    sampler = Sampler(model, max_slots=PROMPTS, max_len=MAX_LEN)
    prompts = bench_first_call.prompts_of()
    full = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    one = SamplingParams(max_new_tokens=1, temperature=0.0, stop_token_ids=[])
    shipped = kernels.CpuKernels.attend_cached
    calls, programs = {}, {}
    for name, attend in attention_variants().items():
        kernels.CpuKernels.attend_cached = attend or shipped
        sampler.program_cache = programs[name] = ProgramCache()  # this variant's own programs
        try:
            sampler.generate(prompts, full)
            if name == "full":
                sampler.generate(prompts, one)
        finally:
            kernels.CpuKernels.attend_cached = shipped
        calls[name] = full
    calls["prefill only"], programs["prefill only"] = one, programs["full"]
    loop, x = matmul_loop(model.cfg, NEW - 1)
    loop(x).block_until_ready()
    times: dict[str, list[float]] = {n: [] for n in [*calls, "matmuls only"]}
    for r in range(rounds):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            t = time.perf_counter()
            if name == "matmuls only":
                loop(x).block_until_ready()
            else:
                sampler.program_cache = programs[name]
                sampler.generate(prompts, calls[name])
            times[name].append(time.perf_counter() - t)
    return times


def step_bytes(cfg) -> dict[str, float]:
    """MB a decode step reads: weights multiplied, and the KV cache rows attended over (whole; live mean)."""
    weights = (cfg.num_layers * cfg.layer_matmul_params() + cfg.hidden_size * cfg.vocab_size) * 4
    cache = 2 * cfg.num_layers * PROMPTS * cfg.num_kv_heads * cfg.head_dim * MAX_LEN * 4
    live = cache * (PROMPT_LEN + NEW / 2) / MAX_LEN
    return {"weights": weights / 1e6, "cache": cache / 1e6, "cache_live": live / 1e6}


def report(times: dict[str, list[float]], bw: dict[int, float], mb: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    pre = min(times["prefill only"])
    t = Table(title=f"Decode step breakdown: {PROMPTS} x {PROMPT_LEN} prompt ids, {NEW} new, greedy, float32, "
                    f"cache {MAX_LEN} positions; seconds a call (min / median of {len(times['full'])} interleaved "
                    "rounds)")
    for col in ("variant", "min s", "median s", "ms / decode step (min)", "vs full"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    full_step = (min(times["full"]) - pre) / (NEW - 1)
    for name, ts in times.items():
        step = min(ts) / (NEW - 1) if name == "matmuls only" else (min(ts) - pre) / (NEW - 1)
        share = "" if name == "prefill only" else f"{step / full_step:.0%}"
        t.add_row(name, f"{min(ts):.3f}", f"{sorted(ts)[len(ts) // 2]:.3f}",
                  "" if name == "prefill only" else f"{step * 1e3:.2f}", share)
    console.print(t)
    dram = bw[max(bw)]
    console.print("read bandwidth (jitted sum; GB/s): " + ", ".join(f"{k} MB {v:.1f}" for k, v in bw.items()))
    floor_full = (mb["weights"] + mb["cache"]) / 1e3 / dram
    floor_live = (mb["weights"] + mb["cache_live"]) / 1e3 / dram
    console.print(f"a decode step reads {mb['weights']:.1f} MB of weights and {mb['cache']:.1f} MB of KV cache "
                  f"({mb['cache_live']:.1f} MB live on average): {mb['weights'] + mb['cache']:.1f} MB, more than "
                  f"the caches hold, so at the {max(bw)} MB rate ({dram:.1f} GB/s) the floor is "
                  f"{floor_full * 1e3:.2f} ms a step ({floor_live * 1e3:.2f} ms reading only live positions); "
                  f"measured {full_step * 1e3:.2f} ms.")


def profile_classes(path: Path, dump: Path, trace: Path) -> tuple[dict[str, float], float, float]:
    """({class: summed event seconds}, the profiled call's wall seconds, summed seconds of every event) of one
    shipped `generate` call after a warm one (see "Profile")."""
    import re

    import jax

    import bench_first_call
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    sampler = Sampler(from_pretrained(path), max_slots=PROMPTS, max_len=MAX_LEN)
    prompts = bench_first_call.prompts_of()
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    sampler.generate(prompts, params)
    jax.profiler.start_trace(str(trace))
    t = time.perf_counter()
    sampler.generate(prompts, params)
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(str(next(trace.rglob("*.xplane.pb"))))
    events = [ev for plane in data.planes for ln in plane.lines if "Eigen" in ln.name for ev in ln.events]
    program = next(dict(ev.stats)["program_id"] for ev in events if dict(ev.stats).get("hlo_module") == "jit__decode")
    hlo = next(dump.glob(f"module_{program:04d}.jit__decode.cpu_after_optimizations.txt")).read_text()
    ops = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\s+%([\w.\-]+) = (\S+) .*?op_name=\"([^\"]+)\"", hlo, re.M)}
    sums: dict[str, float] = {}
    every = 0.0
    for ev in events:
        stats = dict(ev.stats)
        if stats.get("program_id") != program or ev.name not in ops:  # executor, pool, python; other programs
            continue
        shape, op = ops[ev.name]
        every += ev.duration_ns / 1e9
        if "bkgh,bkhs" in op or "bkgs,bksh" in op:
            name = "attention's products over the cache"
        elif op.endswith("dot_general"):
            name = "LM head" if shape.startswith(f"f32[{PROMPTS},{VOCAB}]") else "layers' weight products"
        else:
            name = "the rest (norms, RoPE, softmax, cache writes, sampling)"
        sums[name] = sums.get(name, 0.0) + ev.duration_ns / 1e9
    return sums, wall, every


def report_profile(sums: dict[str, float], wall: float, every: float, cfg) -> None:
    import jax
    import jax.numpy as jnp
    from rich.console import Console
    from rich.table import Table

    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    best = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    peak = 2 * 2048**3 / best / 1e9
    steps = NEW - 1
    flops = {"layers' weight products": 2 * PROMPTS * cfg.num_layers * cfg.layer_matmul_params(),
             "LM head": 2 * PROMPTS * cfg.hidden_size * cfg.vocab_size}
    t = Table(title=f"One profiled call ({wall:.3f} s; {every / wall:.2f} x its wall time in operations, summed over "
                    "threads): ms a decode step by class of operation")
    for col in ("class", "ms / step", "share", "GFLOP/s"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for name, s in sorted(sums.items(), key=lambda kv: -kv[1]):
        rate = f"{flops[name] / (s / steps) / 1e9:.0f}" if name in flops else ""
        t.add_row(name, f"{s / steps * 1e3:.2f}", f"{s / every:.0%}", rate)
    console = Console(width=150)
    console.print(t)
    console.print(f"a jitted 2048^3 float32 matmul: {peak:.0f} GFLOP/s (both cores)")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="also one profiled call, classed by operation")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:  # read when XLA's CPU backend starts, i.e. at the first computation below
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
                                       f" --xla_dump_to={tmp}/dump --xla_dump_hlo_as_text"
                                       " --xla_dump_hlo_module_re=.*_decode.*")
        from bench_generate import build_checkpoint
        from posttrain.models import from_pretrained

        path = build_checkpoint(Path(tmp) / "llama-generate")
        cfg = from_pretrained(path).cfg
        times = measure(path, args.rounds)
        mb = step_bytes(cfg)
        profiled = profile_classes(path, Path(tmp) / "dump", Path(tmp) / "trace") if args.profile else None
    report(times, read_bandwidth(), mb)
    if profiled:
        report_profile(*profiled, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
