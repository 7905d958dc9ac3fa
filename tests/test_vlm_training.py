"""Vision-language training: the frozen vision tower (no update, no optimizer state), LoRA kept off the tower
unless asked, images in placeholder order for the model, and an exactly resumable VLM SFT run."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from conftest import xla_flags

from posttrain.algorithms.sft import images_in_order
from posttrain.models import lora as lora_lib
from posttrain.training.config import LoraConfig, ModelSection
from posttrain.training.run import lora_target, trained_variables
from posttrain.training.sft import load_sft_config, run_sft

SMOKE = Path(__file__).parents[1] / "configs" / "vlm_smoke.yaml"


def _paths(state) -> set[str]:
    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state)}


@pytest.mark.slow  # builds a model: a few seconds
def test_trained_variables_leave_the_vision_tower_out(tiny_vlm):
    from posttrain.models.hf_io import from_pretrained

    net = from_pretrained(tiny_vlm)
    frozen = _paths(nnx.split(net, trained_variables(net, ModelSection()), ...)[1])
    assert frozen and not any("vision_tower" in p for p in frozen)
    assert any("multi_modal_projector" in p for p in frozen) and any("layers" in p for p in frozen)
    every = _paths(nnx.split(net, trained_variables(net, ModelSection(freeze_vision=False)), ...)[1])
    assert any("vision_tower" in p for p in every) and frozen < every


@pytest.mark.slow
def test_lora_stays_off_the_vision_tower_unless_asked(tiny_vlm):
    from posttrain.models.hf_io import from_pretrained

    for vision in (False, True):
        net = from_pretrained(tiny_vlm)
        paths = lora_lib.attach(net, rank=2, alpha=4, target=lora_target(net, LoraConfig(vision=vision)))
        on_tower = [p for p in paths if p.startswith("vision_tower")]
        assert bool(on_tower) == vision and any(not p.startswith("vision_tower") for p in paths)


def test_images_in_order_puts_real_images_first_row_by_row():
    class M:  # what images_in_order reads of a model: its vision config
        class cfg:
            class vision:
                image_token_id, mm_tokens_per_image = 9, 2

    px = np.arange(3 * 2, dtype=np.float32).reshape(3, 2, 1, 1, 1) + 1  # [B=3, M=2] images 1..6
    px[0, 1] = px[2, :] = 0  # row 0 has one image, row 1 two, row 2 none
    ids = np.array([[9, 9, 0, 0, 0], [9, 9, 3, 9, 9], [0, 0, 0, 0, 0]])
    got = np.asarray(images_in_order(px, ids, M)).reshape(-1)
    assert got.tolist() == [1, 3, 4, 0, 0, 0]


def _cfg(model, out, *overrides):
    return load_sft_config(SMOKE, [f"model.path={model}", f"output_dir={out}", "data.train=shapes:?size=64&seed=1",
                                   "data.eval=shapes:?size=16&seed=2", "data.batch_size=8", "trainer.max_steps=4",
                                   "trainer.save_every=1", "trainer.keep_checkpoints=1", "trainer.log_every=1",
                                   "trainer.eval_every=2", "trainer.eval_batches=1", "trainer.progress=false",
                                   "optim.warmup_steps=0", *overrides])


@pytest.mark.slow
def test_vlm_sft_frozen_tower_and_exact_resume(tiny_vlm, tmp_path):
    """SFT on image data: the vision tower's weights are bit-identical after training and it has no optimizer
    state, the projector and decoder change; a run stopped at step 2 and resumed has the same losses."""
    from safetensors.numpy import load_file

    full = run_sft(_cfg(tiny_vlm, tmp_path / "full"))
    tr = full.trainer
    assert not any("vision_tower" in p for p in _paths(tr.params))
    opt_paths = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(tr.opt_state)[0]}
    assert opt_paths and not any("vision_tower" in p for p in opt_paths)
    before, after = load_file(str(tiny_vlm / "model.safetensors")), load_file(str(full.hf_dir / "model.safetensors"))
    tower = [k for k in before if "vision_tower" in k]
    assert tower and all(np.array_equal(before[k], after[k]) for k in tower)
    changed = [k for k in before if k not in tower and not np.array_equal(before[k], after[k])]
    assert any("multi_modal_projector" in k for k in changed) and any("language_model" in k for k in changed)
    assert full.eval_loss is not None and np.isfinite(full.eval_loss)

    part = ("trainer.eval_every=0",)  # evaluation does not touch the training data order; less to compile
    assert run_sft(_cfg(tiny_vlm, tmp_path / "part", *part), stop_after=2).final_step == 2
    resumed = run_sft(_cfg(tiny_vlm, tmp_path / "part", *part))
    assert resumed.start_step == 2
    np.testing.assert_allclose([x for _, x in resumed.losses], [x for s, x in full.losses if s > 2], atol=1e-6)
    _check_eval_sampler_matches_greedy(full.hf_dir)


def _check_eval_sampler_matches_greedy(folder):
    """`posttrain eval`'s path for image prompts (the sampler given each prompt's images for its prefill) gives the
    greedy answers of the plain uncached decoder."""
    from posttrain.data import read_prompts
    from posttrain.data.vlm import VisionSpec, encode_image_prompt
    from posttrain.demo.vlm_eval import greedy_answers
    from posttrain.models import tokenizer as tok_lib
    from posttrain.models.hf_io import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    tok, model = tok_lib.load(folder), from_pretrained(folder)
    spec = VisionSpec.from_checkpoint(folder, tok)
    recs = read_prompts("shapes:?size=6&seed=5")
    enc = [encode_image_prompt(r["prompt"], tok, spec, f"prompt {i}") for i, r in enumerate(recs)]
    outs = Sampler(model, tok, max_slots=8).generate([ids for ids, _ in enc], SamplingParams(max_new_tokens=4,
                                                     temperature=0.0), images=[list(px) for _, px in enc])
    texts = [c.text for c in sorted(outs, key=lambda c: c.prompt_index)]
    assert texts == greedy_answers(model, tok, spec, [r["prompt"] for r in recs], max_new_tokens=4)


@pytest.mark.slow  # runs the CLI on the tiny VLM
def test_generate_cli_takes_image_prompts(tiny_vlm, tmp_path, capsys):
    """`posttrain generate` on chat prompts with image parts (TRL's format, image files on disk) gives the greedy
    answers of the plain uncached decoder; the same file for a text-only model is a one-line error."""
    import json

    from PIL import Image

    from posttrain.cli.main import main
    from posttrain.data.vlm import VisionSpec
    from posttrain.demo.vlm_eval import greedy_answers
    from posttrain.models import tokenizer as tok_lib
    from posttrain.models.hf_io import from_pretrained

    prompts, lines = [], []
    for i, colour in enumerate(["red", "blue", "green"]):
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (20 + 7 * i, 24), colour).save(path)
        msg = [{"role": "user", "content": [{"type": "image", "path": str(path)},
                                            {"type": "text", "text": "What colour is it?"}]}]
        prompts.append(msg)
        lines.append(json.dumps({"messages": msg}))
    lines.insert(1, json.dumps({"prompt": "a text prompt beside them"}))
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_vlm), "--prompts", str(src), "--output", str(out),
                 "--max-new-tokens", "4", "--temperature", "0", "--no-progress"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    tok, model = tok_lib.load(tiny_vlm), from_pretrained(tiny_vlm)
    want = greedy_answers(model, tok, VisionSpec.from_checkpoint(tiny_vlm, tok), prompts, max_new_tokens=4)
    assert [rows[i]["text"] for i in (0, 2, 3)] == want and len(rows) == 4

    assert main(["generate", "--model", "tiny:llama", "--prompts", str(src), "--output", str(out),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {src}, line 1: the record has 1 image(s) but the model is text-only")


@pytest.mark.slow  # a subprocess with 4 CPU devices: ~25 s
def test_vlm_qlora_sft_on_a_fsdp_tensor_mesh(tiny_vlm, tmp_path):
    """`posttrain sft` on image data with QLoRA (NF4 base, adapters on the decoder) on a 2 x 2 fsdp x tensor mesh
    of 4 devices: it trains (finite losses and eval loss), and the exported vision tower is bit-identical."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.numpy import load_file

    out = tmp_path / "qlora"
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "posttrain.cli.main", "sft", str(SMOKE), f"model.path={tiny_vlm}", f"output_dir={out}",
           "data.train=shapes:?size=64&seed=1", "data.eval=shapes:?size=16&seed=2", "data.batch_size=8",
           "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=1", "trainer.save_every=3",
           "trainer.log_every=1", "trainer.progress=false", "optim.warmup_steps=0", "lora.enabled=true",
           "lora.quantize=nf4",
           "mesh.fsdp=2", "mesh.tensor=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert any(np.isfinite(r.get("eval_loss", np.nan)) for r in rows)
    before, after = load_file(str(tiny_vlm / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    tower = [k for k in before if "vision_tower" in k]
    assert tower and all(np.array_equal(before[k], after[k]) for k in tower)
