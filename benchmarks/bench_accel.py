"""Accelerator benchmark: SFT MFU, decode vs the bandwidth roofline, and the same work in PyTorch, on whatever
backend JAX sees.

Model: Llama-shaped, sized for the backend: on a GPU/TPU about 0.45B parameters (vocab 32768, hidden 1024,
mlp 4096, 24 layers, 16/8 heads x 64, untied); on CPU the bench-small model of the other benchmarks
(vocab 8192, hidden 256, mlp 768, 4 layers, 4/2 heads x 64). `--size` overrides the choice.

JAX side (one process, the generic or cpu kernel set as `auto` resolves it):
- peak: the best time of a large bfloat16 matmul (n^3) in this run -> FLOP/s; copy bandwidth: the best time
  of `x + 1` over a large float32 array -> bytes/s (read + write).
- SFT: float32 master weights, bfloat16 compute, AdamW, random tokens [batch, seq]; tokens/s over timed
  steps after warm-up, MFU = flops_per_token (6N + 12 L H Q T) x tokens/s / measured peak.
- decode: bfloat16 weights and cache, greedy, no stop, `--new` tokens after `--prompt`-token prompts, at each
  of `--slots` concurrent sequences; decode tokens/s = slots x decode steps / decode seconds (the sampler's
  own accounting, prefill excluded), and the fraction of the bandwidth roofline: (bytes of the weights read
  per step + bytes of the KV cache positions attended per step) / copy bandwidth, over the measured step time.
- peak device memory (`memory_stats()["peak_bytes_in_use"]` where the backend reports it; else the
  process's maximum resident set).
PyTorch side (another process, same device, same model shape, random weights):
- a plain training loop (bfloat16 autocast, fused AdamW where available) -> tokens/s;
- transformers `generate` (greedy, static cache and `torch.compile` on CUDA where they work, else the
  default dynamic cache) -> tokens/s including prefill (reported as such);
- peak memory (`torch.cuda.max_memory_allocated`, or the process's maximum resident set on CPU).

    python benchmarks/bench_accel.py [--size auto|small|0.5b] [--steps N] [--batch B] [--seq T]
                                     [--slots 16 64 256] [--prompt P] [--new N] [--no-torch]
                                     [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=64, tie_word_embeddings=False),
    "0.5b": dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_layers=24, num_heads=16,
                 num_kv_heads=8, head_dim=64, tie_word_embeddings=False),
}
#: per size: SFT batch, seq, timed steps; decode prompt and new tokens; peak matmul n; bandwidth array MB
DEFAULTS = {
    "small": dict(batch=4, seq=256, steps=3, prompt=32, new=32, n=1024, mb=64),
    "0.5b": dict(batch=8, seq=2048, steps=10, prompt=128, new=256, n=8192, mb=1024),
}


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------------- JAX
def jax_worker(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from posttrain.algorithms.sft import make_sft_loss
    from posttrain.models import kernels as kernels_lib
    from posttrain.models.config import llama_like
    from posttrain.models.transformer import init_model
    from posttrain.sampling import Sampler, SamplingParams
    from posttrain.training.trainer import Trainer, flops_per_token

    dev = jax.devices()[0]

    def peak_mem():
        stats = dev.memory_stats() or {}
        return int(stats.get("peak_bytes_in_use", 0)) or _rss_bytes()

    out = {"backend": jax.default_backend(), "device": str(dev.device_kind), "jax": jax.__version__}
    n = a.n
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    mm(x, x).block_until_ready()
    out["peak_flops"] = 2 * n**3 / _best(lambda: mm(x, x).block_until_ready(), 5)
    del x
    big = jnp.zeros((a.mb * 2**20 // 4,), jnp.float32)
    inc = jax.jit(lambda v: v + 1)
    inc(big).block_until_ready()
    out["copy_bw"] = 2 * big.nbytes / _best(lambda: inc(big).block_until_ready(), 5)
    del big

    cfg = llama_like(**SHAPES[a.size], param_dtype="float32", compute_dtype="bfloat16",
                     max_position_embeddings=max(a.seq, a.prompt + a.new) + 16, remat=a.remat)
    out["kernels"] = kernels_lib.resolve(cfg.kernels)
    out["params"] = cfg.num_params()

    # ------------------------------------------------------------ SFT
    model = init_model(cfg, seed=0)
    tr = Trainer(model, optax.adamw(1e-5), loss_fn=make_sft_loss(a.chunk or None))
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(3, cfg.vocab_size, size=(a.batch, a.seq)).astype(np.int32),
             "loss_mask": np.ones((a.batch, a.seq), np.int32)}
    t = time.perf_counter()
    tr.step(batch)
    out["sft_first_step_s"] = time.perf_counter() - t
    tr.step(batch)
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        tr.step(batch)  # fetches the metrics: waits for the step
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    out["sft_step_s"] = step
    out["sft_tokens_per_s"] = a.batch * a.seq / step
    out["sft_mfu"] = flops_per_token(cfg, a.seq) * out["sft_tokens_per_s"] / out["peak_flops"]
    out["sft_peak_mem"] = peak_mem()
    del tr, model

    # ------------------------------------------------------------ decode
    dcfg = cfg.replace(param_dtype="bfloat16")
    model = init_model(dcfg, seed=0)
    weight_bytes = 2 * (dcfg.num_params() - dcfg.vocab_size * dcfg.hidden_size)  # the embedding: rows only
    kv_per_pos = 2 * dcfg.num_layers * dcfg.num_kv_heads * dcfg.head_dim * 2  # k and v, bf16, per position
    params = SamplingParams(max_new_tokens=a.new, temperature=0.0, stop_token_ids=[])
    out["decode"] = {}
    for slots in a.slots:
        prompts = rng.integers(3, dcfg.vocab_size, size=(slots, a.prompt)).tolist()
        sampler = Sampler(model, max_slots=slots, max_len=a.prompt + a.new, cache_step=0)
        t = time.perf_counter()
        sampler.generate(prompts, params)
        first = time.perf_counter() - t
        t = time.perf_counter()
        sampler.generate(prompts, params)
        total = time.perf_counter() - t
        st = sampler.last_stats
        step_s = st["decode_seconds"] / max(st["decode_steps"], 1)
        kv_bytes = slots * st["cache_len"] * kv_per_pos  # decode attends to the whole (masked) cache row
        roofline_s = (weight_bytes + kv_bytes) / out["copy_bw"]
        out["decode"][slots] = {"tokens_per_s": slots / step_s, "step_ms": step_s * 1e3,
                                "with_prefill_tokens_per_s": slots * a.new / total, "first_call_s": first,
                                "roofline_fraction": roofline_s / step_s, "bytes_per_step": weight_bytes + kv_bytes,
                                "peak_mem": peak_mem()}
        del sampler
    return out


# ---------------------------------------------------------------------------------------------------- PyTorch
def torch_worker(a) -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sh = SHAPES[a.size]
    hf_cfg = transformers.LlamaConfig(
        vocab_size=sh["vocab_size"], hidden_size=sh["hidden_size"], intermediate_size=sh["intermediate_size"],
        num_hidden_layers=sh["num_layers"], num_attention_heads=sh["num_heads"], num_key_value_heads=sh["num_kv_heads"],
        head_dim=sh["head_dim"], max_position_embeddings=max(a.seq, a.prompt + a.new) + 16,
        tie_word_embeddings=sh["tie_word_embeddings"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def peak_mem():
        return int(torch.cuda.max_memory_allocated()) if cuda else _rss_bytes()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).to(device)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, sh["vocab_size"], (a.batch, a.seq), device=device)

    def train_step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    train_step()
    train_step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t)
    out["sft_tokens_per_s"] = a.batch * a.seq / statistics.median(times)
    out["sft_peak_mem"] = peak_mem()
    del opt
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    out["generate"] = {}
    for slots in a.slots:
        prompt = torch.randint(3, sh["vocab_size"], (slots, a.prompt), device=device)
        kw = dict(do_sample=False, max_new_tokens=a.new, min_new_tokens=a.new, pad_token_id=0,
                  attention_mask=torch.ones_like(prompt))
        if cuda:  # a static cache: transformers compiles the decode step itself (its generation compile_config)
            kw["cache_implementation"] = "static"

        def gen():
            with torch.no_grad():
                model.generate(prompt, **kw)
            sync()

        try:
            t = time.perf_counter()
            gen()
            first = time.perf_counter() - t
        except Exception as e:  # the static/compiled path is optional: report it and time the default cache
            out.setdefault("static_cache_error", repr(e)[:300])
            kw.pop("cache_implementation", None)
            t = time.perf_counter()
            gen()
            first = time.perf_counter() - t
        best = _best(gen, 2)
        out["generate"][slots] = {"tokens_per_s": slots * a.new / best, "first_call_s": first,
                                  "peak_mem": peak_mem(), "cache": kw.get("cache_implementation", "dynamic")}
    return out


# ---------------------------------------------------------------------------------------------------- main
def _spawn(kind: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, *argv], capture_output=True, text=True,
                          check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["auto", "small", "0.5b"], default="auto")
    for name in ("batch", "seq", "steps", "prompt", "new", "n", "mb"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--slots", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--chunk", type=int, default=1024, help="SFT loss chunk (tokens per vocabulary projection)")
    ap.add_argument("--remat", default="none", choices=["none", "full", "dots", "dots_no_batch"])
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path, help="also write both sides' raw figures to this file")
    ap.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size == "auto":
        import jax

        args.size = "small" if jax.default_backend() == "cpu" else "0.5b"
    for k, v in DEFAULTS[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.worker:
        res = jax_worker(args) if args.worker == "jax" else torch_worker(args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    fwd = ["--size", args.size, "--chunk", str(args.chunk), "--remat", args.remat, "--slots", *map(str, args.slots)]
    for k in ("batch", "seq", "steps", "prompt", "new", "n", "mb"):
        fwd += [f"--{k}", str(getattr(args, k))]
    j = _spawn("jax", fwd)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "jax": j, "torch": None}, indent=1))
    t = None if args.no_torch else _spawn("torch", fwd)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "jax": j, "torch": t}, indent=1))
    gb = 2**30
    print(f"backend {j['backend']} ({j['device']}), jax {j['jax']}, kernels {j['kernels']}; model {args.size}: "
          f"{j['params'] / 1e6:.0f}M params; bf16 matmul peak {j['peak_flops'] / 1e12:.2f} TFLOP/s (n={args.n}); "
          f"copy bandwidth {j['copy_bw'] / 1e9:.1f} GB/s")
    print(f"SFT {args.batch}x{args.seq}, bf16 compute, remat {args.remat}:")
    print(f"  posttrain  {j['sft_tokens_per_s']:>10,.0f} tok/s  MFU {j['sft_mfu']:.1%}  step {j['sft_step_s']:.3f} s  "
          f"first step {j['sft_first_step_s']:.1f} s  peak mem {j['sft_peak_mem'] / gb:.2f} GiB")
    if t:
        print(f"  torch loop {t['sft_tokens_per_s']:>10,.0f} tok/s  MFU "
              f"{t['sft_tokens_per_s'] * j['sft_mfu'] / j['sft_tokens_per_s']:.1%}  peak mem "
              f"{t['sft_peak_mem'] / gb:.2f} GiB  ({t['device']}, torch {t['torch']})")
    print(f"decode, prompt {args.prompt} + {args.new} new tokens, greedy, bf16:")
    for s in args.slots:
        d = j["decode"][str(s)]
        line = (f"  {s:>4} seqs: posttrain {d['tokens_per_s']:>9,.0f} tok/s (decode only; {d['step_ms']:.2f} ms/step, "
                f"{d['roofline_fraction']:.0%} of the bandwidth roofline; {d['with_prefill_tokens_per_s']:,.0f} tok/s "
                f"with prefill; first call {d['first_call_s']:.1f} s; peak mem {d['peak_mem'] / gb:.2f} GiB)")
        if t:
            g = t["generate"][str(s)]
            line += (f"\n             transformers {g['tokens_per_s']:>9,.0f} tok/s (with prefill; {g['cache']} cache; peak mem {g['peak_mem'] / gb:.2f} GiB)")
        print(line)
    print("(CPU peak memory is the process's maximum resident set; on an accelerator, the device's peak bytes in use.)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
