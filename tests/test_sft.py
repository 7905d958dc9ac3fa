"""End-to-end SFT: loss goes down, outputs (metrics, TensorBoard, checkpoints, HF export), exact resume, bad input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from posttrain.config import ConfigError
from posttrain.data import DataError
from posttrain.training.sft import ResumeError, TrainingDivergedError, load_sft_config, run_sft

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "sft_smoke.yaml"
DATA = ROOT / "tests" / "data" / "sft_tiny.jsonl"



@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from posttrain.models.tiny import resolve_model_path

    return resolve_model_path("tiny:llama", cache_dir=tmp_path_factory.mktemp("tiny"))


def _cfg(tiny, out, *overrides):
    return load_sft_config(SMOKE, [f"model.path={tiny}", f"data.train={DATA}", f"output_dir={out}",
                                   "trainer.progress=false", *overrides])


def _hf_logits(folder, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_sft_smoke_learns_and_writes_everything(tiny_llama, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_llama, out, "trainer.max_steps=80", "trainer.eval_every=40", "trainer.save_every=40",
               "trainer.profile.start_step=3", "trainer.profile.steps=2")
    res = run_sft(cfg)
    losses = [x for _, x in res.losses]
    first, last = float(np.mean(losses[:5])), float(np.mean(losses[-5:]))
    print(f"\nSFT smoke (tiny:llama, 80 steps): loss {first:.3f} (first 5 steps) -> {last:.3f} (last 5); "
          f"eval {res.eval_loss:.3f}")
    assert first > 3.0 and last < 0.25 * first and res.eval_loss < 0.3 * first

    # Resolved config round-trips; metrics.jsonl has step and loss on every line.
    assert load_sft_config(out / "config.yaml") == cfg
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40, 50, 60, 70, 80]
    assert all({"loss", "grad_norm", "lr", "tokens"} <= r.keys() for r in records)
    assert "first_step_time" in records[0] and all("tokens_per_sec" in r for r in records[1:])
    assert "eval_loss" in records[4] and "eval_loss" in records[-1]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(list((out / "tensorboard").glob("plugins/profile/*/*.xplane.pb"))) == 1  # trainer.profile's trace
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["40", "80"]

    # The HF export loads in transformers and computes what our trained model computes.
    ids = np.asarray([[1, 5, 20, 33, 40, 2, 6, 17]], np.int32)
    ours = np.asarray(res.trainer.model()(ids))
    np.testing.assert_allclose(_hf_logits(res.hf_dir, ids), ours, atol=1e-4)
    assert (res.hf_dir / "tokenizer.json").exists() and (res.hf_dir / "tokenizer_config.json").exists()


@pytest.mark.slow
def test_qlora_sft_exports_merged_model(tiny_llama, tmp_path):
    out = tmp_path / "qlora"
    cfg = _cfg(tiny_llama, out, "trainer.max_steps=12", "lora.enabled=true", "lora.quantize=nf4",
               "lora.block_size=32", "optim.lr=1e-2", "trainer.eval_every=0", "trainer.save_every=6")
    res = run_sft(cfg)
    losses = [x for _, x in res.losses]
    first, last = float(np.mean(losses[:3])), float(np.mean(losses[-3:]))
    print(f"\nQLoRA SFT: loss {first:.3f} (first 3 steps) -> {last:.3f} (last 3)")  # seen: 4.58 -> 2.31
    # a real drop: with lr=0 (adapters never move) the two means differ by ~0.002
    assert all(math.isfinite(x) for x in losses) and last < 0.75 * first
    assert res.trainer.has_lora
    # lora_b starts at zero and was trained away from it
    lora_b = np.asarray(res.trainer.params["layers"]["self_attn"]["q_proj"]["lora_b"][...])
    assert np.abs(lora_b).max() > 1e-3
    # Checkpoints hold only the adapters and the optimizer state.
    from posttrain.training.checkpoint import tree_to_nested

    saved = tree_to_nested(res.trainer.state_dict())["params"]
    assert set(saved["layers"]["self_attn"]["q_proj"]) == {"lora_a", "lora_b"}
    ids = np.asarray([[1, 5, 20, 33, 40, 2, 6, 17]], np.int32)
    with_adapters = np.asarray(res.trainer.model()(ids))  # NF4 base (dequantised) + adapters
    exported = _hf_logits(res.hf_dir, ids)
    np.testing.assert_allclose(exported, with_adapters, atol=1e-4)
    # the merged export is not the NF4 base: the adapters' change is in it
    base = np.asarray(res.trainer.model(adapters=False)(ids))
    assert np.abs(exported - base).max() > 0.1


@pytest.mark.slow
def test_resume_gives_the_same_run(tiny_llama, tmp_path):
    common = ("trainer.max_steps=10", "trainer.save_every=3", "trainer.eval_every=0", "export_hf=false")

    def hook(seen):
        def record(step, batch):
            seen[step] = batch["input_ids"].copy()
            return batch
        return record

    seen_full: dict = {}
    full = run_sft(_cfg(tiny_llama, tmp_path / "full", *common), batch_hook=hook(seen_full))

    # Stopped after 5 steps (checkpoint at 5), then resumed.
    seen_a: dict = {}
    first = run_sft(_cfg(tiny_llama, tmp_path / "a", *common), stop_after=5, batch_hook=hook(seen_a))
    assert first.final_step == 5 and first.hf_dir is None
    second = run_sft(_cfg(tiny_llama, tmp_path / "a", *common), batch_hook=hook(seen_a))
    assert second.start_step == 5
    np.testing.assert_allclose([x for _, x in second.losses], [x for s, x in full.losses if s > 5], atol=1e-6)

    # Crashed during step 5 (last checkpoint: step 3), then resumed.
    def crash(step, batch):
        if step == 5:
            raise KeyboardInterrupt("simulated crash")
        return batch

    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tiny_llama, tmp_path / "b", *common, "trainer.log_every=1"), batch_hook=crash)
    seen_b: dict = {}
    third = run_sft(_cfg(tiny_llama, tmp_path / "b", *common, "trainer.log_every=1"), batch_hook=hook(seen_b))
    assert third.start_step == 3
    np.testing.assert_allclose([x for _, x in third.losses], [x for s, x in full.losses if s > 3], atol=1e-6)

    # metrics.jsonl of the crashed-and-resumed run has each step once (step 4, logged before the crash
    # and run again after resuming from step 3, is not duplicated).
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))

    # Same data order: every step saw the same batch as in the uninterrupted run.
    for seen in (seen_a, seen_b):
        for step, ids in seen.items():
            np.testing.assert_array_equal(ids, seen_full[step])
    assert sorted(seen_a) == list(range(1, 11)) and sorted(seen_b) == list(range(4, 11))


@pytest.mark.slow
def test_lora_resume_and_bf16_export(tiny_llama, tmp_path):
    """A LoRA run stopped after step 2 and resumed equals the uninterrupted run (losses, exported weights;
    QLoRA resume is checked by the RL tests, test_rl_options.py); `export_dtype=bfloat16` writes a bf16
    checkpoint that `transformers` loads; keep_checkpoints=1 leaves one checkpoint; metrics.jsonl logs the
    losses the trainer returned."""
    from safetensors.torch import load_file

    common = ("trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_checkpoints=1", "trainer.log_every=1",
              "trainer.eval_every=0", "lora.enabled=true", "optim.lr=1e-2", "export_dtype=bfloat16")
    full = run_sft(_cfg(tiny_llama, tmp_path / "full", *common))
    assert run_sft(_cfg(tiny_llama, tmp_path / "part", *common), stop_after=2).final_step == 2
    resumed = run_sft(_cfg(tiny_llama, tmp_path / "part", *common))
    assert resumed.start_step == 2 and full.trainer.has_lora
    np.testing.assert_allclose([x for _, x in resumed.losses], [x for s, x in full.losses if s > 2], atol=1e-6)

    records = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == full.losses  # logged == returned, every step
    assert [p.name for p in (tmp_path / "full" / "checkpoints").iterdir() if p.name.isdigit()] == ["4"]

    a, b = load_file(full.hf_dir / "model.safetensors"), load_file(resumed.hf_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(v.dtype == torch.bfloat16 for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)  # the resumed run exports the same weights
    ids = np.asarray([[1, 5, 20, 33, 40, 2, 6, 17]], np.int32)
    ours = np.asarray(full.trainer.model()(ids))
    theirs = _hf_logits(full.hf_dir, ids)  # bf16 weights, computed in float32
    assert 0 < np.abs(theirs - ours).max() < 0.05


@pytest.mark.slow
def test_nan_loss_stops_with_message_and_keeps_last_checkpoint(tiny_llama, tmp_path):
    out = tmp_path / "nan"
    cfg = _cfg(tiny_llama, out, "trainer.max_steps=10", "trainer.save_every=2", "trainer.eval_every=0",
               "trainer.async_checkpointing=false")

    def poison(step, batch):
        if step == 5:
            batch = dict(batch, loss_mask=batch["loss_mask"] * np.float32("nan"))
        return batch

    with pytest.raises(TrainingDivergedError, match=r"non-finite loss at step 5.*last good checkpoint \(step 4\)"):
        run_sft(cfg, batch_hook=poison)
    assert not (out / "hf").exists()
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 5 and last["loss"] == "nan"
    # The last checkpoint is intact and holds finite weights; resuming (without the poison) continues.
    res = run_sft(_cfg(tiny_llama, out, "trainer.max_steps=6", "trainer.save_every=2", "trainer.eval_every=0",
                       "export_hf=false"))
    assert res.start_step == 4 and all(math.isfinite(x) for _, x in res.losses)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(res.trainer.params))
    # A checkpoint of another setting (full fine-tuning) is not silently taken for a LoRA run's.
    with pytest.raises(ResumeError, match="another model or LoRA setting"):
        run_sft(_cfg(tiny_llama, out, "trainer.max_steps=8", "lora.enabled=true"))


# ---------------------------------------------------------------------- bad input
def test_malformed_jsonl_names_file_and_line(tiny_llama, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = DATA.read_text().splitlines()[:4]
    lines[2] = lines[2][:-5]  # truncated JSON on line 3
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}:3:\d+: malformed JSON on line 3"):
        run_sft(_cfg(tiny_llama, tmp_path / "o", f"data.train={bad}"))


def test_missing_field_and_empty_data_set(tiny_llama, tmp_path):
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                       + json.dumps({"prompt": "no messages here"}) + "\n")
    with pytest.raises(DataError, match=r"missing\.jsonl, line 2: missing field 'messages'"):
        run_sft(_cfg(tiny_llama, tmp_path / "o", f"data.train={missing}"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        run_sft(_cfg(tiny_llama, tmp_path / "o", f"data.train={empty}"))


def test_unknown_config_key_lists_valid_keys(tiny_llama, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.max_stepz'.*max_steps, grad_accum"):
        _cfg(tiny_llama, tmp_path, "trainer.max_stepz=3")
    from posttrain.cli.main import main

    assert main(["sft", str(SMOKE), "lora.rnk=4"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'lora.rnk'" in err and "rank" in err


@pytest.mark.slow
def test_cli_runs_with_overrides(tmp_path, monkeypatch, capsys):
    """`posttrain sft CONFIG key=value ...` with model.path=tiny:llama, data.train, output_dir, trainer.max_steps."""
    from posttrain.cli.main import main

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cli"
    rc = main(["sft", str(SMOKE), "model.path=tiny:llama", f"data.train={DATA}", f"output_dir={out}",
               "trainer.max_steps=3", "trainer.progress=false", "trainer.eval_every=0"])
    assert rc == 0
    assert "done at step 3" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 3]
    assert (out / "hf" / "model.safetensors").exists() and (out / "config.yaml").exists()
    rc = main(["sft", str(SMOKE), "model.path=tiny:llama", f"data.train={tmp_path / 'nope.jsonl'}",
               f"output_dir={out}"])
    assert rc == 1 and "does not exist" in capsys.readouterr().err
