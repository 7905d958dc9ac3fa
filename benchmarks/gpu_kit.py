"""GPU readiness: build a carry kit of wheels here, then install it and measure the accelerator path there.

A lent GPU machine (Python 3.12, jax 0.11 + CUDA, flax, optax, orbax, transformers, torch; no package
registry) lacks some of posttrain's dependencies. Two commands:

    python benchmarks/gpu_kit.py build            # here: cp312 manylinux wheels into .whl/, sizes checked
    python3 benchmarks/gpu_kit.py run --out DIR   # there: install .whl/ into /tmp/site, run the checks and
                                                  # benchmarks, write DIR/gpu_figures.json and DIR/gpu_log.txt

`build` writes the wheels of KIT (pinned like pyproject.toml; flax at the release that imports under jax 0.11)
into `.whl/`, adds `.whl/` to `.git/info/exclude`, and prints the kit's size beside the working tree's (what
travels must stay under 64 MiB). Ray is left out (its wheel alone is ~70 MB; the fleet has no GPU benchmark).

`run` executes its steps in order of importance, each in its own process with a time limit, its output kept in
the log, until `--budget` seconds (default 600: about 10 minutes on one GPU) are spent; the steps after that are
listed as skipped (`--only` picks steps and their order; `--budget 0` runs them all):
  env       versions of python, jax, flax, transformers, torch and the devices JAX sees;
  demo      `posttrain demo` through the CLI (`benchmarks/cli_profile.py`): its wall time, each stage's seconds,
            the RL stage's compile seconds and first step, compile seconds per program;
  rl        `posttrain rl` through the CLI on a 0.45 B random Llama (a word tokenizer over its 32,768-token
            vocabulary, 128-word prompts, 8 prompts x 8 completions of up to 256 tokens, the benchmark reward):
            step time, rollout vs update seconds, the MFU of each, compile seconds per program;
  accel     benchmarks/bench_accel.py (SFT MFU, decode vs the bandwidth roofline at 16/64/256 sequences, the first
            decode call, the same work in PyTorch);
  autotune  `posttrain sft` through the CLI at XLA's GPU autotune levels 0 and 4 (`compile.gpu_autotune_level`),
            on the demo-sized and the 0.45 B model: compile seconds against step seconds;
  checks    the parity tests on the accelerator (JAX_PLATFORMS unset: bf16 compute vs float32, logits vs
            transformers, the generic kernel set, packed and shared-prompt RL batches against padded ones);
  cudnn     cuDNN flash attention against XLA's attention;
  generate  benchmarks/bench_generate.py (ours vs transformers' generate);
  grpo      benchmarks/bench_grpo.py --no-trl (GRPO step seconds, rollout vs train);
  continuation  benchmarks/bench_agent_continuation.py (a 4-turn rollout vs one 4x-longer generation);
  rlupdate  benchmarks/bench_rl_pack.py --micro on the 0.45B shape: the RL update padded, packed and with shared
            prompts (4 prompts x 8 completions, 256-token prompts, completions of 32..512 tokens);
  serve     benchmarks/bench_serve.py on the 0.1 B shape: `posttrain serve` against `transformers serve
            --continuous-batching` (both on the GPU) at 1, 16 and 64 clients (output tokens/s, TTFT, ITL).
Every step runs with JAX_PLATFORMS=--platform (cuda): the benchmarks default to cpu otherwise, and with the
compilation cache off (first-run figures). gpu_figures.json starts with `goals`: issue 40's GPU figures against
their targets (demo seconds, first RL step, RL compile seconds, decode step and roofline, SFT MFU of the chip's
spec peak, first decode call); then each step's exit code, seconds and figures, so a partial run still reports.

    python benchmarks/gpu_kit.py run --tiny --platform cpu --out /tmp/kit   # here: every step's plumbing, tiny
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
    # `posttrain serve` and `transformers serve` (bench_serve.py): the server stack and transformers' serving extra
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "h11==0.16.0", "click==8.5.1",
    "prometheus_client==0.26.0", "pydantic==2.13.4", "pydantic_core==2.46.4", "annotated-types==0.7.0",
    "typing-inspection==0.4.2", "openai==3.57.0", "jiter==0.19.0", "distro==1.9.0",
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
       "devices": [str(d) for d in jax.devices()], "device_kind": jax.devices()[0].device_kind}
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


#: the steps of `run`, most important first
STEPS = ["env", "demo", "rl", "accel", "autotune", "checks", "cudnn", "generate", "grpo", "continuation", "rlupdate",
         "serve"]
#: what `--tiny` runs by default (the CPU-capable plumbing of the new steps)
TINY_STEPS = ["env", "demo", "rl", "accel", "autotune"]
#: dense bfloat16 peak FLOP/s of one chip by its `device_kind` (vendor data sheets; SXM parts)
SPEC_PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "GH200": 989.4e12, "A100": 312e12, "L4": 121e12}
#: issue 40's GPU goals: (figure, target, "<=" or ">=")
GOALS = {"demo_total_s": (120.0, "<="), "demo_first_rl_step_s": (10.0, "<="), "demo_rl_compile_s": (10.0, "<="),
         "decode_step_ms_16": (0.5, "<="), "decode_roofline_256": (0.75, ">="), "sft_mfu_of_spec": (0.45, ">="),
         "first_decode_call_s": (3.0, "<=")}
#: the models `prepare` writes: bench_accel's shapes, and a tiny one for the CPU dry run
SIZES = {"tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 2, "head_dim": 16, "tie_word_embeddings": False}}
#: per size: RL (prompts, group, prompt words, new tokens, steps), SFT (batch, seq, steps)
_FULL = {"prompts": 8, "group": 8, "prompt_words": 128, "new": 256, "rl_steps": 6, "batch": 8, "seq": 2048,
         "sft_steps": 12}
RUNS = {"tiny": {"prompts": 4, "group": 4, "prompt_words": 16, "new": 16, "rl_steps": 3, "batch": 4, "seq": 128,
                 "sft_steps": 4},
        "small": _FULL, "0.5b": _FULL}


def _shape(size: str) -> dict:
    if size in SIZES:
        return SIZES[size]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_accel import SHAPES

    return SHAPES[size]


def prepare(args) -> int:
    """A random Llama of `--size` with a word tokenizer over its whole vocabulary (`w0`, `w1`, ...), RL prompts
    (random words, the benchmark reward's `answer`-free records) and SFT texts, under `--dir`."""
    import numpy as np

    from posttrain.models.config import llama_like
    from posttrain.models.hf_io import save_pretrained
    from posttrain.models.tokenizer import SPECIAL_TOKENS, build_tokenizer
    from posttrain.models.transformer import init_model

    out, sh, r = Path(args.dir), _shape(args.size), RUNS[args.size]
    if (out / "texts.jsonl").exists():  # written last: the folder is complete (another step prepared it)
        return 0
    words = [f"w{i}" for i in range(sh["vocab_size"] - len(SPECIAL_TOKENS))]
    cfg = llama_like(max_position_embeddings=max(r["seq"], 4 * r["prompt_words"] + r["new"]) + 16, **sh)
    save_pretrained(init_model(cfg, seed=0), out / "model", tokenizer=build_tokenizer(out / "tok", kind="word",
                                                                                       vocab=words))
    rng = np.random.default_rng(0)
    (out / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(rng.choice(words, r["prompt_words"]))}) + "\n" for _ in range(64)))
    texts = 4 * r["batch"] * r["sft_steps"]
    (out / "texts.jsonl").write_text("".join(  # written last: marks the folder complete
        json.dumps({"text": " ".join(rng.choice(words, r["seq"] // 2))}) + "\n" for _ in range(texts)))
    print(f"prepared {out}: {cfg.num_params() / 1e6:.1f} M parameters")
    return 0


def _profiled(py: str, out: Path, name: str, argv: list[str]) -> list[str]:
    return [py, "benchmarks/cli_profile.py", "--json", str(out / f"{name}.json"), "--", *argv]


def _rl_argv(model_dir: Path, run_dir: Path, r: dict) -> list[str]:
    reward = ROOT / "benchmarks" / "_bench_rewards.py"
    prompts = model_dir / "prompts.jsonl"
    return ["rl", f"output_dir={run_dir}", f"model.path={model_dir / 'model'}", f"data.train={prompts}",
            f"data.eval={prompts}", "data.chat=false", f"rollout.batch_prompts={r['prompts']}",
            f"rollout.group_size={r['group']}", f"rollout.max_new_tokens={r['new']}", "algorithm.preset=grpo",
            f"rewards.functions=[{{name: '{reward}:reward'}}]", "rewards.correctness=null", "rewards.num_workers=0",
            "model.param_dtype=float32", "model.compute_dtype=bfloat16", f"trainer.max_steps={r['rl_steps']}",
            "trainer.save_every=0", "trainer.progress=false", "eval.at_start=true", "export_hf=false"]


def _sft_argv(cfg_dir: Path, model_dir: Path, run_dir: Path, r: dict) -> tuple[Path, list[str]]:
    cfg = {"output_dir": str(run_dir), "model": {"path": str(model_dir / "model"), "param_dtype": "float32",
                                                  "compute_dtype": "bfloat16"},
           "data": {"train": str(model_dir / "texts.jsonl"), "seq_len": r["seq"], "batch_size": r["batch"],
                    "pack": True, "format": {"format": "text"}},
           "optim": {"lr": 1e-5, "warmup_steps": 0, "decay": "constant"},
           "trainer": {"max_steps": r["sft_steps"], "log_every": 1, "eval_every": 0, "save_every": 0,
                       "progress": False, "loss_chunk_size": 1024},
           "export_hf": False}
    path = cfg_dir / f"{run_dir.name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path, ["sft", str(path)]


def _steps(args, out: Path, py: str) -> dict[str, tuple[list[list[str]], int, dict]]:
    """name -> (commands run in turn, seconds at most, extra environment)."""
    tiny = args.tiny
    size = "tiny" if tiny else "0.5b"
    small = "tiny" if tiny else "small"

    def prep(sz: str) -> list[str]:
        return [py, "benchmarks/gpu_kit.py", "prepare", "--size", sz, "--dir", str(out / f"model-{sz}")]

    rl = [prep(size), _profiled(py, out, "rl", _rl_argv(out / f"model-{size}", out / "rl-run", RUNS[size]))]
    autotune = [prep(size)] + ([prep(small)] if small != size else [])
    env_at = {}
    for sz in dict.fromkeys([small, size]):
        for level in (0, 4):
            _, argv = _sft_argv(out, out / f"model-{sz}", out / f"sft-{sz}-at{level}", RUNS[sz])
            autotune.append(_profiled(py, out, f"autotune-{sz}-{level}", argv))
            env_at[len(autotune) - 1] = {"XLA_FLAGS": f"--xla_gpu_autotune_level={level}"}
    accel = [py, "benchmarks/bench_accel.py", "--json", str(out / "accel.json")]
    if tiny:
        accel += ["--size", "small", "--no-torch", "--slots", "16", "--steps", "1"]
    demo = ["demo", "--output-dir", str(out / "demo-run")] + (["--reduced"] if tiny else [])
    return {
        "env": ([[py, "-c", ENV_SNIPPET]], 120, {}),
        "demo": ([_profiled(py, out, "demo", demo)], 400, {}),
        "rl": (rl, 400, {}),
        "accel": ([accel], 600, {}),
        "autotune": (autotune, 600, {"per_command": env_at}),
        "checks": ([[py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_model_parity.py",
                     "tests/test_layers.py", "tests/test_rl_packing.py", "-k",
                     "bfloat16 or logits_match or packed or shared"]], 900, {}),
        "cudnn": ([[py, "-c", CUDNN_SNIPPET]], 300, {}),
        "generate": ([[py, "benchmarks/bench_generate.py", "--repeats", "3"]], 900, {}),
        "grpo": ([[py, "benchmarks/bench_grpo.py", "--no-trl", "--no-peak", "--steps", "5"]], 900, {}),
        "continuation": ([[py, "benchmarks/bench_agent_continuation.py", "--repeats", "3"]], 600, {}),
        "rlupdate": ([[py, "benchmarks/bench_rl_pack.py", "--micro", "3", "--size", "0.5b", "--prompts", "4",
                       "--group", "8", "--prompt-len", "256", "--comp", "32", "512", "--json",
                       str(out / "rlupdate.json")]], 900, {}),
        "serve": ([[py, "benchmarks/bench_serve.py", "--device", args.platform,
                    "--json", str(out / "serve.json")]
                   + (["--size", "small", "--clients", "1", "4", "--rounds", "1", "--new", "16", "--prompt", "16"]
                      if tiny else ["--size", "0.1b", "--clients", "1", "16", "64"])], 900, {}),
    }


def _step(name: str, cmds: list[list[str]], env: dict, log, limit: float, per_command: dict | None = None) -> dict:
    """Runs a step's commands in turn (stopping at the first failure), appends their output to the log; returns
    exit code, seconds, the last RESULT json if any and the output's tail."""
    t = time.time()
    rc, text = 0, ""
    for i, cmd in enumerate(cmds):
        log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        log.flush()
        left = limit - (time.time() - t)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env={**env, **(per_command or {}).get(i, {})}, capture_output=True,
                                  text=True, timeout=max(left, 1), check=False)
            rc, part = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            part = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        log.write(part)
        log.flush()
        text += part
        if rc != 0:
            break
    res = {"rc": rc, "seconds": round(time.time() - t, 1)}
    results = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if results:
        res["result"] = json.loads(results[-1][len("RESULT "):])
    res["tail"] = [x for x in text.splitlines() if x.strip()][-40:]
    print(f"[{name}] rc={rc} {res['seconds']} s", flush=True)
    return res


def _spec_peak(device_kind: str) -> float | None:
    for key, peak in SPEC_PEAK_BF16.items():
        if key in device_kind and not (key == "H100" and "PCIe" in device_kind):
            return peak
    return None


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _stage(profile: dict | None, command: str) -> dict | None:
    stages = [s for s in (profile or {}).get("summary", []) if s["command"] == command]
    return stages[-1] if stages else None


def rl_figures(profile: dict | None, peak: float | None, r: dict) -> dict:
    """Step time, rollout vs update seconds and the MFU of each from an RL profile: the update's model FLOPs are
    (6 N + 12 L H Q T) per trained token (PaLM's MFU), the rollout's 2 N per prompt and generated token."""
    s = _stage(profile, "rl")
    if s is None:
        return {}
    out = {k: s.get(k) for k in ("step_s", "first_step_s", "start_to_first_step_s", "compile_s", "compiles",
                                 "time/rollout_s", "time/train_s", "params")}
    if peak and s.get("matmul_params") and s.get("time/train_s"):
        length = r["prompt_words"] + (s.get("completion/length_mean") or r["new"])  # a word is a token
        train_flops = (6 * s["matmul_params"] + s["attn_coef"] * length) * (s.get("pack/tokens") or 0)
        out["update_mfu"] = train_flops / s["time/train_s"] / peak
        generated = r["prompts"] * r["group"] * (s.get("completion/length_mean") or r["new"])
        rollout_tokens = generated + r["prompts"] * r["group"] * r["prompt_words"]
        if s.get("time/generate_s"):
            out["rollout_mfu"] = 2 * s["matmul_params"] * rollout_tokens / s["time/generate_s"] / peak
            out["rollout_tokens_per_s"] = generated / s["time/generate_s"]
    out["programs"] = s["programs"]
    return out


def goals(out: Path, device_kind: str, tiny: bool) -> dict:
    """Issue 40's GPU figures from the step outputs, each with its target and whether it is met."""
    accel = (_load(out / "accel.json") or {}).get("jax") or {}
    # MFU against the chip's spec peak; on a chip not in the table, against the peak bench_accel measured
    peak = _spec_peak(device_kind)
    peak_source = "spec" if peak else None
    if peak is None and accel.get("peak_flops"):
        peak, peak_source = accel["peak_flops"], "measured"
    demo = _load(out / "demo.json")
    rl_stage, decode = _stage(demo, "rl"), accel.get("decode") or {}
    got = {"demo_total_s": (demo or {}).get("wall_s"),
           # from the RL stage's start (its model, evaluation at start, compiles) to the end of its first step
           "demo_first_rl_step_s": (rl_stage or {}).get("start_to_first_step_s"),
           "demo_rl_compile_s": (rl_stage or {}).get("compile_s"),
           "decode_step_ms_16": (decode.get("16") or {}).get("step_ms"),
           "decode_roofline_256": (decode.get("256") or {}).get("roofline_fraction"),
           "sft_mfu_of_spec": (accel["sft_mfu"] * accel["peak_flops"] / peak) if peak_source == "spec" and
                              "sft_mfu" in accel else None,
           "first_decode_call_s": (decode.get("16") or {}).get("first_call_s")}
    table = {}
    for name, (target, how) in GOALS.items():
        v = got[name]
        met = None if v is None else (v <= target if how == "<=" else v >= target)
        table[name] = {"value": None if v is None else round(v, 4), "target": f"{how} {target}", "met": met}
    size = "tiny" if tiny else "0.5b"
    stages = [{k: st.get(k) for k in ("command", "stage_s", "compile_s", "compiles", "start_to_first_step_s", "step_s")}
              for st in (demo or {}).get("summary", [])]
    return {"device": device_kind, "peak_flops": peak, "peak_source": peak_source, "figures": table,
            "demo_stages": stages,
            f"rl_{size}": rl_figures(_load(out / "rl.json"), peak, RUNS[size]),
            "autotune": {p.stem.removeprefix("autotune-"): {k: (_stage(_load(p), "sft") or {}).get(k)
                                                           for k in ("compile_s", "step_s", "first_step_s")}
                         for p in sorted(out.glob("autotune-*.json"))}}


def run(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(w) for w in KIT_DIR.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    # every step on the accelerator: the benchmarks default JAX_PLATFORMS to cpu (for this 2-core machine), so
    # leaving it unset there measured the GPU machine's CPU (the generate and grpo figures of 2026-11-25)
    env = dict(os.environ, PYTHONPATH=f"{SITE}:{ROOT}", PYTHONUNBUFFERED="1", POSTTRAIN_COMPILE_CACHE="0",
               JAX_PLATFORMS=args.platform)
    steps = _steps(args, out, sys.executable)
    assert list(steps) == STEPS
    order = args.only or (TINY_STEPS if args.tiny else STEPS)
    figures: dict = {}
    t0 = time.time()
    with open(out / "gpu_log.txt", "a") as log:
        for name in order:
            left = args.budget - (time.time() - t0) if args.budget else float("inf")
            if left < 30 and not args.only:
                figures[name] = {"skipped": f"the {args.budget} s budget is spent"}
                continue
            cmds, limit, extra = steps[name]
            figures[name] = _step(name, cmds, env, log, min(limit, args.step_limit, left), extra.get("per_command"))
            _write(out, figures, args.tiny)
    _write(out, figures, args.tiny)
    print(json.dumps(json.loads((out / "gpu_figures.json").read_text())["goals"], indent=1))
    return 0


def _write(out: Path, figures: dict, tiny: bool) -> None:
    """gpu_figures.json: the goals first, then each step's record (accel and rlupdate with their JSON)."""
    for name in ("accel", "rlupdate"):
        if name in figures and (out / f"{name}.json").exists():
            figures[name]["result"] = json.loads((out / f"{name}.json").read_text())
    device = ((figures.get("env") or {}).get("result") or {}).get("device_kind", "")
    (out / "gpu_figures.json").write_text(json.dumps({"goals": goals(out, device, tiny), **figures}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="download the kit's wheels into .whl/ and check the size")
    p = sub.add_parser("prepare", help="write a random model of a size, its word tokenizer, prompts and texts")
    p.add_argument("--size", choices=["tiny", "small", "0.5b"], required=True)
    p.add_argument("--dir", required=True)
    r = sub.add_parser("run", help="on the GPU machine: install the kit, run the steps, most important first")
    r.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    r.add_argument("--only", nargs="+", choices=STEPS, help="these steps, in this order, whatever the budget")
    r.add_argument("--platform", default="cuda", help="JAX_PLATFORMS for every step (cuda, tpu; cpu with --tiny)")
    r.add_argument("--budget", type=float, default=600, help="seconds for all steps (0 = no limit)")
    r.add_argument("--step-limit", type=int, default=1200, help="seconds at most for any one step")
    r.add_argument("--tiny", action="store_true", help="tiny models and sizes: the plumbing of the new steps, on CPU")
    args = ap.parse_args(argv)
    return {"build": build, "prepare": prepare, "run": run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
