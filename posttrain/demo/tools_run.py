"""`posttrain demo --task tools`: a from-scratch tiny model learns to call a calculator: evaluate -> tool-use
SFT -> evaluate -> multi-turn GRPO with the calculator and the exact-answer reward -> evaluate.

The task is `posttrain.demo.tools_task` (products of 3-digit numbers; demonstrations that call the calculator
mixed with ones that answer in one go). Every stage runs through the code paths of `posttrain sft`,
`posttrain rl` and `posttrain eval` (ordinary config files written into the output folder, the multi-turn
rollout of `posttrain.agent`); held-out evaluations are greedy multi-turn rollouts with the same tool.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from posttrain.agent.setup import build_agent
from posttrain.data import read_prompts
from posttrain.demo.run import build_base_model, sft_config
from posttrain.demo.tools_task import build_tools_tokenizer, make_splits, prompt_records, sft_records, write_jsonl
from posttrain.eval.evaluate import evaluate
from posttrain.rewards.runner import RewardRunner, RewardSpec
from posttrain.rl.config import RolloutConfig
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rollout.policy import Policy
from posttrain.sampling import ProgramCache
from posttrain.training.sft import load_sft_config, run_sft


@dataclasses.dataclass
class ToolsDemoSettings:
    """Sizes of the tool-use demo; `reduced()` checks the plumbing in about a minute."""

    n_train: int = 6000
    n_rl_prompts: int = 4000
    n_eval: int = 200
    tool_fraction: float = 0.3
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    sft_steps: int = 250
    sft_batch: int = 32
    sft_lr: float = 3e-3
    sft_seq_len: int = 128  # a call demonstration is 65 tokens, a direct answer 42
    rl_steps: int = 30
    rl_prompts: int = 16
    group_size: int = 8
    rl_lr: float = 2e-4
    rl_eval_every: int = 10
    turn_tokens: int = 16  # new tokens per model turn; the call is 11 tokens, the answer 12
    max_turns: int = 3

    @staticmethod
    def reduced() -> "ToolsDemoSettings":
        return ToolsDemoSettings(n_train=400, n_rl_prompts=64, n_eval=16, hidden=64, layers=2, sft_steps=10,
                                 sft_batch=8, rl_steps=2, rl_prompts=4, group_size=4, rl_eval_every=2)


ROLLOUT = {"tools": ["calculator"], "tool_format": "hermes", "tool_timeout_s": 5.0, "tool_workers": 2,
           "max_tool_calls": 2, "max_tool_output_tokens": 32}


def rl_config(out: Path, model: Path, s: ToolsDemoSettings, seed: int) -> dict:
    return {
        "output_dir": str(out / "rl"),
        "model": {"path": str(model)},
        "data": {"train": str(out / "data" / "rl_prompts.jsonl"), "eval": str(out / "data" / "heldout.jsonl"),
                 "seed": seed, "chat": True},
        "rollout": {**ROLLOUT, "batch_prompts": s.rl_prompts, "group_size": s.group_size,
                    "max_new_tokens": s.turn_tokens, "max_turns": s.max_turns, "temperature": 1.0},
        "algorithm": {"preset": "grpo", "beta": 0.0},
        "rewards": {"functions": [{"name": "math_answer", "weight": 1.0}], "correctness": "math_answer",
                    "num_workers": 1},
        "optim": {"lr": s.rl_lr, "decay": "constant", "clip_norm": 1.0},
        "trainer": {"max_steps": s.rl_steps, "log_every": 1, "save_every": s.rl_steps, "keep_checkpoints": 1,
                    "seed": seed, "resume": False},
        "eval": {"every": s.rl_eval_every, "at_start": False},  # the demo evaluated the SFT export already
    }


def evaluate_checkpoint(path: Path, heldout: Path, s: ToolsDemoSettings,
                        program_cache: ProgramCache | None = None) -> dict:
    """Greedy multi-turn held-out accuracy, tool calls per trajectory and mean reward of a HF checkpoint."""
    policy = Policy.open(path, mesh=None, max_slots=128, program_cache=program_cache)
    records = read_prompts(str(heldout))
    agent = build_agent(RolloutConfig(**ROLLOUT, max_new_tokens=s.turn_tokens, max_turns=s.max_turns), policy.tokenizer)
    try:
        prompts = policy.encode(records, agent=agent)
        with RewardRunner([RewardSpec("math_answer")], num_workers=1) as runner:
            e = evaluate(policy, prompts, runner, correctness="math_answer", max_new_tokens=s.turn_tokens, agent=agent)
    finally:
        agent.close()
    greedy = e.pop("_greedy")
    e.pop("_sampled")
    return {"accuracy": e["eval/accuracy"], "tool_calls": e.get("eval/tool_calls_mean", 0.0),
            "mean_reward": e["eval/reward_mean"], "example": greedy.trajectories[0] if greedy.trajectories else None}


def plot(out: Path, rl_dir: Path, sft_steps: int, stages: list[dict]) -> Path:
    import matplotlib  # lazy: matplotlib (~0.3 s) loads only to draw the demo's plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: pyplot after the Agg backend is chosen

    rl = [json.loads(x) for x in open(rl_dir / "metrics.jsonl")] if (rl_dir / "metrics.jsonl").exists() else []
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    acc = [(0, stages[0]["accuracy"]), (sft_steps, stages[1]["accuracy"])]
    acc += [(sft_steps + r["step"], r["eval/accuracy"]) for r in rl if "eval/accuracy" in r and r["step"] > 0]
    ax[0].plot(*zip(*acc), marker="o")
    ax[0].set(title="Held-out accuracy (greedy, with the calculator)", xlabel="step (SFT, then RL)",
              ylabel="accuracy", ylim=(0, 1))
    calls = [(sft_steps + r["step"], r["agent/tool_calls_mean"]) for r in rl if "agent/tool_calls_mean" in r]
    held = [(0, stages[0]["tool_calls"]), (sft_steps, stages[1]["tool_calls"])]
    held += [(sft_steps + r["step"], r["eval/tool_calls_mean"]) for r in rl if "eval/tool_calls_mean" in r]
    if calls:
        ax[1].plot(*zip(*calls), label="RL rollouts (sampled)")
    ax[1].plot(*zip(*held), marker="o", label="held-out (greedy)")
    ax[1].set(title="Tool calls per trajectory", xlabel="step (SFT, then RL)", ylabel="calls", ylim=(0, None))
    ax[1].legend()
    for a in ax:
        a.axvline(sft_steps, color="gray", ls="--", lw=1)
    fig.tight_layout()
    path = out / "demo_tools.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _timed(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its wall seconds and this process's CPU seconds (all threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0, time.process_time() - c0


def _report(console, stages: list[dict], seed: int, total: float, out: Path) -> None:
    table = Table(title=f"posttrain demo --task tools (seed {seed})")
    for col in ("stage", "held-out accuracy", "tool calls / trajectory", "train seconds", "train CPU seconds"):
        table.add_column(col, justify="right" if col != "stage" else "left")
    for st in stages:
        table.add_row(st["name"], f"{st['accuracy']:.3f}", f"{st['tool_calls']:.2f}", f"{st['seconds']:.1f}",
                      f"{st['cpu_seconds']:.1f}")
    console.print(table)
    gain = stages[2]["accuracy"] - stages[1]["accuracy"]
    console.print(f"RL changed held-out accuracy by {100 * gain:+.1f} points over SFT. Total {total:.0f} s. "
                  f"Outputs: {out} (configs, metrics.jsonl, trajectories.jsonl, demo_tools.png, rl/hf/)")


def run_tools_demo(output_dir: str | Path, seed: int = 0, settings: ToolsDemoSettings | None = None,
                   console=None) -> dict:
    s = settings or ToolsDemoSettings()
    console = console or Console()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    console.rule("[bold]posttrain demo --task tools")
    console.print(
        "Task: products of 3-digit numbers like [cyan]423*456=[/cyan], which a tiny model cannot compute, with a "
        "[bold]calculator[/bold] tool it can call ([cyan]<tool_call>{\"name\": \"calculator\", ...}</tool_call>[/cyan]) "
        f"before answering [cyan]#### 192888[/cyan]. A {s.layers}-layer model is built from scratch; only "
        f"{100 * s.tool_fraction:.0f}% of the SFT demonstrations call the tool (the rest answer in one go), so RL "
        "has a lesson to learn: calling the tool pays.")
    train, heldout = make_splits(seed, s.n_train + s.n_rl_prompts, s.n_eval, s.tool_fraction)
    data = out / "data"
    write_jsonl(sft_records(train[: s.n_train]), data / "sft_train.jsonl")
    write_jsonl(prompt_records(train[s.n_train:]), data / "rl_prompts.jsonl")
    write_jsonl(prompt_records(heldout), data / "heldout.jsonl")
    base = build_base_model(out, s, seed, tokenizer=build_tools_tokenizer, max_positions=256)
    stages: list[dict] = []
    programs = ProgramCache()  # the three checkpoints share one architecture: their evaluations one set of programs

    def stage(name: str, model_dir: Path, seconds: float = 0.0, cpu: float = 0.0) -> None:
        e, eval_s, eval_cpu = _timed(evaluate_checkpoint, model_dir, data / "heldout.jsonl", s, programs)
        stages.append({"name": name, "accuracy": e["accuracy"], "tool_calls": e["tool_calls"],
                       "mean_reward": e["mean_reward"], "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
                       "eval_seconds": round(eval_s, 1), "eval_cpu_seconds": round(eval_cpu, 1)})
        console.print(f"[bold]{name}[/bold]: held-out accuracy {e['accuracy']:.3f}, {e['tool_calls']:.2f} tool calls "
                      f"per trajectory on {s.n_eval} problems")

    stage("init", base)
    console.rule("[bold]1/2 supervised fine-tuning on tool-use conversations")
    sft_yaml = out / "sft.yaml"
    sft_cfg = sft_config(out, base, s, seed, seq_len=s.sft_seq_len, fmt="messages")
    sft_cfg["optim"]["decay"] = "cosine"  # the call-or-answer choice settles near the data's mix at the end
    sft_yaml.write_text(yaml.safe_dump(sft_cfg, sort_keys=False))
    sft, *timing = _timed(run_sft, load_sft_config(sft_yaml))
    stage("sft", Path(sft.hf_dir), *timing)
    console.rule("[bold]2/2 multi-turn RL (GRPO with the calculator, exact-answer reward)")
    rl_yaml = out / "rl.yaml"
    rl_yaml.write_text(yaml.safe_dump(rl_config(out, Path(sft.hf_dir), s, seed), sort_keys=False))
    rl, *timing = _timed(run_rl, load_rl_config(rl_yaml), program_cache=programs)
    stage("rl", Path(rl.hf_dir), *timing)
    plot_path = plot(out, out / "rl", s.sft_steps, stages)
    total = time.perf_counter() - t_start
    summary = {"task": "tools", "stages": stages, "seed": seed, "total_seconds": round(total, 1),
               "final_checkpoint": str(rl.hf_dir), "plot": str(plot_path)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _report(console, stages, seed, total, out)
    return summary
