"""Agentic RL on a real model on this CPU: SmolLM2-135M-Instruct (GGUF from the package registry) learns to use
the calculator on reasoning-gym `chain_sum` with 3-4 three-digit terms, beyond its own arithmetic.

Per seed: (1) synthetic tool-use SFT conversations (`posttrain.tools.demonstrations`: a share `tool_fraction`
call the calculator on the problem's expression and copy its result into `<answer>...</answer>`, the rest
answer in one go), RL prompts, and held-out problems (a fixed set, seed 1000, disjoint from both); (2) a short
LoRA SFT (`run_sft`, the config system of `posttrain sft`); (3) multi-turn GRPO from the SFT export with the
recipe `configs/agent_chain_sum_calculator.yaml` (`run_rl`, rollout.tools=[calculator]); held-out greedy
multi-turn accuracy with the calculator of the base model, the SFT export and the RL export, tool calls per
trajectory, accuracy with and without a call, wall time per stage, seconds per RL step (generation vs
training), the share of groups with a learning signal, load average (1 min) at the start and end.

The base model's accuracy is the same for every seed (same weights, same held-out set): evaluated once and
reused (`--base-accuracy` skips it); `--sft-model DIR` starts RL from an SFT export made before. Each stage
runs in its own process (memory given back) and prints a JSON line when done. Overrides go to one stage:
`sft.optim.lr=1e-3`, `rl.rollout.temperature=1.0`; `--tool-fraction` sets the SFT mix.

    python benchmarks/bench_agent_rl.py --seeds 0 1 2 [--sft-steps N] [--rl-steps N] [--eval-n N] [sft.KEY=V rl.KEY=V ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # also in the spawned stage processes
RECIPE = REPO / "configs/agent_chain_sum_calculator.yaml"
TASK = "reasoning_gym:chain_sum?size={n}&seed={seed}&min_terms=3&max_terms=4&min_digits=3&max_digits=3"
HELDOUT_SEED = 1000


def sft_config(out: Path, seed: int, args) -> dict:
    """LoRA SFT of the base model on `out/data/sft_train.jsonl` (303-373 tokens a conversation, one a 384-token
    row: longer packed rows cost quadratic attention time and memory for nothing)."""
    return {
        "output_dir": str(out / "sft"),
        "model": {"path": "pypi:smollm2-135m-instruct", "param_dtype": "float32", "scan_layers": True},
        "data": {"train": str(out / "data" / "sft_train.jsonl"), "seq_len": 384, "batch_size": args.sft_batch,
                 "pack": True, "seed": seed, "format": {"format": "messages"}},
        "optim": {"name": "adamw", "lr": args.sft_lr, "warmup_steps": max(1, args.sft_steps // 10),
                  "decay": "cosine", "min_lr_ratio": 0.1, "clip_norm": 1.0},
        "trainer": {"max_steps": args.sft_steps, "log_every": 5, "save_every": args.sft_steps, "keep_checkpoints": 1,
                    "seed": seed, "resume": False},
        "lora": {"enabled": True, "rank": 16, "alpha": 32},
        "export_hf": True,
    }


def stage_overrides(overrides: list[str], prefix: str) -> list[str]:
    return [o[len(prefix) + 1:] for o in overrides if o.startswith(prefix + ".")]


def rl_overrides(out: Path, seed: int, args, model: str = "pypi:smollm2-135m-instruct") -> list[str]:
    return [f"output_dir={out / 'rl'}", f"model.path={model}", f"data.train={out / 'data' / 'rl_prompts.jsonl'}",
            "data.eval=null", f"data.seed={seed}", f"trainer.seed={seed}", f"trainer.max_steps={args.rl_steps}",
            "trainer.resume=false", f"trainer.save_every={args.rl_steps}", *stage_overrides(args.overrides, "rl")]


def write_data(out: Path, seed: int, args, system_prompt: str) -> dict:
    """SFT conversations and RL prompts from seed-dependent reasoning-gym sets, the fixed held-out set; no
    held-out prompt in either."""
    from posttrain.data.reasoning_gym import records
    from posttrain.tools.demonstrations import mixed_conversations

    heldout = records(TASK.format(n=args.eval_n, seed=HELDOUT_SEED))
    seen = {r["prompt"] for r in heldout}
    sft = [r for r in records(TASK.format(n=args.sft_examples, seed=10 + seed)) if r["prompt"] not in seen]
    rl = [r for r in records(TASK.format(n=args.rl_prompts, seed=20 + seed)) if r["prompt"] not in seen]
    convs = mixed_conversations(sft, args.tool_fraction, seed=seed, system_prompt=system_prompt)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("sft_train", convs), ("rl_prompts", rl), ("heldout", heldout)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"sft_conversations": len(convs), "sft_with_call": sum(len(c["messages"]) > 3 for c in convs),
            "rl_prompts": len(rl), "heldout": len(heldout)}


def evaluate_model(path: str | Path, cfg, heldout: Path) -> dict:
    """Greedy multi-turn held-out accuracy with the recipe's tools and limits; tool calls per trajectory, the
    share of trajectories with a call, accuracy with and without one, tool errors, an example."""
    import numpy as np

    from posttrain.agent.setup import build_agent
    from posttrain.data import read_prompts
    from posttrain.eval.evaluate import evaluate
    from posttrain.rewards.runner import RewardRunner, RewardSpec
    from posttrain.rollout.policy import Policy
    from posttrain.rollout.prompts import PromptSet
    from posttrain.rollout.rollouts import correct

    policy = Policy.open(str(path), mesh=None, max_slots=cfg.rollout.max_slots or 32)
    records = read_prompts(str(heldout))
    agent = build_agent(cfg.rollout, policy.tokenizer, system_prompt=cfg.data.system_prompt)
    try:
        ids = [agent.prompt_ids(agent.first_messages(r)) for r in records]
        with RewardRunner([RewardSpec("reasoning_gym")], num_workers=1) as runner:
            e = evaluate(policy, PromptSet.of(records, ids), runner, correctness="reasoning_gym",
                         max_new_tokens=cfg.rollout.max_new_tokens, agent=agent)
    finally:
        agent.close()
    g = e["_greedy"]
    ok = np.asarray(correct(g, "reasoning_gym"), bool)
    called = np.array([t["num_tool_calls"] > 0 for t in g.trajectories], bool)
    return {"accuracy": round(float(ok.mean()), 4), "tool_calls": round(e.get("eval/tool_calls_mean", 0.0), 3),
            "call_rate": round(float(called.mean()), 3),
            "accuracy_with_call": round(float(ok[called].mean()), 3) if called.any() else None,
            "accuracy_without_call": round(float(ok[~called].mean()), 3) if (~called).any() else None,
            "tool_errors": int(sum(t["tool_errors"] for t in g.trajectories)),
            "example": g.trajectories[0]["messages"][-3:]}


def rl_summary(res) -> dict:
    """Seconds per step (generation, training), groups with signal, train reward and tool calls first/last."""
    h = res.history

    def mean(key):
        return round(sum(x[key] for x in h) / max(len(h), 1), 2)

    def ends(key):
        return [round(h[0][key], 3), round(h[-1][key], 3)] if h and key in h[0] else None

    return {"rl_steps": res.steps, "generation_s_per_step": mean("time/rollout_s"),
            "training_s_per_step": mean("time/train_s"), "groups_with_signal_mean": mean("groups/with_signal"),
            "train_reward_first_last": ends("reward/mean"), "train_tool_calls_first_last": ends("agent/tool_calls_mean")}


def _child(fn, args, conn) -> None:
    """Runs in the stage's process: sends (result, CPU seconds) or the traceback, then exits at once (the tool
    and reward pools' threads would keep the interpreter from exiting; every file is written by then)."""
    import traceback

    c = time.process_time()
    try:
        conn.send(("ok", fn(*args), round(time.process_time() - c, 1)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        conn.send(("error", traceback.format_exc(), 0.0))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def in_fresh_process(fn, *args):
    """`fn(*args)` in a fresh (spawned) process, so that each stage's memory is given back (one process for all
    of them grew past 13 GB, beyond this 24 GB machine's share); the result, wall seconds and the child's CPU
    seconds (all threads: on a shared machine they estimate a quiet machine's wall time, over ~1.3 busy cores)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    t = time.perf_counter()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, args, child))
    proc.start()
    child.close()
    try:
        status, out, cpu = parent.recv()
    except EOFError:
        status, out, cpu = "error", f"the stage's process died (exit code {proc.join() or proc.exitcode})", 0.0
    proc.join()
    if status != "ok":
        raise RuntimeError(f"stage {fn.__name__} failed:\n{out}")
    return out, round(time.perf_counter() - t, 1), cpu


def evaluate_stage(path: str, seed: int, args, heldout: Path) -> dict:
    from posttrain.rl.loop import load_rl_config

    return evaluate_model(path, load_rl_config(RECIPE, rl_overrides(Path(args.out) / f"seed{seed}", seed, args)), heldout)


def sft_stage(yaml_path: Path, overrides: list[str]) -> str:
    from posttrain.training.sft import load_sft_config, run_sft

    return str(run_sft(load_sft_config(yaml_path, overrides)).hf_dir)


def rl_stage(overrides: list[str]) -> dict:
    from posttrain.rl.loop import load_rl_config, run_rl

    res = run_rl(load_rl_config(RECIPE, overrides))
    return {**rl_summary(res), "hf_dir": str(res.hf_dir)}


def run_seed(seed: int, args, base: dict | None) -> dict:
    import yaml

    from posttrain.rl.loop import load_rl_config

    out = Path(args.out) / f"seed{seed}"
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    system_prompt = load_rl_config(RECIPE, rl_overrides(out, seed, args)).data.system_prompt
    row: dict = {"seed": seed, **write_data(out, seed, args, system_prompt)}
    heldout = out / "data" / "heldout.jsonl"
    wall, cpu = {}, {}

    def stage(name, fn, *a):
        res, wall[name], cpu[name] = in_fresh_process(fn, *a)
        shown = {k: v for k, v in res.items() if k != "example"} if isinstance(res, dict) else res
        print(json.dumps({"seed": seed, "stage": name, "wall_s": wall[name], "cpu_s": cpu[name], "result": shown}),
              flush=True)
        return res

    if base is None:
        base = stage("eval_base", evaluate_stage, "pypi:smollm2-135m-instruct", seed, args, heldout)
    row["base"] = base
    sft_dir = args.sft_model
    if not sft_dir:
        (out / "sft.yaml").write_text(yaml.safe_dump(sft_config(out, seed, args), sort_keys=False))
        sft_dir = stage("sft", sft_stage, out / "sft.yaml", stage_overrides(args.overrides, "sft"))
    row["sft"] = stage("eval_sft", evaluate_stage, sft_dir, seed, args, heldout)
    rl = stage("rl", rl_stage, rl_overrides(out, seed, args, model=sft_dir))
    row.update({k: v for k, v in rl.items() if k != "hf_dir"})
    row["rl"] = stage("eval_rl", evaluate_stage, rl["hf_dir"], seed, args, heldout)
    row["gain_points_rl_over_sft"] = round(100 * (row["rl"]["accuracy"] - row["sft"]["accuracy"]), 1)
    row["wall_s"] = wall | {"total": round(time.perf_counter() - t0, 1)}
    row["cpu_s"] = cpu | {"total": round(sum(cpu.values()), 1)}
    row["load_avg_1min_start_end"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
    return row


def table(rows: list[dict]) -> str:
    head = "seed  base   SFT    RL     gain  calls(SFT->RL)  SFT s  RL s  s/step(gen+train)  total min (CPU)  load"
    lines = [head]
    for r in rows:
        w = r["wall_s"]
        lines.append(f"{r['seed']:>4}  {r['base']['accuracy']:.3f}  {r['sft']['accuracy']:.3f}  {r['rl']['accuracy']:.3f}"
                     f"  {r['gain_points_rl_over_sft']:+5.1f}  {r['sft']['tool_calls']:.2f} -> {r['rl']['tool_calls']:.2f}"
                     f"   {w.get('sft', 0):5.0f}  {w['rl']:4.0f}  {r['generation_s_per_step']:.1f}+{r['training_s_per_step']:.1f}"
                     f"  {w['total'] / 60:9.1f} ({r['cpu_s']['total'] / 60:.1f})  {r['load_avg_1min_start_end']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sft-steps", type=int, default=16)
    p.add_argument("--sft-batch", type=int, default=6, help="conversations per SFT step")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-examples", type=int, default=600, help="SFT conversations generated (cycled if fewer are needed)")
    p.add_argument("--tool-fraction", type=float, default=0.3, help="share of SFT conversations that call the calculator")
    p.add_argument("--rl-steps", type=int, default=16)
    p.add_argument("--rl-prompts", type=int, default=1000, help="RL prompts generated")
    p.add_argument("--eval-n", type=int, default=100, help="held-out problems")
    p.add_argument("--base-accuracy", type=float, default=None, help="the base model's held-out accuracy measured "
                   "before (skips evaluating it)")
    p.add_argument("--sft-model", default=None, help="an SFT export to start RL from (skips the SFT stage)")
    p.add_argument("--out", default="/tmp/bench_agent_rl")
    p.add_argument("overrides", nargs="*", metavar="sft.KEY=V|rl.KEY=V")
    args = p.parse_args(argv)
    bad = [o for o in args.overrides if not o.startswith(("sft.", "rl."))]
    if bad:
        p.error(f"overrides must start with sft. or rl.: {bad}")
    base = None if args.base_accuracy is None else {"accuracy": args.base_accuracy, "measured_before": True}
    rows = []
    for seed in args.seeds:
        row = run_seed(seed, args, base)
        base = row["base"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary = {"seeds": rows, "mean_gain_points": round(sum(r["gain_points_rl_over_sft"] for r in rows) / len(rows), 1),
               "mean_total_min": round(sum(r["wall_s"]["total"] for r in rows) / len(rows) / 60, 1),
               "args": {k: v for k, v in vars(args).items()}}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(table(rows))
    print(json.dumps({k: summary[k] for k in ("mean_gain_points", "mean_total_min")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
