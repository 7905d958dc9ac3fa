"""Benchmark: GRPO on a tiny mixture of experts with and without routing replay (`learner.routing_replay`).

The model is built like the demo's (`posttrain.demo.run.build_base_model`: the demo's character tokenizer, a
small Llama shape) but as a Qwen3-MoE: every layer's MLP is `--experts` experts of width `--expert-width`, top-2,
renormalised. It is trained briefly with SFT on the demo's task (`posttrain.demo.task`: chained additions with
the answer after `####`; the demo's SFT config), then GRPO starts from that export once per variant, with the same
seed, prompts and steps: per compute dtype (float32, and bfloat16 activations, where the sampler's one-token decode
steps and the trainer's whole-sequence forward round differently and routers flip near ties), replay off and on.
The learner recomputes the old log-probs (`learner.old_logprobs=recompute`), so every step logs `mismatch_kl`
(k3 estimate of KL(sampler || trainer) per token at the same weights: what replay is meant to shrink) and, under
replay, `moe/router_agreement` (the fraction of token-layer choices where the trainer's own router picked the
sampler's experts; not measured without replay). Printed per run: mean agreement and mismatch KL over the steps,
the mismatch KL of step 1 (the same weights and the same rollouts in both runs of a dtype: the like-for-like
figure; later steps train slightly different weights), the mean reward of the first and last quarter of the steps,
and the greedy held-out accuracy at the end (the demo's evaluator).

Everything runs through `run_sft` / `run_rl` (the code paths of `posttrain sft` / `posttrain rl`), each stage's
config written as YAML into the output folder. Sized for ~10 minutes on 2 CPU cores with the defaults:

    python benchmarks/bench_routing_replay.py [--out DIR] [--seed 0] [--sft-steps 200] [--rl-steps 12]
                                              [--dtypes float32,bfloat16] [--experts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import yaml

from posttrain.demo.run import DemoSettings, rl_config, sft_config, write_demo_data
from posttrain.models.config import llama_like
from posttrain.models.hf_io import save_pretrained
from posttrain.models.tokenizer import build_tokenizer
from posttrain.models.transformer import init_model
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.training.sft import load_sft_config, run_sft


def settings(args) -> DemoSettings:
    """The demo's sizes, shrunk to the benchmark's budget."""
    return DemoSettings(n_train=6000, n_rl_prompts=1000, n_eval=args.n_eval, hidden=args.hidden, layers=args.layers,
                        heads=4, sft_steps=args.sft_steps, sft_batch=32, sft_lr=3e-3, rl_steps=args.rl_steps,
                        rl_prompts=8, group_size=8, rl_lr=1e-4, rl_eval_every=0, max_new_tokens=24)


def build_moe_model(out: Path, s: DemoSettings, seed: int, experts: int, width: int) -> Path:
    """The demo's base model (`build_base_model`) as a Qwen3-MoE: `experts` experts of width `width`, top-2."""
    folder = out / "model_init"
    tok = build_tokenizer(folder)
    cfg = llama_like(model_type="qwen3_moe", qk_norm=True, vocab_size=tok.vocab_size, hidden_size=s.hidden,
                     intermediate_size=3 * s.hidden, num_layers=s.layers, num_heads=s.heads,
                     num_kv_heads=s.heads // 2, max_position_embeddings=256, num_experts=experts,
                     num_experts_per_tok=2, moe_intermediate_size=width, norm_topk_prob=True,
                     router_aux_loss_coef=0.001, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    save_pretrained(init_model(cfg, seed=seed), folder, tokenizer=tok)
    return folder


def grpo(out: Path, model: Path, s: DemoSettings, seed: int, dtype: str, replay: bool) -> dict:
    """One GRPO run from the SFT export; its figures (module docstring)."""
    name = f"rl_{dtype}_{'replay' if replay else 'plain'}"
    cfg = rl_config(out, model, s, seed)
    cfg["output_dir"] = str(out / name)
    cfg["model"]["compute_dtype"] = dtype
    cfg["learner"] = {"old_logprobs": "recompute", "routing_replay": replay}
    cfg["trainer"].update(save_every=0, progress=False)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.perf_counter()
    result = run_rl(load_rl_config(path))
    h = result.history
    q = max(1, len(h) // 4)
    mean = lambda key, rows=h: float(np.mean([r[key] for r in rows])) if key in rows[0] else float("nan")
    return {"dtype": dtype, "replay": replay, "agreement": mean("moe/router_agreement"),
            "mismatch_kl": mean("mismatch_kl"), "mismatch_kl_step1": float(h[0]["mismatch_kl"]),
            "reward_first": mean("reward/mean", h[:q]), "reward_last": mean("reward/mean", h[-q:]),
            "heldout_accuracy": float(result.evals[-1]["eval/accuracy"]) if result.evals else float("nan"),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--rl-steps", type=int, default=12)
    ap.add_argument("--n-eval", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=96)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_routing_replay_"))
    s = settings(args)
    t0 = time.perf_counter()
    write_demo_data(out, s, args.seed)
    base = build_moe_model(out, s, args.seed, args.experts, args.expert_width)
    sft_yaml = out / "sft.yaml"
    sft_yaml.write_text(yaml.safe_dump(sft_config(out, base, s, args.seed, seq_len=64), sort_keys=False))
    sft = run_sft(load_sft_config(sft_yaml))
    print(f"SFT: {args.sft_steps} steps in {time.perf_counter() - t0:.0f} s -> {sft.hf_dir}", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        for replay in (False, True):
            rows.append(grpo(out, Path(sft.hf_dir), s, args.seed, dtype, replay))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nGRPO on a {args.layers}-layer Qwen3-MoE ({args.experts} experts, top-2, hidden {args.hidden}), "
          f"{args.rl_steps} steps x {s.rl_prompts} prompts x {s.group_size} samples, seed {args.seed}; "
          f"total {time.perf_counter() - t0:.0f} s")
    head = ("compute", "replay", "agreement", "mismatch_kl mean", "step 1", "reward first/last q", "held-out acc", "s")
    print(" | ".join(head))
    for r in rows:
        agreement = "n/a" if np.isnan(r["agreement"]) else f"{r['agreement']:.4f}"
        print(f"{r['dtype']} | {'on' if r['replay'] else 'off'} | {agreement} | {r['mismatch_kl']:.2e} | "
              f"{r['mismatch_kl_step1']:.2e} | {r['reward_first']:.3f} / {r['reward_last']:.3f} | "
              f"{r['heldout_accuracy']:.3f} | {r['seconds']:.0f}")
    (out / "summary.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
