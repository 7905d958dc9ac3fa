"""The Gemma 3 vision-language model without transformers: `tiny:gemma3-vlm`, `posttrain info`, sharding of the
vision weights on an FSDP x tensor mesh, and the 4B config built with abstract shapes (its memory need)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from conftest import xla_flags

from posttrain.models import Transformer
from posttrain.models.config import ModelConfig


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from posttrain.models.tiny import resolve_model_path

    return resolve_model_path("tiny:gemma3-vlm", cache_dir=tmp_path_factory.mktemp("tiny-vlm"))


@pytest.mark.slow  # builds the tiny VLM (a few seconds)
def test_info_shows_the_vision_config(tiny_vlm, capsys):
    from posttrain.cli.main import main

    assert main(["info", tiny_vlm]) == 0
    out = capsys.readouterr().out
    assert "Gemma3ForConditionalGeneration" in out
    assert "SigLIP 2 layers, hidden 32" in out and "32 px, patch 4" in out
    assert "16 per image (id 8; boi 6, eoi 7)" in out
    cfg = ModelConfig.from_file(os.path.join(tiny_vlm, "config.json"))
    from posttrain.models import hf_io

    counted, _ = hf_io.count_checkpoint_params(tiny_vlm)
    assert cfg.num_params() == counted  # the vision tower and projector counted too


SHARD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from posttrain import distributed
    from posttrain.models import from_pretrained

    path = sys.argv[1]
    mesh = distributed.make_mesh(data=1, fsdp=4, tensor=2)
    vc = from_pretrained(path).cfg.vision
    ids = np.full((4, 24), 20)
    for r in range(4):
        ids[r, 2 + r:2 + r + vc.mm_tokens_per_image] = vc.image_token_id
    pix = np.random.default_rng(0).uniform(-1, 1, (4, 3, vc.image_size, vc.image_size)).astype(np.float32)
    fwd = jax.jit(lambda m, i, p: m(i, pixel_values=p))
    ref = np.asarray(fwd(from_pretrained(path), ids, pix))
    model = from_pretrained(path, mesh=mesh)
    out = np.asarray(fwd(model, jax.device_put(ids, distributed.batch_sharding(mesh)), pix))
    vt = model.vision_tower
    spec = lambda a: [s if not isinstance(s, tuple) else list(s) for s in a.sharding.spec]
    print(json.dumps({"diff": float(np.abs(out - ref).max()),
                      "q": spec(vt.layers.self_attn.q_proj.kernel[...]), "fc1": spec(vt.layers.mlp.fc1.kernel[...]),
                      "pos": spec(vt.position_embedding[...]),
                      "proj": spec(model.multi_modal_projector.mm_input_projection.kernel[...])}))
    """
)


@pytest.mark.slow
def test_vision_weights_sharded_on_fsdp_tensor_mesh(tiny_vlm):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARD_SCRIPT, tiny_vlm], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["diff"] <= 1e-5, r
    assert r["q"] == [None, "fsdp", "tensor", None]  # [layers, embed, heads, head_dim]
    assert r["fc1"] == [None, "fsdp", "tensor"]
    assert r["pos"] == [None, "fsdp"]
    assert r["proj"] == ["fsdp", None]


#: google/gemma-3-4b-it's config.json (the fields that shape the model)
GEMMA3_4B = {
    "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256,
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": 256,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                      "layer_norm_eps": 1e-6, "vision_use_head": False},
}


def test_gemma3_4b_config_builds_with_abstract_shapes(capsys):
    """configs/vlm_gemma3_4b.yaml's model (Gemma 3 4B's shapes, its numerics and LoRA from the YAML) built with
    abstract shapes: parameter count, and the memory of weights, adapters and their optimizer state."""
    import pathlib

    import yaml

    from posttrain.models import lora

    run = yaml.safe_load((pathlib.Path(__file__).parents[1] / "configs" / "vlm_gemma3_4b.yaml").read_text())
    m, lo = run["model"], run["lora"]
    cfg = ModelConfig.from_hf(GEMMA3_4B, param_dtype=m["param_dtype"], compute_dtype=m["compute_dtype"],
                              remat=m["remat"])
    assert cfg.vision.num_patches == 4096 and cfg.vision.tokens_per_side == 16 and cfg.sliding_window == 1024

    def build():
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        target = r"layers\..*" + lo["target"].removeprefix(".*")  # the decoder's layers only (lora.vision: false)
        lora.attach(model, rank=lo["rank"], alpha=lo["alpha"], target=target)
        return model

    abstract = nnx.eval_shape(build)
    size = lambda state: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))  # noqa: E731
    nbytes = lambda state: sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))  # noqa: E731
    base = nnx.state(abstract, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    adapters = nnx.state(abstract, nnx.LoRAParam)
    n = size(base)
    assert n == cfg.num_params()
    assert 4.2e9 < n < 4.4e9, n  # Gemma 3 4B: 4.3 B parameters, ~0.42 B of them in the SigLIP tower
    assert 4.0e8 < size(nnx.state(abstract.vision_tower)) < 4.4e8
    assert size(nnx.state(abstract.vision_tower, nnx.LoRAParam)) == 0
    micro = run["data"]["batch_size"] // run["trainer"]["grad_accum"] * run["data"]["seq_len"]
    need = {"weights": nbytes(base), "lora adapters": nbytes(adapters), "adamw moments": 2 * 4 * size(adapters),
            # remat full keeps one [tokens, hidden] bf16 residual per decoder layer for the backward pass
            "layer checkpoints": micro * cfg.hidden_size * 2 * cfg.num_layers}
    need["total"] = sum(need.values())
    with capsys.disabled():
        print(f"\nGemma 3 4B ({n / 1e9:.2f} B parameters, bf16, LoRA r={lo['rank']} on the decoder, frozen vision "
              "tower), memory: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items()))
    assert need["weights"] == 2 * n
    assert need["total"] < 20 * 2**30  # one 80 GB accelerator, with room for the step's temporaries
