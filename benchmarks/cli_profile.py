"""Profile a `posttrain` command as a user runs it: what it compiles (JAX's compile events: program, seconds, when),
when each run stage started (every `Run`: the demo's sft and rl, or the one command), when each step ended, and
the rows it logged; written as JSON for `benchmarks/gpu_kit.py` (or read by hand).

    python benchmarks/cli_profile.py --json OUT.json -- rl configs/rl_smoke.yaml trainer.max_steps=4
    python benchmarks/cli_profile.py --json OUT.json -- demo --reduced --output-dir /tmp/demo

The command runs in this process through `posttrain.cli.main.main(argv)`; hooks only observe: `Run.__init__`
(a stage starts: its command; its model's FLOP coefficients once the trainer exists), `MetricsLogger.log` (a row,
with its time) and `MetricsLogger.advance` (a step ended). Times are seconds since the command started.
`summarise(profile)` turns it into per-stage figures: compile seconds, first-step and steady step seconds, the
RL stage's rollout and update seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # JAX's event per backend compile (or cache load)


def profile(argv: list[str]) -> dict:
    """Runs `posttrain ARGV` in this process and returns what it compiled, its stages, steps and rows."""
    import jax

    from posttrain.cli.main import main
    from posttrain.training import metrics as metrics_lib
    from posttrain.training import run as run_lib

    t0 = time.perf_counter()
    now = lambda: round(time.perf_counter() - t0, 4)  # noqa: E731
    out: dict = {"argv": argv, "compiles": [], "stages": [], "steps": [], "rows": []}
    runs: list = []

    def on_event(event: str, duration: float, **kw) -> None:
        if event == COMPILE_EVENT:
            out["compiles"].append({"name": str(kw.get("fun_name", "?")), "seconds": round(duration, 4), "t": now()})

    init, log, advance = run_lib.Run.__init__, metrics_lib.MetricsLogger.log, metrics_lib.MetricsLogger.advance

    def run_init(self, cfg, command, *a, **kw):
        out["stages"].append({"command": command, "t": now()})
        runs.append(self)
        init(self, cfg, command, *a, **kw)

    def row(self, step, metrics):
        out["rows"].append({"t": now(), "stage": len(out["stages"]) - 1, "step": int(step),
                            **{k: float(v) for k, v in metrics.items()}})
        return log(self, step, metrics)

    def step_end(self, step):
        out["steps"].append({"t": now(), "stage": len(out["stages"]) - 1, "step": int(step)})
        return advance(self, step)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    run_lib.Run.__init__, metrics_lib.MetricsLogger.log, metrics_lib.MetricsLogger.advance = run_init, row, step_end
    try:
        out["rc"] = main(argv)
    finally:
        run_lib.Run.__init__, metrics_lib.MetricsLogger.log, metrics_lib.MetricsLogger.advance = init, log, advance
        jax.monitoring.unregister_event_duration_listener(on_event)
    out["wall_s"] = now()
    for stage, r in zip(out["stages"], runs, strict=True):
        cfg = getattr(getattr(r, "trainer", None), "cfg", None)
        if cfg is not None:  # FLOPs per token = 6 matmul_params + attn_coef * T (training); 2 + 1/3 of it forward
            stage["matmul_params"] = cfg.num_layers * cfg.layer_matmul_params() + cfg.vocab_size * cfg.hidden_size
            stage["attn_coef"] = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim
            stage["params"] = cfg.num_params()
    out["devices"] = [d.device_kind for d in jax.devices()]
    return out


def _median(xs):
    return round(statistics.median(xs), 4) if xs else None


def _programs(compiles: list[dict]) -> dict:
    by: dict = {}
    for c in compiles:
        e = by.setdefault(c["name"], {"count": 0, "seconds": 0.0})
        e["count"] += 1
        e["seconds"] = round(e["seconds"] + c["seconds"], 3)
    return dict(sorted(by.items(), key=lambda kv: -kv[1]["seconds"]))


def summarise(p: dict) -> list[dict]:
    """Per stage: its compiles (count, seconds, by program), start to first step, first step, steady step time
    (median of the later steps), and the medians of the rows' time/rollout_s, time/generate_s, time/train_s."""
    out = []
    bounds = [s["t"] for s in p["stages"]] + [p["wall_s"]]
    for i, stage in enumerate(p["stages"]):
        lo, hi = bounds[i], bounds[i + 1]
        compiles = [c for c in p["compiles"] if lo <= c["t"] - c["seconds"] < hi]
        ends = [s["t"] for s in p["steps"] if s["stage"] == i]
        rows = [r for r in p["rows"] if r["stage"] == i and "loss" in r]
        start_rows = [r["t"] for r in p["rows"] if r["stage"] == i and r["step"] == 0]
        first_from = start_rows[0] if start_rows else lo  # after the at-start evaluation, if any
        s = {"command": stage["command"], "compiles": len(compiles),
             "compile_s": round(sum(c["seconds"] for c in compiles), 2), "programs": _programs(compiles),
             "start_to_first_step_s": round(ends[0] - lo, 2) if ends else None,
             "first_step_s": round(ends[0] - first_from, 2) if ends else None,
             "step_s": _median([b - a for a, b in itertools.pairwise(ends[1:])]
                               or [b - a for a, b in itertools.pairwise(ends)]),
             "steps": len(ends), "stage_s": round(hi - lo, 2)}
        for key in ("time/rollout_s", "time/generate_s", "time/train_s", "pack/tokens", "completion/length_mean",
                    "step_time", "mfu", "tokens_per_sec"):
            vals = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
            if vals:
                s[key] = _median(vals)
        for key in ("matmul_params", "attn_coef", "params"):
            if key in stage:
                s[key] = stage[key]
        out.append(s)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True, help="where the profile (and its summary) goes")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the posttrain command line")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    p = profile(cmd)
    p["summary"] = summarise(p)
    args.json.write_text(json.dumps(p, indent=1))
    for s in p["summary"]:
        top = ", ".join(f"{k} {v['count']}x {v['seconds']:.1f}s" for k, v in list(s["programs"].items())[:4])
        print(f"{s['command']}: {s['stage_s']} s, {s['steps']} steps, first step {s['first_step_s']} s, step "
              f"{s['step_s']} s, {s['compiles']} compiles in {s['compile_s']} s ({top})", flush=True)
    print("RESULT " + json.dumps({"rc": p["rc"], "wall_s": p["wall_s"], "summary": [
        {k: v for k, v in s.items() if k != "programs"} for s in p["summary"]]}))
    return int(p["rc"] or 0)


if __name__ == "__main__":
    sys.exit(main())
