"""Benchmark: synchronous RL vs the Ray fleet on the demo task, weight-transfer cost, and a scaling model.

1. Once (cached in --work-dir): the demo's data, base model and SFT stage (`posttrain demo`'s own code).
2. From the SFT checkpoint, `posttrain rl` for --steps steps in each mode, one after another (never two at
   once), each in its own process as a user runs it: sync (in-process sampler); fleet with 1 and 2 workers
   at max_staleness 1; fleet with 2 workers at max_staleness 2 (and 0). Reported per mode: seconds per
   trainer step (wall clock between step ends, from `trained.jsonl`, after --warmup steps, which carry the
   compiles and the workers' start), samples/s, mean staleness, the fleet's publish/pull seconds, worker
   busy fraction, and held-out greedy accuracy after the same number of steps.
3. Weight transfer through the fleet's own code (`posttrain.rl.fleet.shards`, `ParameterServer`): random bf16
   weights shaped like Qwen2.5 at 0.1, 0.5 and 1.5 B parameters, published by 2 trainer parts (each its own
   blocks, `ray.put` once) and pulled (assembled, every weight copied once) by 1 and then 4 workers at once;
   seconds and bytes. And the dispatcher's own cost per prompt group (lease + complete + take + commit).
4. Scaling models fed by these measurements: the step (`scaling_model`, 8/64/512 workers) and the weights
   per version (`weight_scaling`: 8/64/512 workers at 8 per node, 1 or 8 trainer hosts, --nic-gbps).

Where one parameter server stops scaling, and what then. The parameter server moves no bytes: it holds
references, one `latest()` call per lease (the calls per second it answers are measured here: at ~10^3
per second, 512 workers may each lease every half second; with `fleet.swap: segment` each worker also asks
between segments, at most every 50 ms, which at 512 workers is up to 10^4 calls a second: beyond one server,
so at that size the check interval has to grow with the fleet, not built). The bytes go from each trainer
host's object store to each worker node once (workers on a node share the node's copy), so a trainer host
sends nodes x bytes / T per version
(T trainer hosts, each publishing its own blocks) and a node receives the whole version. At 512 workers
(64 nodes of 8) and 1.5 B parameters in bf16 (3.1 GB) over 100 Gb/s NICs that is 16 s per version from a
single trainer host, 2 s from 8; a node's own ingress is 0.25 s. One store per trainer host therefore stops
scaling when nodes x bytes / T / NIC exceeds the time between publishes (`fleet.publish_every` x step
time): for these sizes at 512 workers that happens only with one trainer host and steps under ~16 s, so the
relay tree is described here, not built. What the design does then: a relay tree over the worker nodes
(the first nodes to hold a version serve the next ones, chunk by chunk, so the trainer hosts send each
chunk k times and a version reaches every node in about log_k(nodes) x chunk / NIC + bytes / NIC), which
Ray's object manager partly gives already (a node may fetch an object from any node that holds a copy),
or a broadcast over the workers' own collectives when they share a fabric. Limits of the step model: (a) the
trainer's time is taken as linear in 1 / trainer devices (data parallel), which holds while the
per-device batch stays large enough; (b) the dispatcher is one Python object in trainer process 0: at
~10 us per group it is negligible up to ~10^4 groups per step; (c) generation time per group is taken as
constant, i.e. workers kept busy with leases and no slow stragglers (the staleness bound makes the
trainer wait for the slowest lease of a batch).

    python benchmarks/bench_fleet.py --transfer-only [--transfer-models 0.1B 0.5B 1.5B] [--nic-gbps 100]
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
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, check=False)
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


QWEN25 = {  # name -> (hidden, layers, intermediate, heads, kv heads, vocab); 0.1B: Qwen2.5's shapes, scaled down
    "0.1B": (512, 8, 1408, 8, 2, 151936),
    "0.5B": (896, 24, 4864, 14, 2, 151936),
    "1.5B": (1536, 28, 8960, 12, 2, 151936),
}


def qwen25_shapes(hidden: int, layers: int, inter: int, heads: int, kv: int, vocab: int) -> dict[str, tuple]:
    """{path: shape} of a Qwen2.5-shaped model (tied embeddings, q/k/v biases), stacked over layers as posttrain
    stores them."""
    hd = hidden // heads
    out = {"embed/embedding": (vocab, hidden), "norm/scale": (hidden,)}
    for name, shape in (("attn/q_proj/kernel", (hidden, heads * hd)), ("attn/q_proj/bias", (heads * hd,)),
                        ("attn/k_proj/kernel", (hidden, kv * hd)), ("attn/k_proj/bias", (kv * hd,)),
                        ("attn/v_proj/kernel", (hidden, kv * hd)), ("attn/v_proj/bias", (kv * hd,)),
                        ("attn/o_proj/kernel", (heads * hd, hidden)), ("mlp/gate_proj/kernel", (hidden, inter)),
                        ("mlp/up_proj/kernel", (hidden, inter)), ("mlp/down_proj/kernel", (inter, hidden)),
                        ("input_norm/scale", (hidden,)), ("post_norm/scale", (hidden,))):
        out[f"layers/{name}"] = (layers, *shape)
    return out


def random_weights(shapes: dict[str, tuple], part: int = 0, parts: int = 1) -> dict:
    """Random bfloat16 weights as trainer process `part` of `parts` holds them: its slice of axis 1 (or 0) of every
    weight, as `{path: (shape, index, block)}` (generated tensor by tensor; the same numbers for every part)."""
    import ml_dtypes
    import numpy as np

    out = {}
    for i, (path, shape) in enumerate(shapes.items()):
        full = np.random.default_rng(i).standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
        axis = 1 if len(shape) > 1 and shape[1] % parts == 0 else 0
        step = shape[axis] // parts
        index = [(0, s) for s in shape]
        index[axis] = (part * step, (part + 1) * step)
        out[path] = (shape, tuple(index), np.ascontiguousarray(full[tuple(slice(a, b) for a, b in index)]))
        del full
    return out


def _chunks(part: dict, chunk_bytes: int):
    from posttrain.rl.fleet.shards import to_wire

    """Chunks of `part`'s blocks, taken out of `part` as they go (the caller keeps only the current chunk)."""
    chunk, size = [], 0
    for path in list(part):
        shape, index, block = part.pop(path)
        if chunk and size + block.nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((path, shape, index, *to_wire(block)))  # bfloat16 as uint16: read in place, never copied
        size += block.nbytes
    if chunk:
        yield chunk


def transfer_costs(models=tuple(QWEN25), workers=(1, 4), parts: int = 2) -> list[dict]:
    """Publish and pull seconds and bytes for random bf16 weights shaped like Qwen2.5 (`QWEN25`), through the
    fleet's own code: `parts` publishers (trainer processes, here actors on this node) each `ray.put` the chunks
    of their blocks and `add` them to the `ParameterServer` (publish: from the first put to the version
    complete); then 1, and then 4 workers (actors) at once pull that version, assemble it weight by weight and
    copy every weight once (what loading it onto their devices costs). Workers on one node read the same copy
    in the object store. Memory: the version once in the store, plus a weight or so per worker."""
    import numpy as np
    import ray

    from posttrain.rl.fleet.param_server import ParameterServer
    from posttrain.rl.fleet.shards import CHUNK_BYTES, assembled

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=4 * 2**30, _memory=2**30)  # fixed sizes: the machine's free memory varies

    @ray.remote(num_cpus=0)
    class Publisher:
        def __init__(self, shapes, part, parts):
            self.part, self.parts = part, parts
            self.blocks = random_weights(shapes, part, parts)

        def publish(self, ps, version):
            t0 = time.perf_counter()
            nbytes = sum(b.nbytes for _, _, b in self.blocks.values())
            refs = []
            for chunk in _chunks(self.blocks, CHUNK_BYTES):  # each block dropped here once it is in the store
                refs.append(ray.put(chunk))
            ray.get(ps.add.remote(version, self.part, self.parts, refs, nbytes))
            return t0, time.perf_counter(), nbytes

    @ray.remote(num_cpus=0)
    class Puller:
        def calls(self, ps, n):
            for _ in range(n):
                ray.get(ps.latest.remote())

        def pull(self, ps):
            t0 = time.perf_counter()
            _, refs = ray.get(ps.latest.remote())
            scratch, total = np.empty(0, np.uint8), 0
            for _, x in assembled(ray.get(refs)):  # one copy of every weight: what loading it onto devices costs
                if scratch.nbytes < x.nbytes:
                    scratch = np.empty(x.nbytes, np.uint8)
                np.copyto(scratch[: x.nbytes], x.reshape(-1).view(np.uint8))
                total += x.nbytes
            return time.perf_counter() - t0, total

    pullers = [Puller.remote() for _ in range(max(workers))]
    out = []
    for name in models:
        shapes = qwen25_shapes(*QWEN25[name])
        params = sum(int(np.prod(s)) for s in shapes.values())
        ps = ray.remote(num_cpus=0)(ParameterServer).remote(1)
        pubs = [Publisher.remote(shapes, p, parts) for p in range(parts)]
        ray.get([p.__ray_ready__.remote() for p in pubs] + [pl.__ray_ready__.remote() for pl in pullers])
        res = ray.get([p.publish.remote(ps, 0) for p in pubs])
        publish_s = max(t1 for _, t1, _ in res) - min(t0 for t0, _, _ in res)
        for w in workers:
            t0 = time.perf_counter()
            try:
                pulls = ray.get([pl.pull.remote(ps) for pl in pullers[:w]])
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:  # a machine short of memory
                print(f"{name}, {w} workers: a worker died while pulling ({type(e).__name__}); skipped", flush=True)
                break
            out.append({"model": name, "params_b": params / 1e9, "workers": w, "trainer_parts": parts,
                        "publish_s": publish_s, "publish_bytes": sum(b for _, _, b in res),
                        "pull_s_mean": float(np.mean([t for t, _ in pulls])), "pull_wall_s": time.perf_counter() - t0,
                        "pull_bytes_per_worker": pulls[0][1]})
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out[-1].items()}), flush=True)
        if name == models[0]:  # the server's call rate (latest() from 4 workers at once)
            t0 = time.perf_counter()
            ray.get([pl.calls.remote(ps, 100) for pl in pullers])
            print(f"parameter server: {400 / (time.perf_counter() - t0):.0f} latest() calls/s", flush=True)
        for h in (*pubs, ps):
            ray.kill(h)
        del pubs, ps
        time.sleep(2.0)  # the store frees this model's objects before the next one
    ray.shutdown()
    return out


def dispatcher_cost(groups: int = 20000, batch: int = 64) -> float:
    """Seconds of trainer-process time per prompt group spent in the dispatcher."""
    import numpy as np

    from posttrain.rl.dispatcher import Dispatcher
    from posttrain.rollout.rollouts import Rollouts

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


def weight_scaling(transfer: list[dict], nic_gbps: float, workers_per_node: int = 8) -> list[dict]:
    """Seconds per published version at 8, 64 and 512 workers for each measured model size, with 1 and 8 trainer
    hosts (T): each trainer host puts its 1/T of the bytes into its node's store (measured here: publish s per
    byte, T parts at once), every worker node fetches each host's share once (workers on a node share one copy,
    measured here: 4 workers pull in about the time of 1), so a trainer host sends nodes x bytes / T per version
    over its NIC, and a node receives the whole version over its own NIC and assembles it (measured pull s per
    byte). The parameter server itself moves no bytes (it hands out references). The version's critical path is
    put + max(trainer-host egress, node ingress) + assemble; once the egress term exceeds the time between
    publishes, one store per trainer host stops scaling (see the module docstring for what comes then)."""
    nic = nic_gbps / 8 * 1e9  # bytes/s
    rows = []
    print(f"\nweights per version at {nic_gbps:g} Gb/s per node, {workers_per_node} workers per node")
    print("model  workers  nodes  T  put s  egress s/host  ingress s/node  assemble s  version s")
    for name in dict.fromkeys(t["model"] for t in transfer):
        one = next(t for t in transfer if t["model"] == name and t["workers"] == 1)
        nbytes = one["publish_bytes"]
        put_per_byte = one["publish_s"] / nbytes * one["trainer_parts"]  # one part's seconds per byte it puts
        assemble_s = one["pull_s_mean"]
        for workers in (8, 64, 512):
            nodes = -(-workers // workers_per_node)
            for hosts in (1, 8):
                put = put_per_byte * nbytes / hosts
                egress = nodes * nbytes / hosts / nic
                ingress = nbytes / nic
                total = put + max(egress, ingress) + assemble_s
                rows.append({"model": name, "workers": workers, "nodes": nodes, "trainer_hosts": hosts,
                             "egress_s": egress, "version_s": total})
                print(f"{name:<6} {workers:7d} {nodes:6d} {hosts:2d} {put:6.2f} {egress:14.2f} {ingress:15.2f} "
                      f"{assemble_s:11.2f} {total:10.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="/tmp/bench_fleet")
    ap.add_argument("--modes", nargs="*", default=list(MODES), help="RL modes to run (none: reuse the last results)")
    ap.add_argument("--transfer-models", nargs="*", default=list(QWEN25), help="weight sizes for the transfer part")
    ap.add_argument("--nic-gbps", type=float, default=100.0, help="network bandwidth per node for the scaling model")
    ap.add_argument("--transfer-only", action="store_true", help="only the weight-transfer part and its scaling model")
    args = ap.parse_args()
    if args.transfer_only:
        weight_scaling(transfer_costs(args.transfer_models), args.nic_gbps)
        return
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
    transfer = transfer_costs(args.transfer_models)
    print("\nmodel  params  workers  publish s  publish GB  pull s (mean)  pull wall s  pull GB/worker")
    for t in transfer:
        print(f"{t['model']:<6} {t['params_b']:5.2f}B {t['workers']:8d} {t['publish_s']:10.3f} "
              f"{t['publish_bytes'] / 1e9:11.3f} {t['pull_s_mean']:14.3f} {t['pull_wall_s']:12.3f} "
              f"{t['pull_bytes_per_worker'] / 1e9:15.3f}")
    weight_scaling(transfer, args.nic_gbps)
    dispatch = dispatcher_cost()
    print(f"\ndispatcher: {dispatch * 1e6:.1f} us per prompt group (lease + complete + take + commit)")
    group_s = sync["generate_s"] / sync["groups_per_step"]
    big = max(transfer, key=lambda t: (t["publish_bytes"], -t["workers"]))
    pub_s_per_mb, pull_s_per_mb = big["publish_s"] / (big["publish_bytes"] / 2**20), big["pull_s_mean"] / (
        big["pull_bytes_per_worker"] / 2**20)
    print(f"\nscaling model inputs: train {sync['train_s']:.3f} s/step for {sync['groups_per_step']:.0f} groups, "
          f"generation {group_s:.3f} s/group, publish {pub_s_per_mb:.5f} s/MB, pull "
          f"{pull_s_per_mb:.5f} s/MB, weights {results[-1]['publish_mb']:.2f} MB")
    rows = scaling_model(sync["train_s"] / sync["groups_per_step"] * 8, group_s, results[-1]["publish_mb"],
                         pub_s_per_mb, pull_s_per_mb, dispatch)
    print("workers  trainer devs  groups/step  step s  groups/s  bound     PS egress MB/step")
    for r in rows:
        if r["workers"] in (8, 64, 512):
            print(f"{r['workers']:7d} {r['trainer_devices']:13d} {r['groups_per_step']:12d} {r['step_s']:7.3f}"
                  f" {r['groups_per_s']:9.1f}  {r['bound']:<8} {r['ps_egress_mb_per_step']:12.1f}")


if __name__ == "__main__":
    main()
