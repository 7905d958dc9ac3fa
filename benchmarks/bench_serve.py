"""Benchmark: `posttrain serve` against `transformers serve --continuous-batching` on the same checkpoint, with 1, 4,
16 and 64 concurrent clients: output tokens/s, time to first token (p50, p99) and inter-token latency.

Checkpoint: a Llama-shaped model with random weights built by transformers (unit-scale activations, as
bench_generate.py's) and a word-level tokenizer (`w0` ... one token each), saved as one HF folder that both servers
load. `--size small`: vocab 8192, hidden 256, intermediate 768, 4 layers, 4 heads / 2 KV heads (~10 M parameters);
`0.1b`: vocab 16384, hidden 768, intermediate 2048, 12 layers, 12 / 4 heads (~0.1 B).

Both servers run as processes of their own at the same time (an idle server uses no CPU; checked before the
run), float32, on `--device` (cpu: XLA's and torch's CPU backends). For each concurrency C (in the order given, the
two servers alternating which goes first), C clients each send `--rounds` streamed /v1/completions requests one
after another: a prompt of `--prompt` random words, `--new` tokens at temperature 0 (ours with `ignore_eos`; the
random model rarely says its end-of-sequence token, and the tokens each answer really had are counted from its
usage). Figures per server and C: output tokens/s = all completion tokens / wall seconds of the level; TTFT = the
first chunk with text after the request was sent (p50, p99 over requests); ITL = (last chunk - first chunk) /
(tokens - 1) per request (p50, p99). Our server streams a decode segment's tokens together (`--segment-steps`).

Memory: `transformers serve --continuous-batching` sizes its paged KV cache from the device's free memory (on CPU
90% of the machine's RAM, touched as it fills: ~14 GB resident on a 24 GiB machine). So its cache is given here
(`--cb-block-size 32`, `--cb-num-blocks` for every client's prompt and answer at the largest level plus a margin,
`--cb-max-batch-tokens`), and a watchdog samples both servers' resident memory (every process of the server's
session) twice a second: a server over `--max-rss-gb` is stopped, its remaining levels are skipped, and the report
says so (`stopped`). Each server's peak resident memory is reported (`peak_rss_gb`).

    python benchmarks/bench_serve.py [--size small] [--clients 1 4 16 64] [--rounds 2] [--new 128] [--json F]
    python benchmarks/bench_serve.py --clients 1 4 --rounds 1 --new 16 --prompt 16   # a quick check
    python benchmarks/bench_serve.py --max-rss-gb 3   # stop a server that grows past 3 GB resident

The last line printed is `RESULT {json}` (benchmarks/gpu_kit.py reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "0.1b": dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}


def build_checkpoint(out: Path, size: str, seed: int = 0) -> Path:
    """The HF folder both servers load (weights from torch's generator, word tokenizer)."""
    import torch
    import transformers

    from posttrain.models.tokenizer import SPECIAL_TOKENS, build_tokenizer

    shape = SIZES[size]
    tok = build_tokenizer(out, vocab=[f"w{i}" for i in range(shape["vocab_size"] - len(SPECIAL_TOKENS))],
                          kind="word")
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=1024, bos_token_id=1,
                                   eos_token_id=tok.eos_token_id, pad_token_id=0, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # unit-scale activations: greedy sequences are not degenerate
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_rss(sid: int) -> int:
    """Resident bytes of every process in session `sid` (a server started with `start_new_session`: its workers
    and compiler processes too), from /proc."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == sid:
            total += int(fields[21]) * page
    return total


class MemoryWatch(threading.Thread):
    """Samples each server's resident memory every `every` seconds, keeps the peak, and stops a server that goes
    over `limit` bytes (`stopped[name]` says why)."""

    def __init__(self, servers: dict, limit: float, every: float = 0.5):
        super().__init__(daemon=True)
        self.servers, self.limit, self.every = servers, limit, every
        self.peak = dict.fromkeys(servers, 0)
        self.stopped: dict[str, str] = {}
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(self.every):
            for name, s in list(self.servers.items()):
                if name in self.stopped or s.proc.poll() is not None:
                    continue
                rss = session_rss(s.proc.pid)
                self.peak[name] = max(self.peak[name], rss)
                if rss > self.limit:
                    self.stopped[name] = f"{rss / 2**30:.2f} GB resident > the {self.limit / 2**30:.2f} GB limit"
                    print(f"{name:>12} stopped: {self.stopped[name]}", flush=True)
                    s.stop()


class ServerProcess:
    """A server in a process of its own; `url` once it answers."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict):
        self.name, self.port, self.log = name, port, log
        self.file = open(log, "w")  # noqa: SIM115 - open for the process's life
        self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 900.0) -> float:
        import httpx

        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not answer within {timeout} s")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # it ended meanwhile
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.file.closed:
            self.file.close()


async def one_request(client, url: str, model: str, prompt: str, new: int, extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    import httpx

    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or now
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:  # counted and reported: one failed request does not end the benchmark
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": tokens,
            "itl": (last - first) / (tokens - 1) if first and tokens > 1 else None}


async def level(url: str, model: str, prompts: list[str], clients: int, rounds: int, new: int, extra: dict) -> dict:
    import httpx

    async def client_loop(c: int, http):
        return [await one_request(http, url, model, prompts[(c * rounds + r) % len(prompts)], new, extra)
                for r in range(rounds)]

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        t0 = time.perf_counter()
        done = [x for part in await asyncio.gather(*(client_loop(c, http) for c in range(clients))) for x in part]
        wall = time.perf_counter() - t0
    results = [r for r in done if "error" not in r]
    errors = [r["error"] for r in done if "error" in r]
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(r["itl"] for r in results if r["itl"] is not None)
    tokens = sum(r["tokens"] for r in results)

    def pct(xs, q):
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

    return {"clients": clients, "requests": len(results), "errors": len(errors), "first_error": errors[:1],
            "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
            "itl_mean": round(statistics.fmean(itl), 4) if itl else None}


def start_servers(folder: Path, args, work: Path) -> dict[str, ServerProcess]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    ours_port, theirs_port = free_port(), free_port()
    ours = ServerProcess("posttrain", [sys.executable, "-m", "posttrain.cli.main", "serve", str(folder), "--port",
                                       str(ours_port), "--served-model-name", "m", "--max-slots",
                                       str(args.max_slots), "--segment-steps", str(args.segment_steps)],
                         ours_port, work / "posttrain.log", env)
    block = 32  # every client's prompt and answer at the largest level in the paged cache, and a quarter more
    blocks = max(args.clients) * -(-(args.prompt + args.new + 8) // block) * 5 // 4
    theirs = ServerProcess("transformers", ["transformers", "serve", "--continuous-batching", str(folder), "--port",
                                            str(theirs_port), "--device", args.device, "--dtype", "float32",
                                            "--host", "127.0.0.1", "--cb-block-size", str(block),
                                            "--cb-num-blocks", str(blocks),
                                            "--cb-max-batch-tokens", str(args.peer_batch_tokens)],
                           theirs_port, work / "transformers.log", env)
    return {"posttrain": ours, "transformers": theirs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--prompt", type=int, default=64, help="prompt words (tokens)")
    p.add_argument("--new", type=int, default=128, help="tokens per answer")
    p.add_argument("--max-slots", type=int, default=16, help="our server's slots")
    p.add_argument("--segment-steps", type=int, default=16, help="our server's decode steps between looks")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--max-rss-gb", type=float, default=None,
                   help="stop a server whose processes hold more resident memory (GB) and skip its other levels "
                        "(default 6 on cpu, where the KV cache is in RAM too; 32 on an accelerator)")
    p.add_argument("--peer-batch-tokens", type=int, default=2048,
                   help="transformers' --cb-max-batch-tokens (its attention masks grow with it)")
    p.add_argument("--only", choices=["posttrain", "transformers"], default=None, help="measure one server only")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.max_rss_gb is None:
        args.max_rss_gb = 6.0 if args.device == "cpu" else 32.0
    import numpy as np

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    folder = build_checkpoint(work / "model", args.size)
    rng = np.random.default_rng(0)
    n_words = SIZES[args.size]["vocab_size"] - 7
    prompts = [" ".join(f"w{i}" for i in rng.integers(0, n_words, args.prompt)) for _ in range(64)]
    servers = start_servers(folder, args, work)
    if args.only:
        servers.pop("transformers" if args.only == "posttrain" else "posttrain").stop()
    out = {"size": args.size, "prompt": args.prompt, "new": args.new, "rounds": args.rounds,
           "max_slots": args.max_slots, "segment_steps": args.segment_steps, "device": args.device,
           "max_rss_gb": args.max_rss_gb, "peer_batch_tokens": args.peer_batch_tokens, "levels": {}}
    watch = MemoryWatch(servers, args.max_rss_gb * 2**30)
    watch.start()
    try:
        measure(servers, watch, args, prompts, str(folder), out)
    finally:
        watch.done.set()
        watch.join()
        for s in servers.values():
            s.stop()
    out["peak_rss_gb"] = {name: round(b / 2**30, 2) for name, b in watch.peak.items()}
    out["stopped"] = watch.stopped
    print("peak resident memory: " + ", ".join(f"{k} {v} GB" for k, v in out["peak_rss_gb"].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def measure(servers: dict[str, ServerProcess], watch: MemoryWatch, args, prompts: list[str], folder: str, out: dict):
    """Warm-up at every level, the idle check, then each level on each server still running (alternating which goes
    first); fills `out`."""
    for name, s in servers.items():
        try:
            out[f"{name}_start_s"] = round(s.wait_ready(), 1)
        except RuntimeError:
            if name not in watch.stopped:
                raise
    model = {"posttrain": "m", "transformers": folder}
    extra = {"posttrain": {"ignore_eos": True}, "transformers": {}}
    for name, s in servers.items():  # warm-up at every level: our prefill shapes compile, their first batches
        for c in args.clients:
            if name not in watch.stopped:
                asyncio.run(level(s.url, model[name], prompts, c, 1, 4, extra[name]))
    running = {name: s for name, s in servers.items() if name not in watch.stopped}
    idle = {name: s.cpu_seconds() for name, s in running.items()}
    time.sleep(5)
    out["idle_cpu_s_per_5s"] = {name: round(s.cpu_seconds() - idle[name], 2) for name, s in running.items()}
    for i, c in enumerate(args.clients):
        order = list(servers) if i % 2 == 0 else list(servers)[::-1]
        for name in order:
            if name in watch.stopped:
                continue
            r = asyncio.run(level(servers[name].url, model[name], prompts, c, args.rounds, args.new, extra[name]))
            if name in watch.stopped:  # stopped during this level: its figures are not the server's
                r["stopped"] = watch.stopped[name]
            out["levels"].setdefault(str(c), {})[name] = r
            print(f"{name:>12} clients {c:>3}: {r['tokens_per_s']:>8.1f} tok/s  TTFT p50 {r['ttft_p50']} s "
                  f"p99 {r['ttft_p99']} s  ITL p50 {r['itl_p50']} s  ({r['tokens']} tokens, {r['seconds']} s"
                  + (f", {r['errors']} failed: {r['first_error'][0]}" if r["errors"] else "") + ")", flush=True)
        pair = out["levels"].get(str(c), {})
        if "posttrain" in pair and "transformers" in pair and "stopped" not in pair["transformers"]:
            pair["ratio"] = round(pair["posttrain"]["tokens_per_s"] / max(pair["transformers"]["tokens_per_s"], 1e-9), 2)
            print(f"{'':>12} clients {c:>3}: posttrain / transformers = {pair['ratio']}x", flush=True)
    ours = {c: out["levels"].get(str(c), {}).get("posttrain") for c in (1, 16)}
    if all(ours.values()):  # 16 clients at once against the same requests one after another (1 client)
        out["posttrain_16_vs_1"] = round(ours[16]["tokens_per_s"] / max(ours[1]["tokens_per_s"], 1e-9), 2)
        print(f"   posttrain 16 clients / 1 client: {out['posttrain_16_vs_1']}x aggregate tokens/s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
