"""Benchmark: packed vs padded RL batches (`learner.pack`) on the demo's task, whose completion lengths vary
(a short SFT teaches both styles: `7+15=22,22+9=31 #### 31` and `#### 31`).

Set-up, once: the demo's data, base model and a short SFT stage (`posttrain.demo.run`'s configs, `--sft-steps`
steps). Then `--rounds` rounds of two fresh processes, `learner.pack=false` then `true`, each running the demo's
RL config (GRPO, 16 prompts x 8 samples, <= 32 new tokens; held-out evaluation off) for `--warmup` + `--steps`
steps. Reported per side: the median of the loop's `time/train_s` (the update: log-prob passes and optimizer
steps) and of rollout + train over the timed steps, the warm-up steps' train seconds (compiles included), and
for the packed side the real tokens and the cells (rows x columns) the update's forward computed, packed and
padded. The 1-minute load average at the start and end of each run is printed: on a shared machine compare
within one run only.

`--micro REPS` times the update alone instead (`micro`): one process, the padded, packed and shared-prompt layouts
alternating, on synthetic groups; `--size 0.5b --prompt-len P --comp LOW HIGH` sets the model and the workload
(`benchmarks/gpu_kit.py` runs it so on a GPU).

    python benchmarks/bench_rl_pack.py [--sft-steps 150] [--warmup 2] [--steps 6] [--rounds 2] [--beta 0.0]
    python benchmarks/bench_rl_pack.py --micro 5 [--size small|0.5b] [--prompts 8 --group 4]
                                       [--prompt-len 256 --comp 32 512] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prepare(out: Path, sft_steps: int, seed: int = 0) -> Path:
    """The demo's data, base model and a short SFT; returns the SFT export."""
    import yaml

    from posttrain.demo.run import DemoSettings, build_base_model, sft_config
    from posttrain.demo.task import make_splits, write_jsonl
    from posttrain.training.sft import load_sft_config, run_sft

    s = DemoSettings(sft_steps=sft_steps)
    train, heldout = make_splits(seed, s.n_train + s.n_rl_prompts, s.n_eval, max_operand=s.max_operand,
                                 direct_fraction=s.direct_fraction)
    write_jsonl(train[: s.n_train], out / "data" / "sft_train.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in train[s.n_train:]],
                out / "data" / "rl_prompts.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in heldout], out / "data" / "heldout.jsonl")
    cfg = sft_config(out, build_base_model(out, s, seed), s, seed)
    cfg["trainer"]["progress"] = False
    (out / "sft.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return Path(run_sft(load_sft_config(out / "sft.yaml")).hf_dir)


def worker(out: Path, model: Path, pack: bool, steps: int, beta: float) -> dict:
    import yaml

    from posttrain.demo.run import DemoSettings, rl_config
    from posttrain.rl.loop import load_rl_config, run_rl

    import posttrain.rl.learner as learner_lib

    shapes = set()  # the distinct packed shapes (each compiles the update once)
    pack_fn = learner_lib.pack_rl_batch

    def recording(batch, **kw):
        packed, layout = pack_fn(batch, **kw)
        shapes.add((packed.input_ids.shape, packed.token_src.shape[1], packed.loss_mask.shape[1:]))
        return packed, layout

    learner_lib.pack_rl_batch = recording
    load0 = os.getloadavg()[0]
    s = DemoSettings(rl_steps=steps)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        cfg = rl_config(Path(tmp), model, s, 0)
        cfg["data"]["train"] = str(out / "data" / "rl_prompts.jsonl")
        cfg["data"].pop("eval")
        cfg["eval"] = {"every": 0, "at_start": False}
        cfg["algorithm"]["beta"] = beta
        cfg["learner"] = {"pack": pack, "share_prompts": False}
        cfg["trainer"].update(progress=False, save_every=0)
        cfg["export_hf"] = False
        (Path(tmp) / "rl.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        h = run_rl(load_rl_config(Path(tmp) / "rl.yaml")).history
    keys = ("tokens", "packed_cells", "padded_cells")
    return {"train": [r["time/train_s"] for r in h], "rollout": [r["time/rollout_s"] for r in h],
            "length": [r["completion/length_mean"] for r in h], "reward": [r["reward/mean"] for r in h],
            "cells": [{k: r[f"pack/{k}"] for k in keys} for r in h] if pack else None,
            "loadavg": [load0, os.getloadavg()[0]], "shapes": sorted(map(str, shapes))}


MICRO_WORKLOADS = {  # name: (prompt length, completion lengths low..high)
    "equal": (32, (64, 64)),  # bench_grpo's shapes: nothing to pack away, a prompt to share
    "varied": (32, (4, 64)),
}


def micro(reps: int, *, size: str = "small", prompts: int = 8, group: int = 4, prompt_len: int | None = None,
          comp: tuple[int, int] | None = None, seed: int = 0, json_path: Path | None = None) -> dict:
    """The update alone, in one process, the three layouts alternating (A/B/C/A/B/C: robust to a drifting load):
    `padded` (`learner.pack: false, share_prompts: false`), `packed` (sequence rows) and `shared`
    (`learner.share_prompts`: the cheaper of sequence rows and shared-prompt rows). Model: `bench_accel`'s `--size`
    shapes (small: the GRPO benchmark's vocab 8192, hidden 256, 4 layers; 0.5b: 0.45B parameters), float32
    weights, bfloat16 compute off the CPU.
    Batch: `prompts` x `group` synthetic sequences with prompts of `prompt_len` tokens and completions drawn
    uniformly from `comp` = (low, high); without them, the two `MICRO_WORKLOADS`. GRPO loss, one minibatch, old
    log-probs taken from the batch (no recompute), no reference."""
    import time

    import jax
    import numpy as np

    from bench_accel import SHAPES
    from posttrain.models import init_model
    from posttrain.models.config import llama_like
    from posttrain.rl.batch import build_rl_batch
    from posttrain.rl.learner import Learner
    from posttrain.rl.loss import make_rl_loss
    from posttrain.rl.packing import attention_span
    from posttrain.rollout.rollouts import Rollouts
    from posttrain.training.config import OptimConfig
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer

    compute = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    workloads = MICRO_WORKLOADS if prompt_len is None else {"custom": (prompt_len, tuple(comp or (64, 64)))}
    cfg = llama_like(**SHAPES[size], param_dtype="float32", compute_dtype=compute,
                     max_position_embeddings=max(p + c[1] for p, c in workloads.values()) + 16)
    rng = np.random.default_rng(seed)
    n = prompts * group
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.2, "aggregation": "seq_mean_token_mean",
          "max_tokens": max(c[1] for _, c in workloads.values())}
    report = {"size": size, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
              "compute_dtype": compute, "sequences": n, "workloads": {}}
    for name, (plen, (lo, hi)) in workloads.items():
        comps = [rng.integers(3, cfg.vocab_size, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
        group_prompts = [rng.integers(3, cfg.vocab_size, size=plen).tolist() for _ in range(prompts)]
        ro = Rollouts(group_size=group, record_index=[i // group for i in range(n)],
                      prompt_ids=[group_prompts[i // group] for i in range(n)], completion_ids=comps,
                      logprobs=[[-1.0] * len(c) for c in comps], finish_reasons=["stop"] * n, texts=[""] * n,
                      prompts_text=[""] * n, rewards=np.zeros(n, np.float32), per_reward={}, reward_stats={})
        batch = build_rl_batch(ro, rng.normal(size=n).astype(np.float32))
        layouts = {"padded": dict(pack=False), "packed": dict(pack=True),
                   "shared": dict(pack=True, attn_span=attention_span(cfg))}
        learners = {}
        for layout, opts in layouts.items():
            tx = make_optimizer(OptimConfig(name="adamw", lr=1e-5, decay="constant"), 1000)[0]
            learners[layout] = Learner(Trainer(init_model(cfg, seed=0), tx), make_rl_loss(kw), ppo_epochs=1,
                                       minibatches=1, seed=0, recompute_old=False, **opts)
        times: dict[str, list[float]] = {k: [] for k in learners}
        first: dict[str, float] = {}
        metrics: dict[str, dict] = {}
        for rep in range(reps + 1):
            for layout, learner in learners.items():
                t = time.perf_counter()
                metrics[layout] = learner.update(batch, rep)
                if rep:
                    times[layout].append(time.perf_counter() - t)
                else:  # the first call holds the compile
                    first[layout] = time.perf_counter() - t
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = {k: int(metrics[k].get("pack/packed_cells", metrics["packed"]["pack/padded_cells"])) for k in learners}
        tokens = int(metrics["packed"]["pack/tokens"])
        report["workloads"][name] = {"prompt_len": plen, "completion_lengths": [lo, hi], "tokens": tokens,
                                     "median_s": med, "first_s": first, "cells": cells,
                                     "loss": {k: float(metrics[k]["loss"]) for k in learners}}
        print(f"{name} (prompt {plen}, completions {lo}..{hi}, {n} sequences, {size}, {compute} on "
              f"{report['device']}): update median " + ", ".join(
                  f"{k} {med[k]:.3f} s ({med[k] / med['padded']:.2f}x padded; {cells[k]} cells)" for k in learners)
              + f"; {tokens} real tokens; first call (compile) " + ", ".join(f"{k} {v:.1f} s" for k, v in first.items())
              + f"; load avg {os.getloadavg()[0]:.1f}", flush=True)
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds the reference pass)")
    p.add_argument("--size", choices=["small", "0.5b"], default="small", help="--micro: the model's shape")
    p.add_argument("--prompts", type=int, default=8, help="--micro: prompts (groups) in the batch")
    p.add_argument("--group", type=int, default=4, help="--micro: completions per prompt")
    p.add_argument("--prompt-len", type=int, help="--micro: prompt tokens (with --comp: one custom workload)")
    p.add_argument("--comp", type=int, nargs=2, metavar=("LOW", "HIGH"), help="--micro: completion lengths")
    p.add_argument("--json", type=Path, help="--micro: also write the figures to this file")
    p.add_argument("--micro", type=int, metavar="REPS", default=0,
                   help="instead: time the update alone, the padded, packed and shared-prompt layouts "
                        "alternating, REPS times each")
    p.add_argument("--worker", choices=["packed", "padded"], help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.micro:
        micro(a.micro, size=a.size, prompts=a.prompts, group=a.group, prompt_len=a.prompt_len,
              comp=tuple(a.comp) if a.comp else None, json_path=a.json)
        return 0
    if a.worker:
        r = worker(a.dir, a.model, a.worker == "packed", a.warmup + a.steps, a.beta)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    med = statistics.median
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = prepare(out, a.sft_steps)
        res: dict[str, list[dict]] = {"padded": [], "packed": []}
        for rnd in range(a.rounds):
            for kind in ("padded", "packed"):
                proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--dir", str(out), "--model",
                                       str(model), "--warmup", str(a.warmup), "--steps", str(a.steps), "--beta",
                                       str(a.beta)], capture_output=True, text=True, check=False)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not lines:
                    raise RuntimeError(f"{kind} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                r = json.loads(lines[-1][len("RESULT "):])
                res[kind].append(r)
                w = a.warmup
                print(f"round {rnd + 1} {kind}: train s median {med(r['train'][w:]):.3f} (warm-up "
                      f"{', '.join(f'{x:.1f}' for x in r['train'][:w])}), rollout+train median "
                      f"{med([x + y for x, y in zip(r['train'][w:], r['rollout'][w:])]):.3f}, completion length "
                      f"{statistics.mean(r['length'][w:]):.1f}, load avg {r['loadavg'][0]:.1f} -> "
                      f"{r['loadavg'][1]:.1f}" + (f"; {len(r['shapes'])} packed shapes" if r["shapes"] else ""),
                      flush=True)
    w = a.warmup
    train = {k: med([x for r in v for x in r["train"][w:]]) for k, v in res.items()}
    cells = [c for r in res["packed"] for c in r["cells"][w:]]
    tok, packed, padded = (sum(c[k] for c in cells) for k in ("tokens", "packed_cells", "padded_cells"))
    print(f"update (time/train_s) median over {a.rounds} rounds x {a.steps} steps: padded {train['padded']:.3f} s, "
          f"packed {train['packed']:.3f} s (packed / padded {train['packed'] / train['padded']:.2f})")
    print(f"packed update: {tok} real tokens, {packed} cells packed vs {padded} padded: {1 - packed / padded:.0%} "
          f"of the padded cells saved (fill {tok / packed:.0%} packed, {tok / padded:.0%} padded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
