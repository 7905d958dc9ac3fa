"""Benchmark: synchronous RL vs the Ray fleet on the demo task, weight-transfer cost, and a scaling model.

1. Once (cached in --work-dir): the demo's data, base model and SFT stage (`posttrain demo`'s own code).
2. From the SFT checkpoint, `posttrain rl` for --steps steps in each mode, one after another (never two at
   once), each in its own process as a user runs it: sync (in-process sampler); fleet with 1 and 2 workers
   at max_staleness 1; fleet with 2 workers at max_staleness 2 (and 0). Reported per mode: seconds per
   trainer step (wall clock between step ends, from `trained.jsonl`, after --warmup steps, which carry the
   compiles and the workers' start), samples/s, mean staleness, the fleet's publish/pull seconds, worker
   busy fraction, and held-out greedy accuracy after the same number of steps.
3. Publish and pull seconds per MB of float32 weights through the parameter server (4-128 MB), and the
   dispatcher's own cost per prompt group (lease + complete + take + commit).
4. A scaling model fed by these measurements (see `scaling_model`), printed for 8, 64 and 512 workers.

Where the scaling model stops holding: (a) one parameter-server actor serves every pull, so its node's egress
(workers x weights MB per publish) bounds the step once it exceeds the step time: at 512 workers and a 1.5B
model in bf16 (~3 GB) that is 1.5 TB per version, so beyond a few dozen workers per version the weights must
fan out through per-node object stores or a broadcast tree (one pull per node, not per worker); (b) the
trainer's time is taken as linear in 1 / trainer devices (data parallel), which holds while the per-device
batch stays large enough; (c) the dispatcher is one Python object in the trainer process: at ~10 us per
group it is negligible up to ~10^4 groups per step; (d) generation time per group is taken as constant,
i.e. workers kept busy with leases and no slow stragglers (the staleness bound makes the trainer wait for
the slowest lease of a batch).

    python benchmarks/bench_fleet.py [--steps 20] [--warmup 3] [--work-dir /tmp/bench_fleet] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {  # name -> overrides
    "sync": [],
    "fleet1_s1": ["fleet.workers=1", "fleet.max_staleness=1"],
    "fleet2_s1": ["fleet.workers=2", "fleet.max_staleness=1"],
    "fleet2_s0": ["fleet.workers=2", "fleet.max_staleness=0"],
    "fleet2_s2": ["fleet.workers=2", "fleet.max_staleness=2"],
}


def prepare(work: Path, seed: int) -> tuple[Path, Path]:
    """The demo's data and SFT checkpoint (built once); returns (rl.yaml, sft hf dir)."""
    import yaml

    from posttrain.demo.run import DemoSettings, build_base_model, rl_config, sft_config
    from posttrain.demo.task import make_splits, write_jsonl
    from posttrain.training.sft import load_sft_config, run_sft

    s = DemoSettings()
    hf = work / "sft" / "hf"
    if not (hf / "config.json").exists():
        train, heldout = make_splits(seed, s.n_train + s.n_rl_prompts, s.n_eval, max_operand=s.max_operand,
                                     direct_fraction=s.direct_fraction)
        data = work / "data"
        write_jsonl(train[: s.n_train], data / "sft_train.jsonl")
        write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in train[s.n_train:]], data / "rl_prompts.jsonl")
        write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in heldout[:200]], data / "heldout.jsonl")
        base = build_base_model(work, s, seed)
        sft_yaml = work / "sft.yaml"
        cfg = sft_config(work, base, s, seed)
        cfg["trainer"]["progress"] = False
        sft_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
        run_sft(load_sft_config(sft_yaml))
    rl_yaml = work / "rl.yaml"
    cfg = rl_config(work, hf, s, seed)
    cfg["trainer"].update(progress=False, save_every=0)
    cfg["eval"] = {"every": 0, "at_start": False}
    cfg["export_hf"] = False
    rl_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return rl_yaml, hf


def run_mode(name: str, rl_yaml: Path, work: Path, steps: int, warmup: int) -> dict:
    out = work / f"rl_{name}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "rl", str(rl_yaml), f"output_dir={out}",
                           f"trainer.max_steps={steps}", *MODES[name]], capture_output=True, text=True,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout}\n{proc.stderr}")
    ledger = [json.loads(x) for x in (out / "trained.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    times = [r["time"] for r in ledger]
    per_step = (times[-1] - times[warmup - 1]) / (len(times) - warmup)
    b_g = train[0]["groups/kept"] * _group_size(rl_yaml)  # samples per step
    after = [r for r in train if r["step"] > warmup]

    def mean(key):
        vals = [r[key] for r in after if key in r]
        return statistics.mean(vals) if vals else float("nan")

    return {"mode": name, "s_per_step": per_step, "samples_per_s": b_g / per_step, "wall_s": wall,
            "train_s": mean("time/train_s"), "staleness_mean": mean("fleet/staleness_mean"),
            "publish_s": mean("fleet/publish_s"), "publish_mb": mean("fleet/publish_mb"), "pull_s": mean("fleet/pull_s"),
            "busy_fraction": mean("fleet/busy_fraction"), "generate_s": mean("time/generate_s"),
            "heldout_accuracy": evals[-1]["eval/accuracy"] if evals else float("nan"),
            "groups_per_step": train[0]["groups/kept"]}


def _group_size(rl_yaml: Path) -> int:
    import yaml

    return int(yaml.safe_load(rl_yaml.read_text())["rollout"]["group_size"])


def transfer_costs(sizes_mb=(4, 32, 128)) -> dict:
    """Publish (trainer -> parameter server) and pull (a worker actor: newest version -> numpy) seconds per MB."""
    import numpy as np
    import ray

    from posttrain.rl.fleet.param_server import ParameterServer

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Puller:
        def __init__(self, ps):
            self.ps = ps

        def pull(self):
            t0 = time.perf_counter()
            _, refs = ray.get(self.ps.latest.remote())
            w = ray.get(refs[0])
            total = sum(float(x[0]) for x in w.values())  # touch the data
            return time.perf_counter() - t0, total

    ps = ray.remote(num_cpus=0)(ParameterServer).remote(2)
    puller = Puller.remote(ps)
    ray.get(ps.publish.remote(-1, {"w": np.ones(4, np.float32)}))  # both actors up before timing
    ray.get(puller.pull.remote())
    out = {}
    for v, mb in enumerate(sizes_mb):
        weights = {f"w{i}": np.ones((mb * 2**20 // 4 // 8,), np.float32) for i in range(8)}
        t0 = time.perf_counter()
        ray.get(ps.publish.remote(v, weights))
        pub = time.perf_counter() - t0
        pull = min(ray.get(puller.pull.remote())[0] for _ in range(3))
        out[mb] = {"publish_s_per_mb": pub / mb, "pull_s_per_mb": pull / mb, "publish_s": pub, "pull_s": pull}
    ray.shutdown()
    return out


def dispatcher_cost(groups: int = 20000, batch: int = 64) -> float:
    """Seconds of trainer-process time per prompt group spent in the dispatcher."""
    import numpy as np

    from posttrain.rl.dispatcher import Dispatcher
    from posttrain.rl.rollout import Rollouts

    d = Dispatcher(1000, batch_groups=batch, max_staleness=1)

    def group(uid, version):
        return Rollouts(group_size=1, record_index=[0], prompt_ids=[[1]], completion_ids=[[2]], logprobs=[[0.0]],
                        finish_reasons=["stop"], texts=[""], prompts_text=[""], rewards=np.zeros(1, np.float32),
                        per_reward={}, reward_stats={}, uid=[uid], version_first=[version], version_last=[version])

    t0 = time.perf_counter()
    step = 1
    while d.counts["trained"] < groups:
        lease = d.lease("w", min(8, max(1, d.admissible(step - 1, step - 1))))
        d.complete(lease.id, [group(u, step - 1) for u in lease.uids])
        if d.take(step) is not None:
            d.commit()
            step += 1
    return (time.perf_counter() - t0) / groups


def scaling_model(train_s: float, group_s: float, mb: float, pub_s_per_mb: float, pull_s_per_mb: float,
                  dispatch_s: float, groups_per_worker: int = 8, staleness: int = 1) -> list[dict]:
    """Predicted trainer step time and samples/s for W workers and trainer device shares.

    Per step the trainer trains B = W * groups_per_worker groups (batch grows with the fleet, as RLAX does),
    its time scaling as B / trainer devices (data parallel, linear); a worker generates its share in
    groups_per_worker * group_s plus one pull; publishing costs mb * pub_s_per_mb and the dispatcher
    dispatch_s per group. With staleness >= 1 generation overlaps training:
        step = max(train(B) + publish + B * dispatch, groups_per_worker * group_s + pull)
    and with staleness 0 they add up. Inputs are this machine's measurements (train_s for one step of
    B0 = groups_per_worker groups on one device)."""
    rows = []
    for workers in (1, 2, 8, 64, 512):
        for share in (0.125, 0.25, 0.5):
            trainer_dev = max(1, round(workers * share / (1 - share)))
            b = workers * groups_per_worker
            train = train_s * workers / trainer_dev
            publish = mb * pub_s_per_mb
            gen = groups_per_worker * group_s + mb * pull_s_per_mb
            trainer_side = train + publish + b * dispatch_s
            step = max(trainer_side, gen) if staleness >= 1 else trainer_side + gen
            rows.append({"workers": workers, "trainer_devices": trainer_dev, "groups_per_step": b, "step_s": step,
                         "groups_per_s": b / step, "bound": "trainer" if trainer_side >= gen else "rollout",
                         "ps_egress_mb_per_step": workers * mb})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="/tmp/bench_fleet")
    ap.add_argument("--modes", nargs="*", default=list(MODES), help="RL modes to run (none: reuse the last results)")
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    rl_yaml, _ = prepare(work, args.seed)
    results = []
    saved = work / "results.json"
    if args.modes:
        for name in args.modes:
            r = run_mode(name, rl_yaml, work, args.steps, args.warmup)
            results.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        saved.write_text(json.dumps(results))
    else:  # `--modes` alone: the transfer, dispatcher and scaling parts on the last run's measurements
        results = json.loads(saved.read_text())
    sync = next((r for r in results if r["mode"] == "sync"), results[0])
    print("\nmode         s/step  samples/s  x sync  staleness  busy  pull_s  publish_s  held-out acc")
    for r in results:
        print(f"{r['mode']:<12} {r['s_per_step']:6.3f} {r['samples_per_s']:9.1f} {sync['s_per_step'] / r['s_per_step']:6.2f}x"
              f" {r['staleness_mean']:9.2f} {r['busy_fraction']:5.2f} {r['pull_s']:7.4f} {r['publish_s']:9.4f}"
              f" {r['heldout_accuracy']:12.3f}")
    transfer = transfer_costs()
    print("\nweights MB  publish s/MB  pull s/MB")
    for mb, t in transfer.items():
        print(f"{mb:10d} {t['publish_s_per_mb']:13.5f} {t['pull_s_per_mb']:10.5f}")
    dispatch = dispatcher_cost()
    print(f"\ndispatcher: {dispatch * 1e6:.1f} us per prompt group (lease + complete + take + commit)")
    group_s = sync["generate_s"] / sync["groups_per_step"]
    big = transfer[max(transfer)]
    print(f"\nscaling model inputs: train {sync['train_s']:.3f} s/step for {sync['groups_per_step']:.0f} groups, "
          f"generation {group_s:.3f} s/group, publish {big['publish_s_per_mb']:.5f} s/MB, pull "
          f"{big['pull_s_per_mb']:.5f} s/MB, weights {results[-1]['publish_mb']:.2f} MB")
    rows = scaling_model(sync["train_s"] / sync["groups_per_step"] * 8, group_s, results[-1]["publish_mb"],
                         big["publish_s_per_mb"], big["pull_s_per_mb"], dispatch)
    print("workers  trainer devs  groups/step  step s  groups/s  bound     PS egress MB/step")
    for r in rows:
        if r["workers"] in (8, 64, 512):
            print(f"{r['workers']:7d} {r['trainer_devices']:13d} {r['groups_per_step']:12d} {r['step_s']:7.3f}"
                  f" {r['groups_per_s']:9.1f}  {r['bound']:<8} {r['ps_egress_mb_per_step']:12.1f}")


if __name__ == "__main__":
    main()
