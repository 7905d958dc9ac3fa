"""The compile budget (issue 40), counted with JAX's own compile events (`tests/compile_counter.py`), not timing.

Each command runs through the CLI as a user runs it, in a fresh process (JAX's in-memory caches would hide the
programs an earlier test compiled), on the smoke configs shortened to a few steps with an evaluation, a checkpoint
and the export on the way:
- sft, dpo, distill: the train step compiles once per run (a resumed run too: a restore compiles nothing), the
  evaluation once; the parameters and the train state are made by one program per tree, not one per leaf; an SFT
  smoke run compiles at most 8 programs in all.
- sft with LoRA and with QLoRA: the adapters, the NF4 quantisation of the base and the export's merge are one program
  each (`posttrain.models.lora`), within the same budget of 8.
- generate and eval: what holds today (prefill, decode and the sampler state at most twice each: greedy and
  sampled), and the weights load by plain transfers.
- rl (text, with a tool, with image prompts): the trainer's part (its step once, at most twice over packed rows of
  every completion length; its state by one program); at most 16 programs a run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from compile_counter import count_compiles

from posttrain.algorithms.sft import make_sft_loss
from posttrain.models.config import llama_like
from posttrain.models.transformer import init_model
from posttrain.training.checkpoint import Checkpointer
from posttrain.training.config import OptimConfig
from posttrain.training.optim import make_optimizer
from posttrain.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SHORT = ["trainer.progress=false", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=2"]

#: runs `posttrain ARGV` for each ARGV of its JSON argument in one fresh process (the tiny checkpoints built first,
#: outside the count) and prints each run's exit code and compiled programs by name
RUNNER = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from compile_counter import count_compiles
from posttrain.cli.main import main
from posttrain.models.tiny import resolve_model_path
for spec in ("tiny:llama", "tiny:llama-small", "tiny:gemma3-vlm"):
    resolve_model_path(spec)
out = []
for argv in json.loads(sys.argv[1]):
    with count_compiles() as c:
        rc = main(["--no-compile-cache", *argv])
    out.append({{"rc": rc, "names": dict(c.names)}})
print("COMPILES " + json.dumps(out))
"""


class Counts(dict):
    """Compiles of one run by program name; `self["_prefill"]` sums the names holding "_prefill"."""

    def __missing__(self, key: str) -> int:
        return sum(n for name, n in self.items() if key in name and name != key)

    @property
    def total(self) -> int:
        return sum(dict.values(self))


def cli_compiles(*runs: list[str]) -> list[Counts]:
    """The programs each CLI run compiles (all runs in one fresh process, in order)."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(list(runs))], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("COMPILES ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("COMPILES "))
    for argv, r in zip(runs, results, strict=True):
        print(f"\n{' '.join(argv[:2])}: {sum(r['names'].values())} programs {r['names']}")
        assert r["rc"] == 0, (argv, proc.stderr[-3000:])
    return [Counts(r["names"]) for r in results]


def _one_per_tree(c: Counts) -> None:
    """No eager one-leaf programs of the training side: the state's init is one program, batches and weights
    are plain transfers."""
    leafwise = {k: n for k, n in c.items() if k in ("jit(stage)", "jit(broadcast_in_dim)", "jit(_threefry_seed)")}
    assert not leafwise, leafwise
    assert c["jit(init_train_state)"] == 1


# ---------------------------------------------------------------------------------------- in process, fast
CFG = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _batch(b: int = 4, t: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, size=(b, t)).astype(np.int32)
    return {"input_ids": ids, "loss_mask": np.ones((b, t), np.float32), "attention_mask": np.ones((b, t), np.int32)}


def test_train_state_is_one_program_and_restore_and_batches_compile_nothing(tmp_path):
    tx, schedule = make_optimizer(OptimConfig(name="adamw", lr=1e-2, warmup_steps=1), 10)
    model = init_model(CFG, seed=0)
    with count_compiles() as made:
        tr = Trainer(model, tx, loss_fn=make_sft_loss(), schedule=schedule, seed=3)
    # AdamW's moments and count, the RNG key: one program (eagerly: one per leaf shape and the key's two)
    assert made.names == {"jit(init_train_state)": 1}, made
    tr.step(_batch())
    ck = Checkpointer(tmp_path / "ck", keep=1, async_save=False)
    ck.save(tr)
    with count_compiles() as moved:
        tr.put_batch(_batch(b=2, t=7))  # a new shape: a transfer, not a program
        ck.restore(tr)
    assert moved.total == 0, moved
    with count_compiles() as stepped:
        tr.step(_batch(seed=1))  # restored arrays keep the step's signature: no second compile
    assert stepped.total == 0, stepped
    ck.close()
    assert tr.step_count == 2 and np.asarray(tr.rng).dtype == np.uint32


def test_loading_a_checkpoint_places_weights_without_programs(tmp_path):
    from posttrain.models.hf_io import from_pretrained, save_pretrained

    save_pretrained(init_model(CFG, seed=1), tmp_path / "m")
    with count_compiles() as c:
        m = from_pretrained(tmp_path / "m")
    assert c.total == 0, c
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(m))


# ---------------------------------------------------------------------------------------- the CLI, one process each
@pytest.mark.slow
def test_sft_smoke_compiles_its_step_once_and_at_most_8_programs_also_when_resumed(tmp_path):
    out = f"output_dir={tmp_path / 'sft'}"
    fresh, resumed = cli_compiles(["sft", "configs/sft_smoke.yaml", out, *SHORT],
                                  ["sft", "configs/sft_smoke.yaml", out, *SHORT, "trainer.max_steps=6"])
    for c in (fresh, resumed):
        assert c["jit(step_fn)"] == 1 and c["jit(eval_fn)"] == 1, c
        _one_per_tree(c)
        assert c.total <= 8, c


@pytest.mark.slow
def test_lora_and_qlora_sft_make_adapters_quantise_and_merge_in_one_program_each(tmp_path):
    # one process each: in one process the second run would reuse the first one's adapter program
    (lora_run,) = cli_compiles(["sft", "configs/sft_smoke.yaml", f"output_dir={tmp_path / 'lora'}", *SHORT,
                                "lora.enabled=true"])
    (qlora_run,) = cli_compiles(["sft", "configs/sft_smoke.yaml", f"output_dir={tmp_path / 'qlora'}", *SHORT,
                                 "lora.enabled=true", "lora.quantize=nf4"])
    for c in (lora_run, qlora_run):
        assert c["jit(step_fn)"] == 1 and c["jit(eval_fn)"] == 1, c
        _one_per_tree(c)
        assert c["jit(_lora_init)"] == 1 and c["jit(_lora_merge)"] == 1, c  # one program each, not one per leaf
        assert c.total <= 8, c
    assert lora_run["jit(_nf4_quantize)"] == 0 and qlora_run["jit(_nf4_quantize)"] == 1, (lora_run, qlora_run)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["dpo", "distill"])
def test_smoke_run_compiles_its_step_once(command, tmp_path):
    (c,) = cli_compiles([command, f"configs/{command}_smoke.yaml", f"output_dir={tmp_path / command}", *SHORT])
    assert c["jit(step_fn)"] == 1 and c["jit(eval_fn)"] == 1, c
    _one_per_tree(c)
    assert c.total <= 8, c


@pytest.mark.slow
def test_rl_smoke_trains_with_one_step_program_and_at_most_16_programs(tmp_path):
    """The RL smoke run (held-out evaluation, greedy and sampled rollouts, a checkpoint): one train step, prefill at
    most twice, decode once, at most 16 programs in all (8 on 2026-11-28: init, step, the sampler's weight copy
    and state, prefill twice, decode, the advantages; 10 with issue 51's default rollout correction: the trainer's
    scoring of pi_old and the correction, one program each)."""
    (c,) = cli_compiles(["rl", "configs/rl_smoke.yaml", f"output_dir={tmp_path / 'rl'}", "trainer.progress=false",
                         "trainer.max_steps=3", "trainer.save_every=2"])
    assert c["jit(step_fn)"] == 1, c
    assert c["jit(_prefill)"] <= 2 and c["jit(_decode)"] == 1, c
    assert c.total <= 16, c
    _one_per_tree(c)


@pytest.mark.slow
def test_rl_with_tools_and_with_images_compile_their_step_once(tmp_path):
    """Multi-turn rollouts with a tool (completion buffers of every length up to the trajectory budget, in packed
    and shared-prompt rows) and image prompts (padded rows, the images in every pass): the train step at most twice
    (`posttrain.rl.packing.PackPlan`: the first batch's rows, then the worst case), the padded image batches once;
    the sampler's programs as in the text run; at most 16 programs each."""
    common = ["trainer.progress=false", "trainer.max_steps=3", "eval.at_start=false", "trainer.save_every=0"]
    tools, images = cli_compiles(
        ["rl", "configs/rl_smoke.yaml", f"output_dir={tmp_path / 'tools'}", *common, "rollout.tools=[calculator]",
         "rollout.max_turns=2", "data.max_prompt_tokens=1024"],
        ["rl", "configs/vlm_rl_smoke.yaml", f"output_dir={tmp_path / 'vlm'}", *common, "model.path=tiny:gemma3-vlm",
         "data.train=shapes:?size=16&seed=1", "data.eval=null", "rollout.batch_prompts=2", "rollout.group_size=4",
         "rollout.max_new_tokens=4"])
    assert 1 <= tools["jit(step_fn)"] <= 2 and tools["_decode"] <= 2, tools
    assert images["jit(step_fn)"] == 1 and images["_prefill"] <= 2 and images["_decode"] <= 1, images
    for c in (tools, images):
        assert c.total <= 16, c
        _one_per_tree(c)


@pytest.mark.slow
def test_generate_and_eval_compile_each_sampler_program_at_most_twice(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(x) for x in (ROOT / "tests" / "data" / "rl_prompts_tiny.jsonl").read_text().splitlines()]
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"][0]["content"]}) + "\n" for r in rows))
    gen, ev = cli_compiles(
        ["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--output", str(tmp_path / "g.jsonl"),
         "--max-new-tokens", "16", "--n", "2", "--chat", "--no-progress"],
        ["eval", "--model", "tiny:llama", "--data", "tests/data/rl_prompts_tiny.jsonl", "--n", "4",
         "--max-new-tokens", "16", "--reward-workers", "0", "--output", str(tmp_path / "e.jsonl"), "--no-progress"])
    assert gen["_prefill"] <= 1 and gen["_decode"] <= 1 and gen.total <= 4, gen
    assert ev["_prefill"] <= 2 and ev["_decode"] <= 2 and ev.total <= 8, ev
    for c in (gen, ev):
        assert c["jit(stage)"] == 0, c  # the weights load by transfers
