"""`posttrain demo`: evaluate -> short SFT -> evaluate -> GRPO with the exact-answer reward -> evaluate.

Everything runs through the code paths of `posttrain sft` and `posttrain rl`: the demo writes ordinary
config files into the output folder (`sft.yaml`, `rl.yaml`) and runs them with `run_sft` / `run_rl`;
the held-out evaluations use the RL evaluator (greedy pass@1 with the `math_answer` reward) on the
exported Hugging Face checkpoint of each stage. The SFT stage is deliberately short, so the model
leaves it with the answer format and partial skill, and RL has room to improve it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from posttrain.data import read_prompts
from posttrain.demo.task import make_splits, write_jsonl
from posttrain.eval.evaluate import evaluate
from posttrain.models.config import llama_like
from posttrain.models.hf_io import save_pretrained
from posttrain.models.tokenizer import build_tokenizer
from posttrain.models.transformer import init_model
from posttrain.rewards.runner import RewardRunner, RewardSpec
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rollout.policy import Policy
from posttrain.sampling import ProgramCache
from posttrain.training.sft import load_sft_config, run_sft


@dataclasses.dataclass
class DemoSettings:
    """Sizes of the demo; `reduced()` is the CI version that checks the plumbing in about a minute."""

    n_train: int = 20000
    n_rl_prompts: int = 4000
    n_eval: int = 500
    max_operand: int = 20
    direct_fraction: float = 0.5
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    sft_steps: int = 300
    sft_batch: int = 32
    sft_lr: float = 3e-3
    rl_steps: int = 40
    rl_prompts: int = 16
    group_size: int = 8
    rl_lr: float = 1e-4
    rl_eval_every: int = 10
    max_new_tokens: int = 32

    @staticmethod
    def reduced() -> "DemoSettings":
        return DemoSettings(n_train=800, n_rl_prompts=64, n_eval=40, hidden=64, layers=2, sft_steps=20,
                            sft_batch=8, rl_steps=3, rl_prompts=4, group_size=4, rl_eval_every=2)


def write_demo_data(out: Path, s: DemoSettings, seed: int) -> tuple[Path, list[dict]]:
    """The task's data under OUT/data: SFT demonstrations, RL prompts and held-out problems (disjoint); returns
    (the data folder, the held-out records)."""
    train, heldout = make_splits(seed, s.n_train + s.n_rl_prompts, s.n_eval, max_operand=s.max_operand,
                                 direct_fraction=s.direct_fraction)
    data = out / "data"
    write_jsonl(train[: s.n_train], data / "sft_train.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in train[s.n_train:]], data / "rl_prompts.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in heldout], data / "heldout.jsonl")
    return data, heldout


def build_base_model(out: Path, s, seed: int, *, tokenizer=build_tokenizer, max_positions: int = 256) -> Path:
    """A small random Llama-shaped model (sizes from `s`: hidden, layers, heads) and the character tokenizer
    `tokenizer(folder)` builds, saved as a HF checkpoint."""
    folder = out / "model_init"
    tok = tokenizer(folder)
    cfg = llama_like(vocab_size=tok.vocab_size, hidden_size=s.hidden, intermediate_size=3 * s.hidden,
                     num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.heads // 2,
                     max_position_embeddings=max_positions,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_pretrained(init_model(cfg, seed=seed), folder, tokenizer=tok)
    return folder


def sft_config(out: Path, model: Path, s, seed: int, *, seq_len: int = 128, fmt: str = "prompt_completion") -> dict:
    """The SFT stage's config (sizes from `s`: sft_batch, sft_lr, sft_steps) on `out/data/sft_train.jsonl`."""
    return {
        "output_dir": str(out / "sft"),
        "model": {"path": str(model)},
        "data": {"train": str(out / "data" / "sft_train.jsonl"), "seq_len": seq_len, "batch_size": s.sft_batch,
                 "pack": True, "seed": seed, "format": {"format": fmt}},
        "optim": {"name": "adamw", "lr": s.sft_lr, "warmup_steps": 20, "decay": "constant",
                  "weight_decay": 0.01, "clip_norm": 1.0},
        "trainer": {"max_steps": s.sft_steps, "log_every": 10, "save_every": s.sft_steps, "keep_checkpoints": 1,
                    "seed": seed, "resume": False},
    }


def rl_config(out: Path, model: Path, s: DemoSettings, seed: int) -> dict:
    return {
        "output_dir": str(out / "rl"),
        "model": {"path": str(model)},
        "data": {"train": str(out / "data" / "rl_prompts.jsonl"), "eval": str(out / "data" / "heldout.jsonl"),
                 "seed": seed},
        "rollout": {"batch_prompts": s.rl_prompts, "group_size": s.group_size, "max_new_tokens": s.max_new_tokens,
                    "temperature": 1.0},
        "algorithm": {"preset": "grpo", "beta": 0.0},
        "rewards": {"functions": [{"name": "math_answer", "weight": 1.0}], "correctness": "math_answer",
                    "num_workers": 1},
        "optim": {"lr": s.rl_lr, "decay": "constant", "clip_norm": 1.0},
        "trainer": {"max_steps": s.rl_steps, "log_every": 1, "save_every": s.rl_steps, "keep_checkpoints": 1,
                    "seed": seed, "resume": False},
        "eval": {"every": s.rl_eval_every, "at_start": False},  # the demo evaluated the SFT export already
    }


def evaluate_checkpoint(path: Path, heldout: Path, max_new_tokens: int,
                        program_cache: ProgramCache | None = None) -> dict:
    """Greedy held-out accuracy and mean reward of a HF checkpoint (the RL evaluator, `math_answer`); checkpoints of
    one architecture evaluated with one `program_cache` compile the sampler's programs once."""
    policy = Policy.open(path, mesh=None, max_slots=128, program_cache=program_cache)
    prompts = policy.encode(read_prompts(str(heldout)))  # text as it is (the policy's default style)
    with RewardRunner([RewardSpec("math_answer")], num_workers=1) as runner:
        e = evaluate(policy, prompts, runner, correctness="math_answer", max_new_tokens=max_new_tokens)
    greedy = e.pop("_greedy")
    e.pop("_sampled")
    return {"accuracy": e["eval/accuracy"], "mean_reward": e["eval/reward_mean"], "texts": greedy.texts}


def plot(out: Path, sft_dir: Path, rl_dir: Path, stages: list[dict]) -> Path:
    import matplotlib  # lazy: matplotlib (~0.3 s) loads only to draw the demo's plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: pyplot after the Agg backend is chosen

    def rows(d: Path):
        return [json.loads(x) for x in open(d / "metrics.jsonl")] if (d / "metrics.jsonl").exists() else []

    sft, rl = rows(sft_dir), rows(rl_dir)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    pts = [(r["step"], r["loss"]) for r in sft if "loss" in r]
    ax[0].plot(*zip(*pts)) if pts else None
    ax[0].set(title="SFT training loss", xlabel="SFT step", ylabel="loss", yscale="log")
    pts = [(r["step"], r["reward/mean"]) for r in rl if "reward/mean" in r]
    ax[1].plot(*zip(*pts)) if pts else None
    ax[1].set(title="RL mean reward (training rollouts)", xlabel="RL step", ylabel="reward")
    sft_steps = max((p for p, _ in [(r["step"], 0) for r in sft]), default=0)
    acc = [(0, stages[0]["accuracy"]), (sft_steps, stages[1]["accuracy"])]
    acc += [(sft_steps + r["step"], r["eval/accuracy"]) for r in rl if "eval/accuracy" in r and r["step"] > 0]
    ax[2].plot(*zip(*acc), marker="o")
    ax[2].axvline(sft_steps, color="gray", ls="--", lw=1)
    ax[2].set(title="Held-out accuracy (greedy)", xlabel="step (SFT, then RL)", ylabel="accuracy", ylim=(0, 1))
    fig.tight_layout()
    path = out / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_demo(output_dir: str | Path, seed: int = 0, settings: DemoSettings | None = None, console=None) -> dict:
    s = settings or DemoSettings()
    console = console or Console()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    console.rule("[bold]posttrain demo")
    console.print(
        "Task: chained additions like [cyan]7+15+9=[/cyan] -> [cyan]7+15=22,22+9=31 #### 31[/cyan], checked by the "
        f"exact-answer reward. A {s.layers}-layer model is built from scratch. As in much real SFT data, "
        f"{100 * s.direct_fraction:.0f}% of the demonstrations skip the working ([cyan]#### 31[/cyan]), and the SFT "
        f"stage is kept [bold]deliberately short[/bold] ({s.sft_steps} steps) so that RL has room to improve: "
        "it can learn that working it out pays."
    )
    data, heldout = write_demo_data(out, s, seed)
    base = build_base_model(out, s, seed)

    stages: list[dict] = []
    programs = ProgramCache()  # the three checkpoints share one architecture: their evaluations one set of programs

    def stage(name: str, model_dir: Path, seconds: float) -> None:
        t0 = time.perf_counter()
        e = evaluate_checkpoint(model_dir, data / "heldout.jsonl", s.max_new_tokens, programs)
        stages.append({"name": name, "accuracy": e["accuracy"], "mean_reward": e["mean_reward"],
                       "seconds": round(seconds, 1), "eval_seconds": round(time.perf_counter() - t0, 1)})
        console.print(f"[bold]{name}[/bold]: held-out accuracy {e['accuracy']:.3f} on {s.n_eval} problems "
                      f"(e.g. {heldout[0]['prompt']} -> {e['texts'][0]!r})")

    stage("init", base, 0.0)

    console.rule("[bold]1/2 supervised fine-tuning")
    sft_yaml = out / "sft.yaml"
    sft_yaml.write_text(yaml.safe_dump(sft_config(out, base, s, seed), sort_keys=False))
    t0 = time.perf_counter()
    sft = run_sft(load_sft_config(sft_yaml))
    stage("sft", Path(sft.hf_dir), time.perf_counter() - t0)

    console.rule("[bold]2/2 reinforcement learning (GRPO, exact-answer reward)")
    rl_yaml = out / "rl.yaml"
    rl_yaml.write_text(yaml.safe_dump(rl_config(out, Path(sft.hf_dir), s, seed), sort_keys=False))
    t0 = time.perf_counter()
    rl = run_rl(load_rl_config(rl_yaml), program_cache=programs)
    stage("rl", Path(rl.hf_dir), time.perf_counter() - t0)

    plot_path = plot(out, out / "sft", out / "rl", stages)
    total = time.perf_counter() - t_start
    summary = {"stages": [{k: st[k] for k in ("name", "accuracy", "mean_reward", "seconds")} for st in stages],
               "seed": seed, "total_seconds": round(total, 1), "final_checkpoint": str(rl.hf_dir),
               "plot": str(plot_path)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    table = Table(title=f"posttrain demo (seed {seed})")
    for col in ("stage", "held-out accuracy", "mean reward", "train seconds"):
        table.add_column(col, justify="right" if col != "stage" else "left")
    for st in stages:
        table.add_row(st["name"], f"{st['accuracy']:.3f}", f"{st['mean_reward']:.3f}", f"{st['seconds']:.1f}")
    console.print(table)
    gain = stages[2]["accuracy"] - stages[1]["accuracy"]
    console.print(f"RL changed held-out accuracy by {100 * gain:+.1f} points over SFT. Total {total:.0f} s. "
                  f"Outputs: {out} (configs, metrics.jsonl, tensorboard/, demo.png, rl/hf/)")
    return summary
