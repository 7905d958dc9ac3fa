"""Benchmark of `posttrain.sampling`: tokens/s against `transformers` generate; continuous vs static batching.

Case 1: a Llama-shaped model (vocab 8192, hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads) with
random weights built by transformers/torch, saved, and loaded into ours (same weights); 16 prompts of 64
tokens, 128 new tokens each, no stop token. Ours vs `transformers` `generate` (torch, CPU, greedy, batch 16),
warm-up runs excluded for both.

Case 2: 64 prompts through 16 slots, with stop tokens picked (from the greedy completions) so that about
half of the sequences end early (then, second row, three quarters): continuous batching (one call) vs
static batches of 16 (4 calls, each running until its longest sequence ends).

First call: the seconds of our first `generate` call in this process (compiles included) are printed beside
the steady state; `--first-call` also measures it in fresh processes with an empty persistent compilation
cache (cold) and again with the cache that run filled (warm), as a second run of the CLI would start.

Run: `python benchmarks/bench_generate.py [--repeats N] [--profile] [--first-call]`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

VOCAB, PROMPT_LEN, NEW = 8192, 64, 128


def build_checkpoint(out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # weights of unit-scale activations, so greedy sequences are not degenerate
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


def hf_runner(path: Path, prompts: np.ndarray, new: int, threads: int):
    """A function running `transformers` greedy generate on the batch with `threads` torch threads; returns
    the new tokens [B, new]. (On a shared machine torch's spinning worker threads can slow it down tenfold,
    so the benchmark times 1 thread and all cores and keeps transformers' best.)"""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run():
        torch.set_num_threads(threads)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, eos_token_id=None, pad_token_id=0)
        return out[:, prompts.shape[1]:].numpy()

    return run


def ours_runner(sampler, prompts, params, batches: int = 1):
    """A function generating `prompts` in `batches` consecutive generate calls; returns the completions."""
    chunks = np.array_split(np.arange(len(prompts)), batches)

    def run():
        out = []
        for c in chunks:
            out += sampler.generate([prompts[i] for i in c], params)
        return out

    return run


FIRST_CALL: dict[str, float] = {}


def best_times(runners: dict, repeats: int):
    """Warm-up once each, then `repeats` interleaved timed rounds; the best time of each (the machine may be
    shared: interleaving and taking the minimum compare the engines under the same conditions). The warm-up
    (first) call's seconds go to FIRST_CALL."""
    results = {}
    for name, run in runners.items():
        t = time.perf_counter()
        results[name] = run()
        FIRST_CALL.setdefault(name, time.perf_counter() - t)
    best = {name: float("inf") for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            t = time.perf_counter()
            results[name] = run()
            best[name] = min(best[name], time.perf_counter() - t)
    return best, results


def matmul_floor(model, rows: int = 16, steps: int = 64) -> tuple[float, float]:
    """Seconds per step of the decode step's matrix products alone (q, k, v, o, gate, up, down per layer and
    the LM head, `rows` rows, the model's own weights, in a compiled loop), and the megabytes of weights one
    step reads: the floor that the rest of a decode step (attention, norms, sampling) adds to."""
    import jax
    import jax.numpy as jnp

    att, mlp, d = model.layers.self_attn, model.layers.mlp, model.cfg.hidden_size
    # stacked [L, *in, *out] kernels as 2-D [in, out] matrices per layer, in the order the loop uses them
    linears = [att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    kernels = [[lin.kernel[...][i].reshape(math.prod(lin.in_shape), -1) for lin in linears]
               for i in range(model.cfg.num_layers)]
    head = model.output_kernel()

    @jax.jit
    def loop(x, kernels, head):
        def body(_, x):
            for q, k, v, o, g, u, dn in kernels:
                a = x @ q
                a = a + jnp.tile(x @ k, a.shape[1] // k.shape[1]) + jnp.tile(x @ v, a.shape[1] // v.shape[1])
                x = x + (a @ o) * 0.1
                x = x + ((x @ g) * (x @ u)) @ dn * 0.01
            logits = x @ head
            return x + jnp.max(logits, axis=-1, keepdims=True) * 1e-6
        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones((rows, d), jnp.float32)
    jax.block_until_ready(loop(x, kernels, head))
    best = min(_timed(lambda: jax.block_until_ready(loop(x, kernels, head))) for _ in range(5))
    mb = (sum(k.size for ks in kernels for k in ks) + head.size) * 4 / 1e6
    return best / steps, mb


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pick_stop_ids(seqs: list[list[int]], rng, target: float = 0.5) -> list[int]:
    """Stop ids that end about `target` of the sequences, each around the middle of its completion.

    Greedy decoding with stop ids yields the prefix of the stop-free completion up to the first stop
    token, so the effect of a stop set can be computed on the stop-free completions.
    """
    stops: set[int] = set()

    def stopped(stop_set):
        return [next((j for j, t in enumerate(s) if t in stop_set), None) for s in seqs]

    for i in rng.permutation(len(seqs)):
        s = seqs[i]
        j = int(rng.integers(len(s) // 4, 3 * len(s) // 4))
        cand = stops | {s[j]}
        ends = stopped(cand)
        early = [e for e in ends if e is not None]
        if len(early) / len(seqs) > target + 0.05 or min(early) < len(s) // 8:
            continue
        stops = cand
        if len(early) / len(seqs) >= target - 0.05:
            break
    return sorted(stops)


def first_call_worker(path: Path) -> None:
    """(In a fresh process.) Seconds of the first and second case-1 generate calls, with the persistent
    compilation cache of $POSTTRAIN_COMPILE_CACHE."""
    from posttrain import compile_cache
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    compile_cache.enable()
    t0 = time.perf_counter()
    model = from_pretrained(path)
    prompts = np.random.default_rng(0).integers(3, VOCAB, size=(16, PROMPT_LEN)).tolist()
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    sampler = Sampler(model, max_slots=16, max_len=PROMPT_LEN + NEW)
    t1 = time.perf_counter()
    sampler.generate(prompts, params)
    t2 = time.perf_counter()
    sampler.generate(prompts, params)
    t3 = time.perf_counter()
    print(f"FIRSTCALL {t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f}", flush=True)


def first_call_cold_warm(path: Path) -> dict[str, tuple[float, float, float]]:
    """(load s, first call s, second call s) in a fresh process with an empty compilation cache (cold), then
    in another one with the cache the first filled (warm)."""
    import subprocess

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "POSTTRAIN_COMPILE_CACHE": cache}
        for kind in ("cold", "warm"):
            proc = subprocess.run([sys.executable, __file__, "--first-call-worker", str(path)], env=env,
                                  capture_output=True, text=True, check=False)
            line = [x for x in proc.stdout.splitlines() if x.startswith("FIRSTCALL ")]
            if proc.returncode or not line:
                raise RuntimeError(f"first-call worker failed:\n{proc.stderr[-3000:]}")
            out[kind] = tuple(float(x) for x in line[-1].split()[1:])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (best of)")
    ap.add_argument("--profile", action="store_true", help="also time prefill and decode separately")
    ap.add_argument("--first-call", action="store_true",
                    help="also time the first generate call in fresh processes, cold and with a warm compilation cache")
    ap.add_argument("--first-call-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_call_worker:
        first_call_worker(args.first_call_worker)
        return 0
    repeats = args.repeats

    import jax
    from rich.console import Console
    from rich.table import Table

    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    console = Console(width=max(110, Console().width))
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "llama-bench")
        cold_warm = first_call_cold_warm(path) if args.first_call else None
        model = from_pretrained(path)

        # ---------------------------------------------------------------- case 1: ours vs transformers
        prompts = rng.integers(3, VOCAB, size=(16, PROMPT_LEN))
        plist = prompts.tolist()
        params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
        sampler = Sampler(model, max_slots=16, max_len=PROMPT_LEN + NEW)
        cores = os.cpu_count() or 1
        runners = {"ours": ours_runner(sampler, plist, params)}
        for threads in sorted({1, cores}):
            runners[f"hf{threads}"] = hf_runner(path, prompts, NEW, threads)
        best, res = best_times(runners, repeats)
        hf_best = min((k for k in best if k.startswith("hf")), key=best.get)
        t_ours, t_hf, out, hf_tokens = best["ours"], best[hf_best], res["ours"], res[hf_best]
        hf_threads = int(hf_best[2:])
        stats1 = dict(sampler.last_stats)
        tokens = sum(len(c.token_ids) for c in out)
        assert tokens == 16 * NEW
        same = sum(c.token_ids == hf_tokens[i].tolist() for i, c in enumerate(out))
        if args.profile:
            sampler.profile = True
            sampler.generate(plist, params)
            prof = sampler.last_stats
            sampler.profile = False
            floor, floor_mb = matmul_floor(model)

        # ---------------------------------------------------------------- case 2: continuous vs static batches
        prompts2 = rng.integers(3, VOCAB, size=(64, PROMPT_LEN)).tolist()
        free = Sampler(model, max_slots=16, max_len=PROMPT_LEN + NEW,
                       program_cache=sampler.program_cache).generate(prompts2, params)
        s2 = Sampler(model, max_slots=16, max_len=PROMPT_LEN + NEW, program_cache=sampler.program_cache)
        case2 = []
        # about half stop early (the brief's case), then most stop early and a few run long
        for target in (0.5, 0.75):
            stops = pick_stop_ids([c.token_ids for c in free], rng, target)
            params2 = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=stops)
            best2, res2 = best_times({"continuous": ours_runner(s2, prompts2, params2),
                                      "static": ours_runner(s2, prompts2, params2, batches=4)}, repeats)
            out_cont, out_static = res2["continuous"], res2["static"]
            assert [c.token_ids for c in out_cont] == [c.token_ids for c in out_static]
            steps_static = sum(max(len(c.token_ids) for c in out_static[i:i + 16]) - 1 for i in range(0, 64, 16))
            s2.generate(prompts2, params2)
            lengths = np.array([len(c.token_ids) for c in out_cont])
            case2.append(dict(stops=len(stops), early=float(np.mean(lengths < NEW)), mean=float(lengths.mean()),
                              tokens=int(lengths.sum()), t_cont=best2["continuous"], t_static=best2["static"],
                              steps_cont=s2.last_stats["decode_steps"], steps_static=steps_static,
                              prefills=s2.last_stats["prefill_calls"]))

    t1 = Table(title=f"Case 1: 16 prompts x {PROMPT_LEN} tokens, {NEW} new tokens, greedy, no stop (ours on "
              f"{jax.default_backend()}, transformers on CPU)")
    for col in ("engine", "seconds", "tokens/s", "ratio"):
        t1.add_column(col, justify="right")
    hf_name = f"transformers generate (torch, {hf_threads} thread{'s' if hf_threads > 1 else ''})"
    t1.add_row(hf_name, f"{t_hf:.3f}", f"{tokens / t_hf:,.0f}", "1.00x")
    t1.add_row("posttrain Sampler (JAX)", f"{t_ours:.3f}", f"{tokens / t_ours:,.0f}", f"{t_hf / t_ours:.2f}x")
    console.print(t1)
    console.print(f"identical greedy sequences (ours vs transformers): {same}/16; "
                  f"ours: {stats1.get('prefill_calls')} prefill call(s), {stats1.get('decode_steps')} decode steps")
    console.print(f"first call (compiles included), this process: ours {FIRST_CALL['ours']:.2f} s vs steady "
                  f"{t_ours:.2f} s; transformers {FIRST_CALL[hf_best]:.2f} s vs steady {t_hf:.2f} s")
    if cold_warm:
        for kind, (load, first, second) in cold_warm.items():
            console.print(f"first call in a fresh process, {kind} compilation cache: {first:.2f} s "
                          f"(then {second:.2f} s; model load {load:.2f} s)")
    if args.profile:
        steps = max(int(prof.get("decode_steps", 1)), 1)
        console.print(f"profile (blocking after prefill): prefill {prof.get('prefill_seconds', 0):.3f}s, "
                      f"decode {prof.get('decode_seconds', 0):.3f}s ({prof.get('decode_seconds', 0) / steps * 1e3:.2f} "
                      f"ms/step), total {prof.get('seconds', 0):.3f}s; the decode step's matmuls alone: "
                      f"{floor * 1e3:.2f} ms/step ({floor_mb:.1f} MB of float32 weights per step)")

    t2 = Table(title=f"Case 2: 64 prompts of {PROMPT_LEN} tokens through 16 slots, up to {NEW} new tokens, greedy, "
                     "stop ids picked from the completions")
    for col in ("stop early", "mean length", "batching", "decode steps", "seconds", "tokens/s", "ratio"):
        t2.add_column(col, justify="right")
    for c in case2:
        lead = (f"{c['early']:.0%} ({c['stops']} ids)", f"{c['mean']:.0f}")
        t2.add_row(*lead, "static batches of 16", str(c["steps_static"]), f"{c['t_static']:.3f}",
                   f"{c['tokens'] / c['t_static']:,.0f}", "1.00x")
        t2.add_row("", "", f"continuous ({c['prefills']} prefills)", str(c["steps_cont"]), f"{c['t_cont']:.3f}",
                   f"{c['tokens'] / c['t_cont']:,.0f}", f"{c['t_static'] / c['t_cont']:.2f}x", end_section=True)
    console.print(t2)
    console.print(f"machine: {os.cpu_count()} CPUs, load average {load_before:.1f} at start, "
                  f"{os.getloadavg()[0]:.1f} at end; best of {repeats} interleaved rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
