"""GPU readiness: build a carry kit of wheels here, then install it and measure the accelerator path there.

A lent GPU machine (Python 3.12, jax 0.11 + CUDA, flax, optax, orbax, transformers, torch; no package
registry) lacks some of posttrain's dependencies. Two commands:

    python benchmarks/gpu_kit.py build            # here: cp312 manylinux wheels into .whl/, sizes checked
    python3 benchmarks/gpu_kit.py run --out DIR   # there: install .whl/ into /tmp/site, run the checks and
                                                  # benchmarks, write DIR/gpu_figures.json and DIR/gpu_log.txt

`build` writes the wheels of KIT (pinned like pyproject.toml; flax at the release that imports under jax 0.11)
into `.whl/`, adds `.whl/` to `.git/info/exclude`, and prints the kit's size beside the working tree's (what
travels must stay under 64 MiB). Ray is left out (its wheel alone is ~70 MB; the fleet has no GPU benchmark).

`run` executes, each in its own process with a time limit, its output kept in the log:
  env      versions of python, jax, flax, transformers, torch and the devices JAX sees;
  checks   the parity tests on the accelerator (JAX_PLATFORMS unset: bf16 compute vs float32, logits vs
           transformers, the generic kernel set, packed and shared-prompt RL batches against padded ones) and
           cuDNN flash attention against XLA's attention;
  accel    benchmarks/bench_accel.py (SFT MFU, decode vs the bandwidth roofline, the same work in PyTorch);
  generate benchmarks/bench_generate.py (ours vs transformers' generate);
  grpo     benchmarks/bench_grpo.py --no-trl (GRPO step seconds, rollout vs train);
  continuation  benchmarks/bench_agent_continuation.py (a 4-turn rollout vs one 4x-longer generation);
  rlupdate benchmarks/bench_rl_pack.py --micro on the 0.45B shape: the RL update padded, packed and with shared
           prompts (4 prompts x 8 completions, 256-token prompts, completions of 32..512 tokens).
Every step runs with JAX_PLATFORMS=--platform (cuda): the benchmarks default to cpu otherwise.
Each step's exit code, seconds and parsed figures go into gpu_figures.json, so a partial run still reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / ".whl"
SITE = Path("/tmp/site")
LIMIT_MIB = 64
#: what the GPU image lacks (or holds at a version posttrain does not import with); pinned like pyproject.toml
KIT = [
    "flax==0.12.12", "grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0", "qwix==0.1.8",
    "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2", "gguf==0.19.0",
    "pebble==5.2.3",
    "tensorboardX==2.6.5",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def _mib(paths) -> float:
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


def tree_mib() -> float:
    """Size of what travels without the kit: tracked plus untracked, not ignored files."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode()
    return _mib(ROOT / p for p in out.split("\0") if p and not p.startswith(".whl/"))


def build(_args) -> int:
    KIT_DIR.mkdir(exist_ok=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir() and "/.whl/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write("/.whl/\n")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(KIT_DIR)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + KIT, check=True)
    kit, tree = _mib(KIT_DIR.glob("*.whl")), tree_mib()
    for w in sorted(KIT_DIR.glob("*.whl")):
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    ok = kit + tree < LIMIT_MIB
    print(f"kit {kit:.1f} MiB + working tree {tree:.1f} MiB = {kit + tree:.1f} MiB "
          f"({'fits' if ok else 'does NOT fit'} the {LIMIT_MIB} MiB a call carries)")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------- there
ENV_SNIPPET = r"""
import json, sys, importlib.metadata as md
import jax
out = {"python": sys.version.split()[0], "backend": jax.default_backend(),
       "devices": [str(d) for d in jax.devices()]}
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "torch", "grain", "qwix"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
print("RESULT " + json.dumps(out))
"""

CUDNN_SNIPPET = r"""
import json, jax, jax.numpy as jnp
k = jax.random.split(jax.random.key(0), 3)
B, T, N, K, H = 4, 1024, 16, 8, 128
q = jax.random.normal(k[0], (B, T, N, H), jnp.bfloat16)
kk = jax.random.normal(k[1], (B, T, K, H), jnp.bfloat16)
v = jax.random.normal(k[2], (B, T, K, H), jnp.bfloat16)
out = {}
ref = jax.nn.dot_product_attention(q, kk, v, is_causal=True, implementation="xla")
try:
    got = jax.nn.dot_product_attention(q, kk, v, is_causal=True, implementation="cudnn")
    out["cudnn_max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
    out["cudnn"] = "ok"
except Exception as e:  # report the reason: the check's answer is whether cuDNN attention runs here
    out["cudnn"] = repr(e)[:300]
print("RESULT " + json.dumps(out))
"""


#: the steps of `run`, in order
STEPS = ["env", "checks", "cudnn", "generate", "grpo", "continuation", "accel", "rlupdate"]


def _step(name: str, cmd: list[str], env: dict, log, limit: int) -> dict:
    """Run one step, append its output to the log, return exit code, seconds and its RESULT json if any."""
    t = time.time()
    log.write(f"\n===== {name}: {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    log.write(text)
    log.flush()
    res = {"rc": rc, "seconds": round(time.time() - t, 1)}
    results = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if results:
        res["result"] = json.loads(results[-1][len("RESULT "):])
    tail = [x for x in text.splitlines() if x.strip()][-40:]
    res["tail"] = tail
    print(f"[{name}] rc={rc} {res['seconds']} s", flush=True)
    return res


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(w) for w in KIT_DIR.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    # every step on the accelerator: the benchmarks default JAX_PLATFORMS to cpu (for this 2-core machine), so
    # leaving it unset there measured the GPU machine's CPU (the generate and grpo figures of 2026-11-25)
    env = dict(os.environ, PYTHONPATH=f"{SITE}:{ROOT}", PYTHONUNBUFFERED="1", POSTTRAIN_COMPILE_CACHE="0",
               JAX_PLATFORMS=args.platform)
    py = sys.executable
    steps = {
        "env": ([py, "-c", ENV_SNIPPET], 120),
        "checks": ([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_model_parity.py",
                    "tests/test_layers.py", "tests/test_rl_packing.py", "-k",
                    "bfloat16 or logits_match or packed or shared"], 900),
        "cudnn": ([py, "-c", CUDNN_SNIPPET], 300),
        "generate": ([py, "benchmarks/bench_generate.py", "--repeats", "3"], 900),
        "grpo": ([py, "benchmarks/bench_grpo.py", "--no-trl", "--no-peak", "--steps", "5"], 900),
        "continuation": ([py, "benchmarks/bench_agent_continuation.py", "--repeats", "3"], 600),
        "accel": ([py, "benchmarks/bench_accel.py", "--json", str(out / "accel.json")], 1200),
        "rlupdate": ([py, "benchmarks/bench_rl_pack.py", "--micro", "3", "--size", "0.5b", "--prompts", "4",
                      "--group", "8", "--prompt-len", "256", "--comp", "32", "512", "--json",
                      str(out / "rlupdate.json")], 900),
    }
    assert set(steps) == set(STEPS)
    only = set(args.only or steps)
    figures = {}
    with open(out / "gpu_log.txt", "a") as log:
        for name, (cmd, limit) in steps.items():
            if name not in only:
                continue
            figures[name] = _step(name, cmd, env, log, min(limit, args.step_limit))
            (out / "gpu_figures.json").write_text(json.dumps(figures, indent=1))
    for name in ("accel", "rlupdate"):
        if name in figures and (out / f"{name}.json").exists():
            figures[name]["result"] = json.loads((out / f"{name}.json").read_text())
    (out / "gpu_figures.json").write_text(json.dumps(figures, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="download the kit's wheels into .whl/ and check the size")
    r = sub.add_parser("run", help="on the GPU machine: install the kit, run checks and benchmarks")
    r.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    r.add_argument("--only", nargs="+", choices=STEPS)
    r.add_argument("--platform", default="cuda", help="JAX_PLATFORMS for every step (cuda, tpu)")
    r.add_argument("--step-limit", type=int, default=1200, help="seconds at most for any one step")
    args = ap.parse_args(argv)
    return build(args) if args.cmd == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
