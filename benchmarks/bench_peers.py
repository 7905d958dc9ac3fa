"""Benchmark: the three peer ratios of one run, steady state (warm, compiles excluded), interleaved rounds.

The targets (issue 27): generation >= 2x Tunix's sampler, GRPO step >= 2x Tunix's, SFT >= 1.0x a plain
PyTorch loop. Every ratio is ours speed / peer speed (> 1: ours faster). Each measurement is a fresh process,
run by the workers of the existing benchmarks; in each round every comparison runs ours then the peer (the
order flips every other round, so slow drift of the machine's load hits both sides alike).

  * generation (`bench_first_call.py`'s workers, `bench_generate.py`'s case 1: Llama-shaped checkpoint, vocab
    8192, hidden 256, 4 layers; 16 prompts x 64 random ids, 128 new tokens, greedy, no stop, CPU float32).
    Ours: `Sampler(model, max_slots=16, max_len=192).generate`; the peer: Tunix's `tunix.generate.sampler.
    Sampler` on the same checkpoint (its rope set to the checkpoint's theta, so the greedy tokens agree).
    After the first call (compiles) the same call runs `--gen-calls` times; the figure is the median seconds
    per call.
  * GRPO (`bench_first_call.py --grpo`'s workers, `bench_grpo.py`'s work: 8 prompts x 4 samples, <= 64 new
    tokens, temperature 1, stop at eos, beta 0, one AdamW update a step). Ours: `posttrain.rl.loop.run_rl`;
    the peer: Tunix's `GRPOLearner` on an `RLCluster` (vanilla rollout). After step 1 (compiles) come
    `--grpo-steps` steps; the figure is the median wall-clock seconds between step ends (our loop's step
    ends; Tunix's global steps). Sampling is random, so mean completion lengths, which the step time follows,
    are printed beside it.
  * SFT (`bench_sft.py`'s workers: same Llama shapes, batch 8 x 256, AdamW, clipping 1.0, float32). Ours:
    `posttrain.training.trainer.Trainer`; the peer: a plain PyTorch loop on the HF model. After one warm-up
    step (our compile) `--sft-steps` steps; the figure is tokens / median step seconds.

Across rounds each side's figure is the median of its per-round figures; the per-round ratios and the
1-minute load average before -> after each process are printed too (compare within one run: the machine may
be shared). Tunix runs under `--tunix-python` (a Python where tunix 0.1.7 imports; posttrain never depends
on it); without one, generation and GRPO print "Tunix not available" and only SFT's ratio is given.

    python benchmarks/bench_peers.py [--rounds 2] [--tunix-python PY] [--only sft generate grpo] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_first_call  # noqa: E402
import bench_sft  # noqa: E402

WORKS = ("sft", "generate", "grpo")
TARGETS = {"generate": 2.0, "grpo": 2.0, "sft": 1.0}
PEERS = {"generate": "Tunix Sampler", "grpo": "Tunix GRPOLearner", "sft": "plain PyTorch loop"}
TITLES = {"generate": "generation (16 x 128 new, greedy)", "grpo": "GRPO step (8 x 4, <= 64 new)",
          "sft": f"SFT step (batch {bench_sft.BATCH} x {bench_sft.SEQ})"}


def prepare(work: str, tmp: Path) -> Path:
    """The checkpoint (and GRPO's prompts) that both sides of `work` load."""
    if work == "generate":
        from bench_generate import build_checkpoint

        return build_checkpoint(tmp / "llama-generate")
    if work == "grpo":
        return bench_first_call.grpo_prepare(tmp / "llama-grpo")
    return bench_sft.make_checkpoint(tmp / "llama-sft")


def run_side(work: str, side: str, path: Path, args, cache: str) -> dict:
    """One fresh worker process of `side` ("ours" or "peer") on `work`: its steady-state samples (seconds per
    call / step), their median, the load average around it and a few sanity fields."""
    load0 = os.getloadavg()[0]
    if work == "sft":
        r = bench_sft._spawn("ours" if side == "ours" else "torch", path, args.sft_steps)
        samples, extra = r["times"], {"loss": r["loss"]}
    else:
        python = sys.executable if side == "ours" else args.tunix_python
        env = {**os.environ, "POSTTRAIN_COMPILE_CACHE": cache}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        steady = args.gen_calls if work == "generate" else args.grpo_steps
        wargs = ["--worker", f"{work}-{'ours' if side == 'ours' else 'tunix'}", "--path", str(path),
                 "--steady", str(steady)]
        r = bench_first_call.spawn(python, wargs, env)
        samples = r.get("steady", [r["second"]])
        extra = {"first": r["first"]}
        if work == "generate":
            extra["tokens"] = r["tokens"]
        else:
            extra["completion_length"] = r["completion_length"]
    return {"samples": samples, "seconds": statistics.median(samples), "load0": load0,
            "load1": os.getloadavg()[0], **extra}


def measure(works: list[str], paths: dict[str, Path], args, console) -> dict[str, dict[str, list[dict]]]:
    """Interleaved rounds: per round and work, ours and the peer in fresh processes (order flipped on odd
    rounds). Returns runs[work][side] = one dict per round."""
    runs: dict[str, dict[str, list[dict]]] = {w: {"ours": [], "peer": []} for w in works}
    with tempfile.TemporaryDirectory() as cache:
        for rnd in range(args.rounds):
            order = ("ours", "peer") if rnd % 2 == 0 else ("peer", "ours")
            for work in works:
                for side in order:
                    r = run_side(work, side, paths[work], args, cache)
                    runs[work][side].append(r)
                    name = "ours" if side == "ours" else PEERS[work]
                    console.print(f"round {rnd + 1}/{args.rounds} {work:8s} {name:18s}: {describe(work, r)} "
                                  f"(load avg {r['load0']:.2f} -> {r['load1']:.2f})")
    return runs


def describe(work: str, r: dict) -> str:
    """One run's steady figure in the work's unit, with its sample count."""
    if work == "sft":
        return f"{tokens_per_s(r['seconds']):,.0f} tokens/s (median of {len(r['samples'])} steps)"
    unit = "call" if work == "generate" else "step"
    return f"{r['seconds']:.3f} s/{unit} (median of {len(r['samples'])}; first {r['first']:.2f} s)"


def tokens_per_s(seconds: float) -> float:
    return bench_sft.BATCH * bench_sft.SEQ / seconds


def summarize(work: str, sides: dict[str, list[dict]]) -> dict:
    """Each side's figure (median over rounds of the per-process medians), the ratio ours speed / peer speed
    and the per-round ratios."""
    ours = statistics.median(r["seconds"] for r in sides["ours"])
    peer = statistics.median(r["seconds"] for r in sides["peer"])
    per_round = [p["seconds"] / o["seconds"] for o, p in zip(sides["ours"], sides["peer"])]
    loads = [r[k] for rs in sides.values() for r in rs for k in ("load0", "load1")]
    return {"ours_s": ours, "peer_s": peer, "ratio": peer / ours, "per_round": per_round,
            "target": TARGETS[work], "met": peer / ours >= TARGETS[work], "load": [min(loads), max(loads)]}


def figure(work: str, seconds: float) -> str:
    return f"{tokens_per_s(seconds):,.0f} tok/s" if work == "sft" else f"{seconds:.3f} s"


def report(console, works: list[str], runs: dict, skipped: dict[str, str]) -> dict[str, dict]:
    """The table of the three comparisons (and the sanity notes under it); returns the summaries."""
    from rich.table import Table

    table = Table(title=f"Peers, steady state (compiles excluded), {bench_first_call.VOCAB}-vocab Llama-shaped "
                        f"4-layer model, float32, JAX on {os.environ.get('JAX_PLATFORMS', 'default')}; "
                        "ratio = ours speed / peer speed")
    for col in ("comparison", "peer", "ours", "peer figure", "ratio", "per round", "target", "met",
                "load avg (1 min)"):
        table.add_column(col, justify="left" if col in ("comparison", "peer") else "right")
    summary = {}
    for work in WORKS:
        if work in skipped:
            table.add_row(TITLES[work], PEERS[work], "-", skipped[work], "-", "-", f">= {TARGETS[work]:.1f}x", "-",
                          "-")
            continue
        if work not in works:
            continue
        s = summary[work] = summarize(work, runs[work])
        table.add_row(TITLES[work], PEERS[work], figure(work, s["ours_s"]), figure(work, s["peer_s"]),
                      f"{s['ratio']:.2f}x", " / ".join(f"{x:.2f}x" for x in s["per_round"]),
                      f">= {s['target']:.1f}x", "yes" if s["met"] else "NO",
                      f"{s['load'][0]:.1f}-{s['load'][1]:.1f}")
    console.print(table)
    for note in sanity_notes(runs):
        console.print(note)
    busy = max((x for s in summary.values() for x in s["load"]), default=0.0)
    if busy > 0.5 * (os.cpu_count() or 1):
        console.print(f"warning: load average up to {busy:.1f} on {os.cpu_count()} cores: the figures are not "
                      "quiet-machine figures (a torch loop whose threads fill every core suffers most under load)")
    return summary


def sanity_notes(runs: dict) -> list[str]:
    """Checks that both sides did the same work: greedy tokens, completion lengths, SFT losses."""
    notes = []
    if "generate" in runs:
        a, b = runs["generate"]["ours"][0]["tokens"], runs["generate"]["peer"][0]["tokens"]
        notes.append(f"generation: identical greedy sequences, ours vs Tunix: "
                     f"{sum(x == y for x, y in zip(a, b))}/{len(a)}")
    if "grpo" in runs:
        lens = {s: " / ".join(f"{r['completion_length']:.1f}" for r in rs) for s, rs in runs["grpo"].items()}
        notes.append(f"GRPO: mean completion length per round (step time follows it): ours {lens['ours']}, "
                     f"Tunix {lens['peer']}")
    if "sft" in runs:
        notes.append("SFT: last loss per round: ours " + " / ".join(f"{r['loss']:.4f}" for r in runs["sft"]["ours"])
                     + ", PyTorch loop " + " / ".join(f"{r['loss']:.4f}" for r in runs["sft"]["peer"]))
    return notes


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (fresh processes each)")
    ap.add_argument("--tunix-python", help="a Python interpreter where `tunix` imports (e.g. a venv's bin/python)")
    ap.add_argument("--only", nargs="+", choices=WORKS, default=list(WORKS), help="comparisons to run")
    ap.add_argument("--gen-calls", type=int, default=5, help="steady generate calls per process, after the first")
    ap.add_argument("--grpo-steps", type=int, default=4, help="steady GRPO steps per process, after step 1")
    ap.add_argument("--sft-steps", type=int, default=8, help="SFT steps per process, after the warm-up step")
    ap.add_argument("--json", type=Path, help="also write the summary and every run's samples here")
    args = ap.parse_args(argv)
    if min(args.rounds, args.gen_calls, args.grpo_steps, args.sft_steps) < 1:
        ap.error("--rounds, --gen-calls, --grpo-steps and --sft-steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=170)
    works = [w for w in WORKS if w in args.only]
    skipped: dict[str, str] = {}
    tunix_works = [w for w in works if w != "sft"]
    why_not = tunix_works and bench_first_call.tunix_available(args.tunix_python, "grpo" in tunix_works)
    if why_not:
        console.print(f"Tunix not available ({why_not}): generation and GRPO not measured")
        skipped = {w: "Tunix not available" for w in tunix_works}
        works = [w for w in works if w not in skipped]
    console.print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    runs: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {w: prepare(w, Path(tmp)) for w in works}
        if works:
            runs = measure(works, paths, args, console)
    summary = report(console, works, runs, skipped)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "skipped": skipped, "runs": runs,
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
