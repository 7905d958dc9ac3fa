"""Benchmark: seconds per GRPO step, posttrain's RL loop (JAX) vs TRL's GRPOTrainer (PyTorch), same run.

What one step is, on both sides: 8 prompts (32 word-tokens each) x 4 sampled completions of up to 64 new
tokens (temperature 1, stop at eos id 2), a cheap deterministic reward on the completion text
(`benchmarks/_bench_rewards.py:reward`, the same function on both sides), group-normalised GRPO advantages,
beta 0 (no reference model), one AdamW update (lr 1e-5, constant, clip 1.0), float32, full parameters.
Model: a Llama-shaped HF checkpoint with random weights (vocab 8192, hidden 256, intermediate 768, 4 layers,
4 heads, 2 KV heads, head_dim 64), written once with transformers/torch and loaded by both sides; the word
tokenizer from `posttrain.models.tokenizer.build_tokenizer` is saved in the same folder.

How each side is timed (warm-up steps, which include our jit compiles, are dropped on both):
  * ours: `posttrain.rl.loop.run_rl` on a config built from overrides. s/step is the wall-clock between
    consecutive ends of steps (`MetricsLogger.advance` is wrapped, in the worker process only), so it
    covers everything the loop does per step; rollout / train are the loop's own `time/rollout_s`
    (sampling + detokenising + rewards) and `time/train_s` (the jitted optimizer step) from
    `result.history`; their sum is shown too.
  * TRL: a `TrainerCallback` (on_step_begin -> on_step_end). Rollout = time inside the trainer's
    `_generate_and_score_completions` (wrapped on the instance: HF `model.generate` + decoding + rewards +
    advantages, the counterpart of our rollout); `model.generate` alone is wrapped on the model instance
    and shown as "generate"; train = step - rollout (the loss forward/backward and optimizer step).
    TRL 1.16 only sends its own profiling timings to wandb/mlflow/trackio, so they are not used.
    GRPOConfig turns activation (gradient) checkpointing on by default; it is turned off here, as ours does
    not recompute activations either (`--trl-checkpointing` keeps TRL's default). TRL's loss_type is set to
    "grpo" (per-sequence token mean, as our grpo preset), scale_rewards "group", num_iterations 1.
Each side runs in its own subprocess, one after the other (never concurrently), so neither framework's
thread pool competes with the other's. torch uses `torch.set_num_threads(--torch-threads)`, by default
os.cpu_count() (torch's own default here too); XLA uses its default CPU thread pool. A float32 matmul rate
(2048^3, jax.jit and torch) is measured first for context. On a shared machine timings move run to run:
compare within one run, and watch the load-average column (other processes on the cores hurt a multi-threaded
torch far more than XLA; `--torch-threads 1` shows how much).

First step: the "warm-up s" column holds each warm-up step's seconds (ours: rollout + train, compiles
included), beside the steady state. `--first-call` also runs ours in two fresh processes (1 step each) with
an empty persistent compilation cache (cold) and then with the cache the first filled (warm).

Ours runs with its defaults (`learner.share_prompts` on: shared-prompt rows). `--pack` runs ours twice per round,
`learner.pack=false` then `true`, both with `learner.share_prompts=false` (each in a fresh process), and prints the
padding the packed update saved (real tokens / cells computed, packed vs padded) and the packed/padded ratios.
`--share-prompts` compares the padded batch with `learner.share_prompts=true` in the same way (rows may hold
one prompt and several of its completions: each group's prompt goes through the layers once a row).

    python benchmarks/bench_grpo.py [--warmup 2] [--steps 5] [--rounds 1] [--torch-threads N] [--pack | --share-prompts]
                                    [--trl-checkpointing] [--no-trl] [--no-ours] [--no-peak] [--first-call]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HERE = Path(__file__).resolve().parent
REWARD_REF = f"{HERE / '_bench_rewards.py'}:reward"

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, HEAD_DIM = 8192, 256, 768, 4, 4, 2, 64
N_PROMPTS, PROMPT_WORDS, GROUP, MAX_NEW = 8, 32, 4, 64
LR = 1e-5


# ---------------------------------------------------------------------------------------------------------------
# shared inputs: checkpoint + tokenizer folder, prompt set
# ---------------------------------------------------------------------------------------------------------------

def make_checkpoint(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(folder)
    build_tokenizer(folder, kind="word", vocab=[f"w{i}" for i in range(VOCAB - 7)])
    return folder


def make_prompts(n: int = N_PROMPTS) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(1234)
    return [" ".join(f"w{j}" for j in rng.integers(0, VOCAB - 7, size=PROMPT_WORDS)) for _ in range(n)]


def write_prompts(path: Path, prompts: list[str]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return path


def train_flops(completion_len: int = MAX_NEW) -> float:
    """Model FLOPs of one update (forward + backward = 3x forward) on the padded batch: every sequence is the prompt
    plus `completion_len` positions. Layers: 2 x their weights per position; attention: 4 x heads x head_dim x
    sequence length per position (q.k and p.v over the whole row); the LM head: 2 x its weights at the completion
    positions only (where the loss reads log-probs)."""
    from posttrain.models.config import llama_like

    seqs, length = N_PROMPTS * GROUP, PROMPT_WORDS + completion_len
    layer_weights = llama_like(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=LAYERS,
                               num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD_DIM).layer_matmul_params()
    forward = seqs * length * (2 * LAYERS * layer_weights + 4 * LAYERS * HEADS * HEAD_DIM * length)
    forward += seqs * completion_len * 2 * HIDDEN * VOCAB
    return 3 * forward


# ---------------------------------------------------------------------------------------------------------------
# workers (each in its own process)
# ---------------------------------------------------------------------------------------------------------------

def run_peak(threads: int, n: int = 2048, reps: int = 5) -> dict:
    """Best-of-`reps` float32 n^3 matmul rate, under jax.jit and with torch (FLOP/s)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    jax_rate = 2 * n**3 / best

    import torch

    torch.set_num_threads(threads)
    x, y = torch.randn(n, n), torch.randn(n, n)
    x @ y
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - t)
    return {"jax": jax_rate, "torch": 2 * n**3 / best, "torch_threads": torch.get_num_threads()}


def run_ours(folder: Path, prompts_file: Path, warmup: int, steps: int, pack: bool | str | None = None) -> dict:
    from posttrain.rl.loop import load_rl_config, run_rl
    from posttrain.training import metrics as metrics_lib

    ends: list[float] = []
    orig_advance = metrics_lib.MetricsLogger.advance

    def advance(self, step):  # the end of every RL step, after its logging
        ends.append(time.perf_counter())
        return orig_advance(self, step)

    metrics_lib.MetricsLogger.advance = advance
    if os.environ.get("POSTTRAIN_COMPILE_CACHE"):  # --first-call: the persistent cache the CLI would use
        from posttrain import compile_cache

        compile_cache.enable()
    total = warmup + steps
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_rl_config(None, [
            f"output_dir={tmp}/rl", f"model.path={folder}", f"data.train={prompts_file}",
            f"rollout.batch_prompts={N_PROMPTS}", f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={MAX_NEW}",
            "rollout.temperature=1.0", "algorithm.preset=grpo", "algorithm.beta=0.0",
            f"rewards.functions=[{{name: '{REWARD_REF}'}}]", "rewards.correctness=null", "rewards.num_workers=0",
            f"optim.lr={LR}", "optim.decay=constant", "optim.weight_decay=0.0", "optim.clip_norm=1.0",
            f"trainer.max_steps={total}", "trainer.save_every=0", "trainer.progress=false", "eval.at_start=false",
            "export_hf=false", "data.chat=false",
        ] + ([] if pack is None else ["learner.share_prompts=true"] if pack == "shared"
             else [f"learner.pack={str(pack).lower()}", "learner.share_prompts=false"]))
        t_start = time.perf_counter()
        result = run_rl(cfg)
        t_total = time.perf_counter() - t_start
    h = result.history
    if len(h) != total or len(ends) != total:
        raise RuntimeError(f"expected {total} steps, history has {len(h)}, step ends {len(ends)}")
    timed = h[warmup:]
    wall = [ends[i] - ends[i - 1] for i in range(warmup, total)]  # warmup >= 1 (or the --first-call run)
    return {
        "step": wall,
        "rollout": [r["time/rollout_s"] for r in timed],
        "train": [r["time/train_s"] for r in timed],
        "sum": [r["time/rollout_s"] + r["time/train_s"] for r in timed],
        "warmup": [r["time/rollout_s"] + r["time/train_s"] for r in h[:warmup]],
        "length_mean": statistics.mean(r["completion/length_mean"] for r in timed),
        "truncated": statistics.mean(r["completion/truncated_fraction"] for r in timed),
        "reward_mean": statistics.mean(r["reward/mean"] for r in timed),
        "loss": timed[-1]["loss"],
        "run_rl_s": t_total,
        # packed runs: real tokens and the cells the update's forward computed, packed / padded (timed steps)
        **{k: sum(r[f"pack/{k}"] for r in timed) for k in ("tokens", "packed_cells", "padded_cells")
           if f"pack/{k}" in timed[0]},
    }


def run_trl(folder: Path, prompts: list[str], warmup: int, steps: int, threads: int, checkpointing: bool) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(HERE))
    from _bench_rewards import reward

    torch.set_num_threads(threads)
    total = warmup + steps
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    gen_s: list[float] = []
    orig_generate = model.generate

    def timed_generate(*a, **k):  # instance attribute: the trainer's unwrapped model is this very object on CPU
        t = time.perf_counter()
        out = orig_generate(*a, **k)
        gen_s.append(time.perf_counter() - t)
        return out

    model.generate = timed_generate

    step_s: list[float] = []
    logs: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:  # the per-step training log (completion lengths, rewards, loss)
                logs_out.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    logs_out = logs

    def trl_reward(prompts, completions, **kw):
        return reward(prompts, completions)

    ds = datasets.Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(N_PROMPTS * total)]})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=N_PROMPTS * GROUP, num_generations=GROUP,
            gradient_accumulation_steps=1, num_iterations=1, max_completion_length=MAX_NEW, temperature=1.0,
            beta=0.0, loss_type="grpo", scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=total, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=0, disable_tqdm=True,
            dataloader_num_workers=0, log_completions=False,
            activation_checkpointing=checkpointing,  # GRPOConfig's default is True; ours recomputes nothing
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[Clock()])
        if args.generation_batch_size != N_PROMPTS * GROUP or args.steps_per_generation != 1:
            raise RuntimeError(f"TRL batch is not {N_PROMPTS} x {GROUP} per step: generation_batch_size="
                               f"{args.generation_batch_size}, steps_per_generation={args.steps_per_generation}")
        rollout_s: list[float] = []
        orig_gas = trainer._generate_and_score_completions

        def timed_gas(*a, **k):
            t = time.perf_counter()
            out_ = orig_gas(*a, **k)
            rollout_s.append(time.perf_counter() - t)
            return out_

        trainer._generate_and_score_completions = timed_gas
        trainer.train()
    if not (len(step_s) == len(rollout_s) == len(gen_s) == total):
        raise RuntimeError(f"expected {total} steps/rollouts/generate calls, got {len(step_s)}/{len(rollout_s)}/"
                           f"{len(gen_s)}")
    timed_logs = logs[warmup:] if len(logs) == total else logs

    def mean_of(key):
        vals = [lg[key] for lg in timed_logs if key in lg]
        return statistics.mean(vals) if vals else float("nan")

    return {
        "step": step_s[warmup:],
        "rollout": rollout_s[warmup:],
        "generate": gen_s[warmup:],
        "train": [s - r for s, r in zip(step_s[warmup:], rollout_s[warmup:])],
        "warmup": step_s[:warmup],
        "length_mean": mean_of("completions/mean_length"),
        "truncated": mean_of("completions/clipped_ratio"),
        "reward_mean": mean_of("reward"),
        "loss": timed_logs[-1].get("loss", float("nan")) if timed_logs else float("nan"),
        "torch_threads": torch.get_num_threads(),
        "checkpointing": bool(args.activation_checkpointing),
        "log_keys": sorted(timed_logs[-1]) if timed_logs else [],
    }


def worker(kind: str, folder: Path, warmup: int, steps: int, threads: int, checkpointing: bool = False) -> dict:
    load0 = os.getloadavg()[0]
    if kind == "peak":
        out = run_peak(threads)
    elif kind.startswith("ours"):  # ours (defaults), ours-packed / ours-padded (learner.pack=true / false, no
        # shared prompts), ours-shared (learner.share_prompts=true)
        pack = {"ours": None, "ours-packed": True, "ours-padded": False, "ours-shared": "shared"}[kind]
        out = run_ours(folder, folder / "prompts.jsonl", warmup, steps, pack)
    else:
        prompts = [json.loads(line)["prompt"] for line in (folder / "prompts.jsonl").read_text().splitlines()]
        out = run_trl(folder, prompts, warmup, steps, threads, checkpointing)
    out["loadavg"] = [load0, os.getloadavg()[0]]  # 1-minute load average when the worker started and ended
    return out


def _merge(a: dict, b: dict) -> dict:
    """Pools two rounds of one side: per-step lists concatenated, per-run means averaged, load range kept."""
    out = {}
    for k, v in a.items():
        if isinstance(v, list) and k != "log_keys":
            out[k] = v + b[k]
        elif isinstance(v, float) and k in ("length_mean", "truncated", "reward_mean"):
            out[k] = (v + b[k]) / 2
        else:
            out[k] = b[k]
    return out


def _spawn(kind: str, folder: Path, warmup: int, steps: int, threads: int, checkpointing: bool = False,
           env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--folder", str(folder), "--warmup",
                           str(warmup), "--steps", str(steps), "--torch-threads", str(threads)]
                          + (["--trl-checkpointing"] if checkpointing else []), capture_output=True, text=True,
                          env=env, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=2,
                   help="warm-up steps per side, not timed (>= 1; ours: includes the compiles)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side, after the warm-up")
    p.add_argument("--no-trl", action="store_true", help="skip TRL")
    p.add_argument("--no-ours", action="store_true", help="skip posttrain")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul-rate measurement")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternating rounds (ours, TRL, ours, TRL, ...), each a fresh process with its own warm-up; "
                        "the timed steps of all rounds are pooled (evens out a machine whose load drifts)")
    p.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                   help="torch.set_num_threads for TRL and the torch matmul (default: all cores)")
    p.add_argument("--trl-checkpointing", action="store_true",
                   help="keep GRPOConfig's default activation (gradient) checkpointing on for TRL (off by default)")
    p.add_argument("--first-call", action="store_true",
                   help="also time our first GRPO step in fresh processes, cold and with a warm compilation cache")
    p.add_argument("--pack", action="store_true",
                   help="run ours twice per round, learner.pack=false then true (interleaved), and report both "
                        "with the padding the packed update saved")
    p.add_argument("--share-prompts", action="store_true",
                   help="as --pack, with learner.share_prompts=true (shared-prompt rows) in place of learner.pack=true")
    p.add_argument("--worker", choices=["ours", "ours-packed", "ours-padded", "ours-shared", "trl", "peak"],
                   help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker and (args.steps < 1 or args.warmup < 1 or args.rounds < 1):
        p.error("--steps, --warmup and --rounds must be >= 1 (the first step holds our compiles and TRL's "
                "first-call costs)")
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.folder, args.warmup, args.steps, args.torch_threads,
                                               args.trl_checkpointing)), flush=True)
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=150)  # a pipe: wide enough for the table
    t0 = time.perf_counter()
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "bench-llama")
        write_prompts(folder / "prompts.jsonl", make_prompts())
        peak = None if args.no_peak else _spawn("peak", folder, 0, 0, args.torch_threads)
        first = {}
        if args.first_call:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "POSTTRAIN_COMPILE_CACHE": cache}
                for kind in ("cold", "warm"):
                    r = _spawn("ours", folder, 1, 1, args.torch_threads, env=env)
                    first[kind] = (r["warmup"][0], r["sum"][0], r["run_rl_s"])
                    console.print(f"first GRPO step (rollout + train), fresh process, {kind} compilation cache: "
                                  f"{first[kind][0]:.2f} s (second step {first[kind][1]:.2f} s; whole run_rl "
                                  f"{first[kind][2]:.1f} s)")
        ours = (["ours-padded", "ours-shared"] if args.share_prompts else ["ours-padded", "ours-packed"] if args.pack
                else ["ours"])
        kinds = [k for k, skip in ((o, args.no_ours) for o in ours) if not skip] + ([] if args.no_trl else ["trl"])
        for rnd in range(args.rounds):
            for kind in kinds:
                console.print(f"round {rnd + 1}/{args.rounds}, {kind}: {args.warmup} warm-up + {args.steps} timed "
                              f"steps ...")
                t = time.perf_counter()
                r = _spawn(kind, folder, args.warmup, args.steps, args.torch_threads, args.trl_checkpointing)
                res[kind] = r if kind not in res else _merge(res[kind], r)
                console.print(f"  {kind} done in {time.perf_counter() - t:.0f} s; median step "
                              f"{statistics.median(r['step']):.3f} s (load avg {r['loadavg'][0]:.1f} -> "
                              f"{r['loadavg'][1]:.1f})")

    med = statistics.median
    platform = os.environ.get("JAX_PLATFORMS") or "cpu"
    table = Table(title=f"GRPO step, {platform} float32: Llama-shaped vocab {VOCAB}, hidden {HIDDEN}, mlp {INTER}, "
                        f"{LAYERS} layers, {HEADS}/{KV} heads x {HEAD_DIM}; {N_PROMPTS} prompts x {GROUP} "
                        f"completions <= {MAX_NEW} new tokens; beta 0; 1 update/step. Medians of {args.steps} "
                        f"steps after {args.warmup} warm-up" + (f", x {args.rounds} rounds" if args.rounds > 1 else ""))
    for col in ("system", "s/step", "min s/step", "rollout s", "(generate s)", "train s", "rollout %",
                "compl. len", "truncated", "reward", "warm-up s", "load avg"):
        table.add_column(col, justify="left" if col == "system" else "right")
    names = {"ours": "posttrain run_rl (JAX)", "ours-padded": "posttrain, padded batch",
             "ours-packed": "posttrain, packed batch", "ours-shared": "posttrain, shared-prompt rows",
             "trl": "TRL GRPOTrainer (torch)"}
    for kind, r in res.items():
        s, ro, tr = med(r["step"]), med(r["rollout"]), med(r["train"])
        gen = f"{med(r['generate']):.2f}" if "generate" in r else "-"
        table.add_row(names[kind], f"{s:.2f}", f"{min(r['step']):.2f}", f"{ro:.2f}", gen, f"{tr:.2f}",
                      f"{ro / (ro + tr):.0%}", f"{r['length_mean']:.1f}", f"{r['truncated']:.0%}",
                      f"{r['reward_mean']:.3f}", ", ".join(f"{x:.1f}" for x in r["warmup"]),
                      f"{min(r['loadavg']):.1f}..{max(r['loadavg']):.1f}")
    console.print(table)
    notes = []
    for kind in [k for k in res if k.startswith("ours")]:
        o = res[kind]
        notes.append(f"{kind}: s/step = wall-clock between step ends; rollout / train = the loop's time/rollout_s / "
                     f"time/train_s (median sum {med(o['sum']):.2f} s); whole run_rl incl. model load and compiles "
                     f"{o['run_rl_s']:.0f} s; last loss {o['loss']:.3g}.")
    if "trl" in res:
        r = res["trl"]
        notes.append(f"TRL: s/step from a TrainerCallback (on_step_begin -> on_step_end); rollout = time inside "
                     f"GRPOTrainer._generate_and_score_completions (generate + decode + rewards + advantages), "
                     f"(generate) = model.generate alone (wrapped on the model instance); train = step - rollout. "
                     f"torch threads {r['torch_threads']}; activation checkpointing "
                     f"{'on' if r['checkpointing'] else 'off'}; last loss {r['loss']:.3g}.")
    if peak and "ours" in res:
        flops, tr = train_flops(), med(res["ours"]["train"])
        notes.append(f"ours, the update: {flops / 1e9:.1f} GFLOP (forward + backward on {N_PROMPTS * GROUP} x "
                     f"{PROMPT_WORDS + MAX_NEW} positions, the LM head on the completions' only) in {tr:.2f} s = "
                     f"{flops / tr / 1e9:.0f} GFLOP/s, {flops / tr / peak['jax']:.0%} of jax's 2048^3 matmul rate; "
                     f"at 100% of it the update would take {flops / peak['jax']:.2f} s.")
    if peak:
        notes.append(f"float32 2048^3 matmul: jax.jit {peak['jax'] / 1e9:.0f} GFLOP/s, torch "
                     f"{peak['torch'] / 1e9:.0f} GFLOP/s ({peak['torch_threads']} threads); {os.cpu_count()} CPU "
                     f"cores. load avg = range of the 1-minute load average at the start and end of each side's run "
                     f"(above {os.cpu_count()}: other processes were competing for the cores).")
    for kind, r in res.items():
        notes.append(f"{kind} timed steps (s): " + ", ".join(f"{x:.2f}" for x in r["step"]))
    busiest = max((max(r["loadavg"]) for r in res.values()), default=0.0)
    if busiest > (os.cpu_count() or 1):
        notes.append(f"WARNING: the load average reached {busiest:.1f} on {os.cpu_count()} cores: other processes "
                     "were competing for the CPU, and a multi-threaded torch (OpenMP) suffers far more from that than "
                     "a single-threaded one; compare with --torch-threads 1, or rerun on an idle machine.")
    notes.append(f"total benchmark time {time.perf_counter() - t0:.0f} s.")
    for kind, (f0, f1, total) in first.items():
        notes.append(f"ours, first step in a fresh process, {kind} compilation cache: {f0:.2f} s (then {f1:.2f} s)")
    for kp in [k for k in ("ours-packed", "ours-shared") if k in res]:
        k = res[kp]
        saved = 1 - k["packed_cells"] / k["padded_cells"]
        notes.append(f"{kp}: {k['tokens']} tokens computed in {k['packed_cells']} cells packed vs "
                     f"{k['padded_cells']} padded ({saved:.0%} of the padded forward's cells saved; fill "
                     f"{k['tokens'] / k['packed_cells']:.0%} packed, {k['tokens'] / k['padded_cells']:.0%} padded)")
        if "ours-padded" in res:
            p_, k_ = res["ours-padded"], res[kp]
            notes.append(f"{kp} / ours-padded, same run (medians): train s {med(k_['train']) / med(p_['train']):.2f}, "
                         f"step s {med(k_['step']) / med(p_['step']):.2f}")
    for n in notes:
        console.print(n)
    for o in [k for k in ("ours", "ours-padded", "ours-packed", "ours-shared") if k in res]:
        if "trl" in res:
            ratio = med(res["trl"]["step"]) / med(res[o]["step"])
            print(f"ratio (TRL s/step / {o} s/step): {ratio:.2f} (target >= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
