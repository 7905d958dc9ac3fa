"""Benchmark: decode tokens/s against the decode block size k (`Sampler(segment_steps=k)`: decode steps per dispatch
in one on-device `while_loop`, back on the host every k tokens or when a slot finishes).

Models (random weights, float32, this backend's kernel set): `tiny` (tiny:llama's shape: hidden 64, 2 layers,
vocab 512) and `0.1b` (Llama-shaped, hidden 768, intermediate 2048, 12 layers, 12 heads / 4 KV heads, vocab 16384:
~0.1 B parameters). Work: 16 prompts x 64 random ids, 128 new tokens each, greedy, no stop token, 16 slots. For
each model every k gets a warm-up call (its compile), then `--rounds` interleaved rounds time one call of each k
(the order rotates each round); the figure is generated tokens / median seconds per call. The default block per
backend (`posttrain.sampling.engine.DECODE_BLOCK`) is chosen from these figures.

    python benchmarks/bench_decode_blocks.py [--blocks 1 8 32 128] [--models tiny 0.1b] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

MODELS = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2},
    "0.1b": {"vocab_size": 16384, "hidden_size": 768, "intermediate_size": 2048, "num_layers": 12, "num_heads": 12,
             "num_kv_heads": 4},
}
PROMPTS, PROMPT_LEN, NEW, SLOTS = 16, 64, 128, 16


def build(name: str):
    from posttrain.models import init_model
    from posttrain.models.config import llama_like

    return init_model(llama_like(max_position_embeddings=512, **MODELS[name]), seed=0)


def n_params(model) -> int:
    from flax import nnx

    return sum(int(np.prod(x.shape)) for x in nnx.to_flat_state(nnx.state(model, nnx.Param)).leaves)


def measure(model, blocks: list[int], rounds: int) -> dict[int, list[float]]:
    """Seconds per generate call for each block size (warm-up excluded), rounds interleaved."""
    from posttrain.sampling import ProgramCache, Sampler, SamplingParams

    rng = np.random.default_rng(0)
    prompts = rng.integers(3, model.cfg.vocab_size, size=(PROMPTS, PROMPT_LEN)).tolist()
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    cache = ProgramCache()
    samplers = {k: Sampler(model, max_slots=SLOTS, segment_steps=k, program_cache=cache) for k in blocks}
    ref = None
    for k, s in samplers.items():  # warm-up (compiles); every k gives the same tokens
        tokens = [c.token_ids for c in s.generate(prompts, params)]
        assert ref is None or tokens == ref, f"segment_steps={k} changed the tokens"
        ref = tokens
    times: dict[int, list[float]] = {k: [] for k in blocks}
    for r in range(rounds):
        order = blocks[r % len(blocks):] + blocks[: r % len(blocks)]
        for k in order:
            t = time.perf_counter()
            samplers[k].generate(prompts, params)
            times[k].append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    import jax

    from posttrain.models import kernels

    out = {"backend": jax.default_backend(), "kernels": kernels.resolve("auto"), "models": {}}
    for name in args.models:
        model = build(name)
        times = measure(model, args.blocks, args.rounds)
        tps = {k: PROMPTS * NEW / statistics.median(v) for k, v in times.items()}
        out["models"][name] = {"params": n_params(model), "tokens_per_s": tps, "seconds": times}
        print(f"{name} ({n_params(model) / 1e6:.1f} M parameters, {out['backend']}, kernels {out['kernels']}): "
              + ", ".join(f"k={k}: {v:,.0f} tok/s" for k, v in tps.items())
              + f"  (k=1 = 1.00x; best {max(tps, key=tps.get)}: {max(tps.values()) / tps[args.blocks[0]]:.2f}x)",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
