"""Same seed, same metrics: RL runs to hold a restructuring of the code to (run before and after, then compare).

`run OUT` runs, each as `posttrain rl` in a fresh process on tiny random models:
  * `rl_smoke`: configs/rl_smoke.yaml, 4 steps;
  * `agent_tool`: multi-turn with the built-in calculator tool (hermes calls, 2 turns);
  * `agent_env`: the guess-the-number `step` environment (several turns with appended observations);
  * `vlm`: GRPO on image prompts (the synthetic shapes task) with a tiny random Gemma 3 VLM;
  * `fleet`: 2 Ray rollout workers at `fleet.max_staleness=0` (deterministic: every group from the newest weights),
and keeps each run's metrics.jsonl (and the fleet's trained.jsonl ledger). `compare A B` prints, per run, the
largest absolute difference over the numeric metrics both have (time, speed and memory figures left out), the
keys only one has, and for the fleet whether every group was trained exactly once in both.

    python benchmarks/rl_equivalence.py run /tmp/before     # on the old code
    python benchmarks/rl_equivalence.py run /tmp/after      # on the new code
    python benchmarks/rl_equivalence.py compare /tmp/before /tmp/after
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["trainer.progress=false", "trainer.save_every=0", "export_hf=false", "eval.at_start=false", "eval.every=0",
          "trainer.log_every=1"]
NOT_COMPARED = ("time", "seconds", "per_s", "tokens_per", "throughput", "memory", "mfu", "compile", "busy")


def _guess_data(out: Path) -> Path:
    path = out / "guess.jsonl"
    path.write_text("".join(json.dumps({"prompt": "guess", "secret": 10 + i, "max_guesses": 4}) + "\n"
                            for i in range(8)))
    return path


def _tiny_vlm(out: Path) -> Path:
    folder = out / "tiny_vlm"
    code = ("import sys; from pathlib import Path\n"
            "from posttrain.models.hf_io import save_pretrained\n"
            "from posttrain.models.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config\n"
            "from posttrain.models.transformer import init_model\n"
            "out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)\n"
            "tok = build_vlm_tokenizer(out)\n"
            "save_pretrained(init_model(tiny_vlm_config(tok.vocab_size), seed=0), out, tokenizer=tok)\n")
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    return folder


def runs(out: Path) -> dict[str, list[str]]:
    smoke = str(ROOT / "configs" / "rl_smoke.yaml")
    stops = "[" + ", ".join(str(i) for i in range(2, 60)) + "]"
    return {
        "rl_smoke": [smoke, "trainer.max_steps=4"],
        "agent_tool": [smoke, "trainer.max_steps=3", "rollout.tools=[calculator]", "rollout.max_turns=2",
                       "rollout.max_total_tokens=48", "rollout.batch_prompts=2", "rollout.tool_workers=1",
                       "data.max_prompt_tokens=2048"],
        "agent_env": [None, "model.path=tiny:llama", f"data.train={_guess_data(out)}", "rollout.batch_prompts=2",
                      "rollout.group_size=2", "rollout.max_new_tokens=8", f"rollout.stop_token_ids={stops}",
                      "rollout.environment=posttrain.agent.envs.guess_number:GuessNumber", "rollout.max_turns=4",
                      "rollout.max_total_tokens=160", "rewards.functions=[]", "rewards.correctness=environment",
                      "rewards.num_workers=0", "optim.lr=1e-3", "trainer.max_steps=3"],
        "vlm": [str(ROOT / "configs" / "vlm_rl_smoke.yaml"), f"model.path={_tiny_vlm(out)}", "trainer.max_steps=3",
                "rollout.batch_prompts=4", "rollout.group_size=4", "data.eval=null"],
        "fleet": [smoke, "trainer.max_steps=4", "fleet.workers=2", "fleet.max_staleness=0", "fleet.lease_groups=1"],
    }


def run(out: Path, only: list[str] | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (config, *overrides) in runs(out).items():
        if only and name not in only:
            continue
        cmd = [sys.executable, "-m", "posttrain.cli.main", "rl"] + ([config] if config else [])
        cmd += [f"output_dir={out / name}", *COMMON, *overrides]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)


def _rows(folder: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(int(row.get("step", -1)), {}).update(row)
    return rows


def _numeric(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not k.endswith("_s") and not any(s in k for s in NOT_COMPARED)}


def compare(a: Path, b: Path) -> None:
    for name in ("rl_smoke", "agent_tool", "agent_env", "vlm", "fleet"):
        if not (a / name / "metrics.jsonl").exists() or not (b / name / "metrics.jsonl").exists():
            print(f"{name:10s} missing in one of the two")
            continue
        ra, rb = _rows(a / name), _rows(b / name)
        worst, where, only, compared = 0.0, "", set(), 0
        for step in sorted(set(ra) | set(rb)):
            na, nb = _numeric(ra.get(step, {})), _numeric(rb.get(step, {}))
            only |= set(na) ^ set(nb)
            compared += len(set(na) & set(nb))
            for k in set(na) & set(nb):
                d = abs(na[k] - nb[k]) if math.isfinite(na[k]) and math.isfinite(nb[k]) else float(na[k] != nb[k])
                if d > worst:
                    worst, where = d, f"step {step} {k}: {na[k]} vs {nb[k]}"
        line = f"{name:10s} steps {len(ra)}/{len(rb)}  {compared} values compared, max abs diff {worst:g}" + (f" ({where})" if where else "")
        if only:
            line += f"  keys in one only: {sorted(only)}"
        if name == "fleet":
            for side in (a, b):
                uids = [u for x in (side / name / "trained.jsonl").read_text().splitlines()
                        for u in json.loads(x)["uids"]]
                line += f"  [{side.name}: {len(uids)} groups trained, each once: {len(uids) == len(set(uids))}]"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--only", nargs="*")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    run(args.out, args.only) if args.cmd == "run" else compare(args.a, args.b)


if __name__ == "__main__":
    main()
