"""Benchmark of multi-turn continuation cost: a 4-turn rollout against one single-turn generation of the same
sampled tokens.

Model: the Llama-shaped benchmark model of `bench_generate.py` (vocab 8192, hidden 256, 4 layers; its builder).
Multi-turn: 32 trajectories of 64-token prompts, 4 turns of TURN new tokens each (no stop token), a synthetic
`on_turn_end` appending a fixed TOOL-token "tool result" after each of the first 3 turns (answered at once).
Single turn: the same 32 prompts, 4 x TURN new tokens, no stop. Both sample the same number of tokens; the
multi-turn side also prefills the appended ids (against the slots' kept caches) and pays the turn boundaries.
Interleaved rounds, best of each; the ratio (multi / single; the issue's target is <= 1.3x) and the prefilled
positions of the multi-turn call are printed, and the ratio of process CPU time (best of each; less sensitive to
other processes on a shared machine).

Run: `python benchmarks/bench_agent_continuation.py [--repeats N] [--greedy]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_generate import PROMPT_LEN, VOCAB, best_times, build_checkpoint  # noqa: E402

TRAJ, TURNS, TURN, TOOL = 32, 4, 64, 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (best of)")
    ap.add_argument("--greedy", action="store_true", help="greedy decoding (default: temperature 1)")
    args = ap.parse_args(argv)

    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    temperature = 0.0 if args.greedy else 1.0
    tool = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, size=TOOL)]
    max_len = PROMPT_LEN + TURNS * TURN + (TURNS - 1) * TOOL
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = from_pretrained(build_checkpoint(Path(tmp) / "llama-bench"))
    prompts = np.random.default_rng(0).integers(3, VOCAB, size=(TRAJ, PROMPT_LEN)).tolist()
    sampler = Sampler(model, max_slots=TRAJ)
    multi_params = SamplingParams(max_new_tokens=TURN, temperature=temperature, stop_token_ids=[])
    single_params = SamplingParams(max_new_tokens=TURNS * TURN, temperature=temperature, stop_token_ids=[])
    stats, cpu = {}, {"multi": [], "single": []}  # process CPU seconds per call: less sensitive to other load

    def on_turn_end(t):
        return None if t.turn + 1 >= TURNS else tool

    def multi():
        c = time.process_time()
        out = sampler.generate(prompts, multi_params, on_turn_end=on_turn_end, max_len=max_len)
        cpu["multi"].append(time.process_time() - c)
        stats["multi"] = dict(sampler.last_stats)
        return out

    def single():
        c = time.process_time()
        out = sampler.generate(prompts, single_params, max_len=max_len)
        cpu["single"].append(time.process_time() - c)
        stats["single"] = dict(sampler.last_stats)
        return out

    best, res = best_times({"single": single, "multi": multi}, args.repeats)
    sampled = sum(sum(c.mask) for c in res["multi"])
    assert sampled == sum(len(c.token_ids) for c in res["single"]) == TRAJ * TURNS * TURN
    m, s = stats["multi"], stats["single"]
    ratio = best["multi"] / best["single"]
    print(f"model: bench_generate's Llama (vocab {VOCAB}, hidden 256, 4 layers), {TRAJ} trajectories, prompts of "
          f"{PROMPT_LEN}, {'greedy' if args.greedy else 'temperature 1'}, context limit {max_len}")
    print(f"single turn, {TURNS * TURN} new tokens: {best['single']:.3f} s ({sampled / best['single']:,.0f} tok/s); "
          f"{s['decode_segments']} decode segments, cache {s['cache_len']}")
    print(f"{TURNS} turns of {TURN} + {TURNS - 1} appends of {TOOL}: {best['multi']:.3f} s "
          f"({sampled / best['multi']:,.0f} sampled tok/s); {m['decode_segments']} decode segments, "
          f"{m.get('continuation_calls', 0)} extend calls, cache {m['cache_len']}")
    print(f"prefilled positions (multi-turn): prompts {m['prefill_tokens']}; continuation: appended ids "
          f"{m.get('continuation_tokens', 0)}, computed {m.get('continuation_positions', 0)} (appended + each "
          f"turn's last sampled token), padded {m.get('continuation_padded_positions', 0)}")
    print(f"ratio multi-turn / single-turn: {ratio:.2f}x (target <= 1.3x); process CPU time (best, warm-up excluded): "
          f"{min(cpu['multi'][1:]) / min(cpu['single'][1:]):.2f}x")
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
          f"best of {args.repeats} interleaved rounds after one warm-up each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
