"""Compiled memory of one SFT training step per remat policy, from abstract shapes (nothing is allocated or run).

A Llama-3.2-1B-shaped model in bfloat16 (parameters and compute), one [batch, seq] batch, the chunked
loss, AdamW with parameters and optimizer state donated; for each `remat` policy, XLA's
`memory_analysis()` of the compiled step on the backend JAX sees (`posttrain.training.memory.step_memory`).
Temporary bytes are what remat trades for recomputation.

    python benchmarks/bench_memory.py [--seq 2048] [--batch 1] [--kernels generic cpu] [--remat none full ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=1024, help="loss chunk (tokens per vocabulary projection)")
    ap.add_argument("--kernels", nargs="+", default=["generic"], choices=["generic", "cpu"])
    ap.add_argument("--remat", nargs="+", default=["none", "full", "dots_no_batch", "dots"])
    args = ap.parse_args(argv)

    import jax

    from posttrain.training.memory import llama_1b, step_memory

    print(f"backend {jax.default_backend()}; Llama-1B shape, bfloat16, batch {args.batch} x seq {args.seq}, "
          f"loss chunk {args.chunk}")
    print(f"{'kernels':8} {'remat':14} {'temp bytes':>15} {'temp GiB':>9} {'args GiB':>9} {'compile s':>9}")
    for k in args.kernels:
        for r in args.remat:
            t = time.perf_counter()
            m = step_memory(llama_1b(remat=r, kernels=k), args.batch, args.seq, chunk_size=args.chunk)
            print(f"{k:8} {r:14} {m['temp']:>15,} {m['temp'] / 2**30:>9.2f} {m['argument'] / 2**30:>9.2f} "
                  f"{time.perf_counter() - t:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
