"""Benchmark: a LoRA training step through the Tinker API (`forward_backward` + `optim_step` from the `tinker` SDK
over HTTP to `posttrain serve MODEL --tinker`) against the same LoRA step through `posttrain sft`: the API's
overhead as a ratio of tokens/s, in one run.

Same Llama-shaped model (random weights written once as a HF folder with a character tokenizer), same rows (random
letters, `--batch` rows of `--seq` tokens, loss on every target), same adapters (rank `--rank`, alpha 32, on the
attention, MLP and output head: Tinker's defaults), AdamW at a constant learning rate, float32. `posttrain sft`
runs the config below through its own CLI (data pipeline, logging, the jitted step) and reports each step's time in
metrics.jsonl; the API side times each `forward_backward` + `optim_step` pair from submitting both to having both
results (protobuf encoding, HTTP, futures and polling included). Each system runs in its own process, in alternating
rounds (sft, api, sft, api, ...) so both see the same machine load; step times are medians over the steps after
the first (which compiles). tokens/s = batch x seq / step time on both sides.

    python benchmarks/bench_tinker.py [--steps 12] [--rounds 2] [--batch 8] [--seq 256] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TINKER_TELEMETRY", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV = 8192, 256, 768, 4, 4, 2
TARGET = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)|lm_head"


def make_checkpoint(folder: Path) -> Path:
    from posttrain.models.config import llama_like
    from posttrain.models.hf_io import save_pretrained
    from posttrain.models.tokenizer import build_tokenizer
    from posttrain.models.transformer import init_model

    cfg = llama_like(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=LAYERS,
                     num_heads=HEADS, num_kv_heads=KV, head_dim=HIDDEN // HEADS, max_position_embeddings=2048)
    save_pretrained(init_model(cfg, seed=0), folder, tokenizer=build_tokenizer(folder / "_tok"))
    return folder


def make_rows(folder: Path, path: Path, n: int, seq: int) -> list[list[int]]:
    """`n` texts of random letters, written as a JSONL `text` dataset; returns their first `seq` token ids (what
    `posttrain sft` trains on after truncation)."""
    import numpy as np

    from posttrain.models import tokenizer as tok_lib

    tok = tok_lib.load(folder)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    texts = ["".join(rng.choice(letters, size=seq + 16)) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return [tok.encode(t)[:seq] for t in texts]


SFT_CONFIG = """\
model: {{path: {folder}, param_dtype: float32, compute_dtype: float32}}
data: {{train: {data}, seq_len: {seq}, batch_size: {batch}, pack: false, format: {{format: text}}}}
lora: {{enabled: true, rank: {rank}, alpha: 32, target: '{target}'}}
optim: {{name: adamw, lr: 1.0e-4, decay: constant, warmup_steps: 0, weight_decay: 0.0, clip_norm: 0.0}}
trainer: {{max_steps: {steps}, log_every: 1, eval_every: 0, save_every: {steps}, progress: false}}
export_hf: false
output_dir: {out}
"""


def run_sft(folder: Path, data: Path, out: Path, args) -> list[float]:
    """Step times of `posttrain sft` on the data (metrics.jsonl, log_every 1; the first step is logged apart)."""
    cfg = out.with_suffix(".yaml")
    cfg.write_text(SFT_CONFIG.format(folder=folder, data=data, seq=args.seq, batch=args.batch, rank=args.rank,
                                     target=TARGET, steps=args.steps, out=out))
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "sft", str(cfg)], capture_output=True,
                          text=True, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise RuntimeError(f"posttrain sft failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["step_time"] for r in rows if "step_time" in r]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_api(folder: Path, rows: list[list[int]], ckpts: Path, args) -> list[float]:
    """Step times of forward_backward + optim_step through the SDK against a server process of its own."""
    port = _free_port()
    log = ckpts.parent / "server.log"
    with open(log, "w") as err:  # a file, not a pipe: one log line per request never blocks the server
        server = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "serve", str(folder), "--tinker",
                                   "--port", str(port), "--tinker-checkpoints", str(ckpts), "--served-model-name",
                                   "bench"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, server, log)
        return _api_steps(url, rows, args)
    finally:
        server.terminate()
        server.wait(30)


def _api_steps(url: str, rows: list[list[int]], args) -> list[float]:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    tc = client.create_lora_training_client(base_model="bench", rank=args.rank, seed=0).result()
    adam = types.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.999, eps=1e-8)
    times = []
    for step in range(args.steps):
        batch = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                             loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
                 for r in rows[step * args.batch:(step + 1) * args.batch]]
        t = time.perf_counter()
        fb, opt = tc.forward_backward(batch, "cross_entropy"), tc.optim_step(adam)
        fb.result(), opt.result()
        times.append(time.perf_counter() - t)
    client.close("success").result()
    return times[1:]


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="steps per round and system (the first compiles)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds: sft, api, sft, api, ...")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = make_checkpoint(tmp / "bench-llama")
        rows = make_rows(folder, tmp / "rows.jsonl", args.batch * args.steps, args.seq)
        times: dict[str, list[float]] = {"sft": [], "api": []}
        for r in range(args.rounds):
            times["sft"] += run_sft(folder, tmp / "rows.jsonl", tmp / f"sft-{r}", args)
            times["api"] += run_api(folder, rows, tmp / f"ckpt-{r}", args)
            print(f"round {r + 1}: sft median {statistics.median(times['sft']):.3f} s, "
                  f"api median {statistics.median(times['api']):.3f} s", flush=True)
    tokens = args.batch * args.seq
    sft, api = statistics.median(times["sft"]), statistics.median(times["api"])
    print(f"LoRA rank {args.rank} on a Llama-shaped model (vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers), "
          f"batch {args.batch}x{args.seq}, float32, {args.rounds} alternating rounds of {args.steps} steps:")
    print(f"  posttrain sft     : {sft:.3f} s/step  {tokens / sft:,.0f} tokens/s ({len(times['sft'])} steps)")
    print(f"  Tinker API (SDK)  : {api:.3f} s/step  {tokens / api:,.0f} tokens/s ({len(times['api'])} steps)")
    print(f"  API / sft tokens/s: {sft / api:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
