"""Benchmark of first-call (cold start) seconds: posttrain vs Tunix, measured in the same run.

The work is `bench_generate.py`'s case 1: a Llama-shaped HF checkpoint with random weights written by
transformers (vocab 8192, hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads, head_dim 64), 16
prompts of 64 random token ids, 128 new tokens each, greedy, no stop token, float32 on CPU.

Each measurement is a fresh subprocess (so every jit compile, and every import, is paid again), run in
interleaved rounds: ours cold, ours warm, Tunix cold, then again. In each process: import seconds (the
framework), model load seconds (checkpoint -> model), first generate call seconds (traces and compiles
included), second call seconds (the same call again: steady state), and the programs JAX compiled during
the first call (names, trace + lower + XLA compile seconds, from `jax.monitoring` events).

  * ours cold: `posttrain.compile_cache.enable()` with $POSTTRAIN_COMPILE_CACHE an empty folder;
    `from_pretrained(path)`, `Sampler(model, max_slots=16, max_len=192).generate(prompts,
    SamplingParams(max_new_tokens=128, temperature=0.0, stop_token_ids=[]))`.
  * ours warm: the same, with the folder the cold run of that round filled (a second CLI run).
  * Tunix cold: run by `--tunix-python` (a Python where `tunix` imports; posttrain never depends on it),
    JAX's persistent compilation cache off. `tunix.models.llama3.params.create_model_from_safe_tensors`
    on the same checkpoint (same weights), `tunix.generate.sampler.Sampler` with a KV cache of 192 tokens
    and a tokenizer that maps "id id id" strings to those ids (no BOS, pad id -1, no eos),
    `sampler(prompts, max_generation_steps=128, max_prompt_length=64, temperature=0.0)`.
    Tunix 0.1.7's Llama 3 ignores `rope_theta` (always 1e6); the worker sets its `apply_rope` default to the
    checkpoint's 1e4 (a constant: the compiled programs are the same size) so both sides' greedy tokens can
    be compared, which checks that both do the same work on the same weights (`--tunix-rope-1e6` keeps
    Tunix as shipped). Tunix runs one extra decode step (its while loop runs until its 192-token buffer is
    full, writing past it once): 128 decode steps vs our 127, under 1% of the steady state.

`--grpo` adds the first GRPO step, `bench_grpo.py`'s work: its checkpoint (same shapes, HF-initialised weights,
its word tokenizer), its 8 prompts of 32 tokens x 4 samples, <= 64 new tokens, temperature 1, stop at eos,
its reward, beta 0, one AdamW update (lr 1e-5, clip 1.0, no weight decay), float32; two steps per process.
  * ours: `bench_grpo.run_ours` (`posttrain.rl.loop.run_rl`), cold and warm cache as above. first = step 1's
    rollout + train seconds (the loop's clocks); load = run_rl's set-up before step 1; second = step 2.
  * Tunix: `tunix.rl.grpo.grpo_learner.GRPOLearner` (GRPOConfig(num_generations=4, num_iterations=1,
    beta=0): loss "grpo", sequence-mean-token-mean, epsilon 0.2) on an `RLCluster` (vanilla rollout engine,
    actor = rollout on one 1x1 Auto mesh, no reference model), optax clip_by_global_norm(1.0) + adamw;
    RolloutConfig(temperature=1, top_p=1, max_prompt_length=32 (the prompts' length: no padding),
    kv_cache_size=32+64); the same tokenizer without BOS (ours adds none to these prompts). load = model +
    RLCluster + learner; first / second = `learner.train` start -> end of global step 1 -> of step 2.
  The XLA compile columns count everything after the imports up to the end of step 1 (set-up included).

Without `--tunix-python` (or when tunix cannot be imported there) only ours is measured. The figures are the
minimum over rounds; the machine may be shared, so the 1-minute load average is printed beside each run.

Run: `python benchmarks/bench_first_call.py [--rounds 2] [--tunix-python /path/to/python] [--grpo]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

VOCAB, PROMPT_LEN, NEW, SLOTS = 8192, 64, 128, 16


# ---------------------------------------------------------------------------------------------------------------
# in the worker processes
# ---------------------------------------------------------------------------------------------------------------

class CompileLog:
    """The programs JAX traces, lowers and compiles, from `jax.monitoring` duration events, tagged with the
    phase ("load", "first", "second") they happened in."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
              "/jax/core/compile/backend_compile_duration": "compile"}

    def __init__(self, phase: str = "load"):
        import jax

        self.phase = phase
        self.rows: list[list] = []  # [phase, event, fun_name, seconds]
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kw):
        kind = self.EVENTS.get(event)
        if kind:
            self.rows.append([self.phase, kind, str(kw.get("fun_name", "?")), float(duration)])


def prompts_of(rng_seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(rng_seed).integers(3, VOCAB, size=(SLOTS, PROMPT_LEN)).tolist()


def _result(**kw) -> None:
    kw["loadavg"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(kw), flush=True)


def _timed_calls(call, n: int) -> list[float]:
    """Seconds of each of `n` (>= 1) successive calls of `call`."""
    times = []
    for _ in range(max(1, n)):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


def _steady_field(times: list[float]) -> dict:
    """{"steady": times} when more than one steady-state call was asked for (the default result is unchanged)."""
    return {"steady": times} if len(times) > 1 else {}


def generate_worker_ours(path: Path, steady: int = 1) -> None:
    """posttrain: load, then two identical generate calls; the persistent cache of $POSTTRAIN_COMPILE_CACHE.
    `steady` > 1: that many calls after the first (`second` is the first of them, `steady` all their seconds)."""
    t0 = time.perf_counter()
    import jax  # noqa: F401

    from posttrain import compile_cache
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    log = CompileLog()
    compile_cache.enable()
    t1 = time.perf_counter()
    model = from_pretrained(path)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    sampler = Sampler(model, max_slots=SLOTS, max_len=PROMPT_LEN + NEW)
    prompts = prompts_of()
    t2 = time.perf_counter()
    log.phase = "first"
    out = sampler.generate(prompts, params)
    t3 = time.perf_counter()
    log.phase = "second"
    times = _timed_calls(lambda: sampler.generate(prompts, params), steady)
    _result(imports=t1 - t0, load=t2 - t1, first=t3 - t2, second=times[0], compiles=log.rows,
            tokens=[list(map(int, c.token_ids)) for c in out], **_steady_field(times))


class IdTokenizer:
    """Tunix's sampler takes strings: "12 7 4093" <-> [12, 7, 4093]. No BOS (bos_id 0 is falsy to Tunix), no
    eos; pad id -1, which no generated token equals (Tunix masks every buffer position holding the pad id)."""

    def encode(self, text: str, **kw) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return -1


def tunix_llama_config(path: Path, **extra):
    """Tunix's Llama 3 config with the checkpoint's shapes."""
    from tunix.models.llama3 import model as llama

    hf = json.loads((path / "config.json").read_text())
    return llama.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(_rope_theta(hf)),
        norm_eps=hf["rms_norm_eps"], weight_tying=bool(hf.get("tie_word_embeddings", False)), **extra)


def _rope_theta(hf: dict) -> float:
    return float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _tunix_rope(path: Path, keep_1e6: bool) -> None:
    """Tunix 0.1.7's `apply_rope` is called without the config's rope_theta (default 1e6): give it the
    checkpoint's, so the two sides compute the same function (unless `keep_1e6`)."""
    if keep_1e6:
        return
    from tunix.models.llama3 import model as llama

    llama.apply_rope.__defaults__ = (_rope_theta(json.loads((path / "config.json").read_text())),)


def _jax_cache_off() -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)


def generate_worker_tunix(path: Path, keep_rope: bool, steady: int = 1) -> None:
    """Tunix: load the same checkpoint, then two identical sampler calls; JAX's persistent cache off.
    `steady` > 1: that many calls after the first, as in `generate_worker_ours`."""
    t0 = time.perf_counter()
    import jax  # noqa: F401
    from tunix.generate import sampler as tsampler
    from tunix.models.llama3 import params as tparams

    _jax_cache_off()
    log = CompileLog()
    _tunix_rope(path, keep_rope)
    t1 = time.perf_counter()
    cfg = tunix_llama_config(path)
    model = tparams.create_model_from_safe_tensors(str(path), cfg)
    sampler = tsampler.Sampler(model, IdTokenizer(), tsampler.CacheConfig(
        cache_size=PROMPT_LEN + NEW, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim))
    prompts = [" ".join(map(str, p)) for p in prompts_of()]
    t2 = time.perf_counter()

    def call():
        return sampler(prompts, max_generation_steps=NEW, max_prompt_length=PROMPT_LEN, temperature=0.0,
                       eos_tokens=[-1], echo=False)

    log.phase = "first"
    out = call()
    t3 = time.perf_counter()
    log.phase = "second"
    times = _timed_calls(call, steady)
    _result(imports=t1 - t0, load=t2 - t1, first=t3 - t2, second=times[0], compiles=log.rows,
            tokens=[list(map(int, t)) for t in out.tokens], **_steady_field(times))


# ---------------------------------------------------------------------------------------------------------------
# the parent: checkpoint, interleaved rounds, tables
# ---------------------------------------------------------------------------------------------------------------

def spawn(python: str, args: list[str], env: dict | None = None, timeout: float = 1800) -> dict:
    proc = subprocess.run([python, __file__, *args], capture_output=True, text=True, env=env, timeout=timeout,
                          check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {args[:2]} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def tunix_available(python: str | None, grpo: bool = False) -> str | None:
    """None when `python` can import tunix, else the reason it cannot."""
    if not python:
        return "no --tunix-python given"
    try:
        mods = "tunix.generate.sampler, tunix.models.llama3.params" + (", tunix.rl.grpo.grpo_learner" if grpo else "")
        proc = subprocess.run([python, "-c", f"import {mods}"],
                              capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return f"{python} cannot import tunix: {last}"
    return None


def compile_summary(rows: list[list], phase: str = "first") -> dict:
    """Per program name compiled in `phase`: count and seconds of trace, lower and XLA compile."""
    out: dict[str, dict] = {}
    for ph, kind, name, sec in rows:
        if ph != phase:
            continue
        if name.startswith("jit(") and name.endswith(")"):  # trace events name the function, the others jit(...)
            name = name[4:-1]
        d = out.setdefault(name, {"trace": 0.0, "lower": 0.0, "compile": 0.0, "n": 0})
        d[kind] += sec
        d["n"] += kind == "compile"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each a fresh set of processes)")
    ap.add_argument("--tunix-python", help="a Python interpreter where `tunix` imports (e.g. a venv's bin/python)")
    ap.add_argument("--tunix-rope-1e6", action="store_true",
                    help="leave Tunix's Llama rope at its built-in theta 1e6 (tokens then differ from ours)")
    ap.add_argument("--grpo", action="store_true", help="also time the first GRPO step, ours vs Tunix")
    ap.add_argument("--programs", type=int, default=12, help="compiled programs listed per side")
    ap.add_argument("--json", type=Path, help="also write every run's raw measurements (and compile events) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--steady", type=int, default=1, help=argparse.SUPPRESS)  # steady-state calls/steps (workers)
    args = ap.parse_args(argv)
    if args.worker:
        WORKERS[args.worker](args)
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    from rich.console import Console
    from rich.table import Table

    from bench_generate import build_checkpoint

    console = Console() if sys.stdout.isatty() else Console(width=160)
    why_not = tunix_available(args.tunix_python, args.grpo)
    if why_not:
        console.print(f"Tunix not measured: {why_not}")
    works = ["generate"] + (["grpo"] if args.grpo else [])
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in works}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"generate": build_checkpoint(Path(tmp) / "llama-bench")}
        if args.grpo:
            paths["grpo"] = grpo_prepare(Path(tmp) / "llama-grpo")
        for rnd in range(args.rounds):
            for work in works:
                with tempfile.TemporaryDirectory() as cache:
                    sides = [("ours cold", sys.executable, {"POSTTRAIN_COMPILE_CACHE": cache}),
                             ("ours warm", sys.executable, {"POSTTRAIN_COMPILE_CACHE": cache})]
                    if not why_not:
                        sides.append(("Tunix cold", args.tunix_python, {}))
                    for name, python, extra in sides:
                        side = "tunix" if name.startswith("Tunix") else "ours"
                        env = {**os.environ, **extra}
                        env.pop("JAX_COMPILATION_CACHE_DIR", None)
                        load0 = os.getloadavg()[0]
                        wargs = ["--worker", f"{work}-{side}", "--path", str(paths[work])]
                        if side == "tunix" and args.tunix_rope_1e6:
                            wargs.append("--tunix-rope-1e6")
                        r = spawn(python, wargs, env)
                        r["load0"] = load0
                        runs[work].setdefault(name, []).append(r)
                        console.print(f"round {rnd + 1}/{args.rounds} {work:8s} {name:10s}: first "
                                      f"{r['first']:6.2f} s, second {r['second']:6.2f} s, load {r['load']:5.2f} s, "
                                      f"imports {r['imports']:5.2f} s (load avg {load0:.2f} -> {r['loadavg']:.2f})")
    for work in works:
        report(console, Table, work, runs[work], args.programs)
    if args.json:
        args.json.write_text(json.dumps(runs))
    return 0


def report(console, Table, work: str, runs: dict[str, list[dict]], n_programs: int) -> None:
    """The table of one work (min over rounds), ratios to Tunix, and each side's compiled programs."""
    title = {"generate": f"First generate call, fresh process: {SLOTS} prompts x {PROMPT_LEN} tokens, {NEW} new "
                         f"tokens, greedy, Llama-shaped 4 layers / hidden 256 / vocab {VOCAB}, CPU float32",
             "grpo": "First GRPO step, fresh process: 8 prompts x 4 samples, <= 64 new tokens, temperature 1, "
                     "beta 0, one AdamW update, same model shapes, CPU float32"}[work]
    second_name = {"generate": "second call s", "grpo": "second step s"}[work]
    during = {"generate": "first call", "grpo": "load + first step"}[work]
    t = Table(title=title + f" (min over {len(next(iter(runs.values())))} rounds)")
    for col in ("side", "first s", "per round", second_name, "load s", "imports s", f"XLA compile s ({during})",
                f"XLA compiles ({during})", "load avg per round"):
        t.add_column(col, justify="left" if col == "side" else "right")
    mins = {}
    for name, rs in runs.items():
        first = [r["first"] for r in rs]
        mins[name] = {k: min(r[k] for r in rs) for k in ("first", "second", "load", "imports")}
        cs = [compile_summary(r["compiles"]) for r in rs]
        xla = min(sum(d["compile"] for d in c.values()) for c in cs)
        progs = min(sum(d["n"] for d in c.values()) for c in cs)
        t.add_row(name, f"{mins[name]['first']:.2f}", " / ".join(f"{x:.2f}" for x in first),
                  f"{mins[name]['second']:.2f}", f"{mins[name]['load']:.2f}", f"{mins[name]['imports']:.2f}",
                  f"{xla:.2f}", str(progs), " / ".join(f"{r['load0']:.1f}->{r['loadavg']:.1f}" for r in rs))
    console.print(t)
    if "Tunix cold" in mins:
        tx = mins["Tunix cold"]
        for name in ("ours cold", "ours warm"):
            o = mins[name]
            console.print(f"{name} / Tunix cold: first {o['first'] / tx['first']:.2f}x, "
                          f"load + first {(o['load'] + o['first']) / (tx['load'] + tx['first']):.2f}x, "
                          f"{second_name[:-2]} {o['second'] / tx['second']:.2f}x")
        if work == "grpo":
            console.print("mean completion length (tokens), per round: " + "; ".join(
                f"{name} " + " / ".join(f"{r['completion_length']:.1f}" for r in rs) for name, rs in runs.items()))
        a, b = runs["ours cold"][0].get("tokens"), runs["Tunix cold"][0].get("tokens")
        if a and b:
            same = sum(x == y for x, y in zip(a, b))
            console.print(f"identical greedy sequences, ours vs Tunix: {same}/{len(a)}")
    for name, rs in runs.items():  # the programs of the side's first round, slowest first
        c = compile_summary(rs[0]["compiles"])
        rows = sorted(c.items(), key=lambda kv: -(kv[1]["trace"] + kv[1]["lower"] + kv[1]["compile"]))
        tot = {k: sum(d[k] for d in c.values()) for k in ("trace", "lower", "compile", "n")}
        console.print(f"{name}, round 1, during the {during}: "
                      f"{tot['n']} XLA compiles ({tot['compile']:.2f} s), tracing {tot['trace']:.2f} s, "
                      f"lowering {tot['lower']:.2f} s; slowest:")
        for fname, d in rows[:n_programs]:
            console.print(f"    {fname[:60]:60s} x{d['n']:<3d} trace {d['trace']:6.2f}  lower {d['lower']:6.2f}  "
                          f"compile {d['compile']:6.2f}")


# ---------------------------------------------------------------------------------------------------------------
# GRPO: bench_grpo.py's step (its checkpoint with the word tokenizer, its 8 prompts, its reward)
# ---------------------------------------------------------------------------------------------------------------

def grpo_prepare(folder: Path) -> Path:
    import bench_grpo

    folder = bench_grpo.make_checkpoint(folder)
    bench_grpo.write_prompts(folder / "prompts.jsonl", bench_grpo.make_prompts())
    return folder


def grpo_worker_ours(folder: Path, steady: int = 1) -> None:
    """posttrain: `bench_grpo.run_ours` (run_rl, 2 steps: 8 prompts x 4, <= 64 new tokens, temperature 1,
    beta 0, one AdamW update per step), persistent cache of $POSTTRAIN_COMPILE_CACHE. first = step 1's
    rollout + train seconds (the loop's own clocks); load = run_rl's set-up before step 1 (model load,
    optimizer, rollout source); second = step 2, wall-clock between step ends. `steady` > 1: that many steps
    after step 1 (`steady` = their wall-clock seconds)."""
    t0 = time.perf_counter()
    import jax  # noqa: F401

    import bench_grpo
    from posttrain.rl import loop  # noqa: F401
    from posttrain.training import metrics as metrics_lib

    log = CompileLog(phase="first")
    ends: list[float] = []
    orig = metrics_lib.MetricsLogger.advance

    def advance(self, step):
        ends.append(time.perf_counter())
        log.phase = "second"
        return orig(self, step)

    metrics_lib.MetricsLogger.advance = advance
    t1 = time.perf_counter()
    r = bench_grpo.run_ours(folder, folder / "prompts.jsonl", warmup=1, steps=max(1, steady))
    first = r["warmup"][0]
    _result(imports=t1 - t0, load=ends[0] - t1 - first, first=first, second=r["step"][0], compiles=log.rows,
            completion_length=r["length_mean"], loss=r["loss"], **_steady_field(r["step"]))


class WordTokenizer:
    """The checkpoint's HF tokenizer for Tunix (which tokenizes prompt strings itself): no BOS, as ours
    encodes these prompts (`add_special_tokens=True` with a tokenizer that adds none); eos 2, pad 0."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(folder)

    def encode(self, text, **kw) -> list[int]:
        return self.hf.encode(str(text), add_special_tokens=False)

    def decode(self, ids, **kw) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.hf.eos_token_id

    def pad_id(self) -> int:
        return self.hf.pad_token_id


def grpo_worker_tunix(folder: Path, keep_rope: bool, steady: int = 1) -> None:
    """Tunix: `GRPOLearner` on an `RLCluster` (vanilla rollout, actor = rollout on one 1x1 mesh, no reference
    model as beta is 0), 2 steps of the same work; JAX's persistent cache off. load = model from safetensors
    + RLCluster + GRPOLearner; first / second = `learner.train` start -> end of global step 1 -> step 2.
    `steady` > 1: that many global steps after step 1 (`steady` = seconds between their ends)."""
    t0 = time.perf_counter()
    import jax
    import optax
    from tunix.models.llama3 import params as tparams
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    import bench_grpo
    from _bench_rewards import reward

    _jax_cache_off()
    log = CompileLog(phase="first")
    _tunix_rope(folder, keep_rope)
    t1 = time.perf_counter()
    prompts = [json.loads(x)["prompt"] for x in (folder / "prompts.jsonl").read_text().splitlines()]
    tok = WordTokenizer(folder)
    prompt_len = max(len(tok.encode(p)) for p in prompts)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = tparams.create_model_from_safe_tensors(str(folder), tunix_llama_config(folder), mesh=mesh)
    steps = 1 + max(1, steady)
    train_cfg = rlc.RLTrainingConfig(
        actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                    optax.adamw(bench_grpo.LR, weight_decay=0.0)),
        eval_every_n_steps=10**9, max_steps=steps, mini_batch_size=bench_grpo.N_PROMPTS,
        train_micro_batch_size=bench_grpo.N_PROMPTS)
    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=bench_grpo.MAX_NEW, temperature=1.0, top_p=1.0, top_k=None,
        max_prompt_length=prompt_len, kv_cache_size=prompt_len + bench_grpo.MAX_NEW)
    cluster = rlc.RLCluster(actor=model, reference=None, tokenizer=tok, cluster_config=rlc.ClusterConfig(
        role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False, training_config=train_cfg, rollout_config=rollout_cfg))
    learner = grpo_learner.GRPOLearner(
        cluster, grpo_learner.GRPOConfig(num_generations=bench_grpo.GROUP, num_iterations=1, beta=0.0),
        reward_fns=[lambda prompts, completions, **kw: reward(prompts, completions)])
    ends: list[float] = []
    run_step = learner._run_global_step

    def timed_step(*a, **k):
        out = run_step(*a, **k)
        ends.append(time.perf_counter())
        log.phase = "second"
        return out

    learner._run_global_step = timed_step
    lengths: list[float] = []
    generate = cluster.generate

    def counted_generate(*a, **k):
        out = generate(*a, **k)
        lengths.append(float(np.mean([len(t) for t in out.tokens])))
        return out

    cluster.generate = counted_generate
    t2 = time.perf_counter()
    learner.train([{"prompts": np.array(prompts)} for _ in range(steps)])
    if len(ends) != steps or cluster.actor_trainer.train_steps != steps:
        raise RuntimeError(f"Tunix ran {len(ends)} global steps, {cluster.actor_trainer.train_steps} updates; "
                           f"expected {steps}")
    _result(imports=t1 - t0, load=t2 - t1, first=ends[0] - t2, second=ends[1] - ends[0], compiles=log.rows,
            completion_length=float(np.mean(lengths)), prompt_len=prompt_len,
            **_steady_field([b - a for a, b in zip(ends, ends[1:])]))


WORKERS = {
    "generate-ours": lambda a: generate_worker_ours(a.path, a.steady),
    "generate-tunix": lambda a: generate_worker_tunix(a.path, a.tunix_rope_1e6, a.steady),
    "grpo-ours": lambda a: grpo_worker_ours(a.path, a.steady),
    "grpo-tunix": lambda a: grpo_worker_tunix(a.path, a.tunix_rope_1e6, a.steady),
}


if __name__ == "__main__":
    sys.exit(main())
