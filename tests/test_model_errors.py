"""Bad checkpoints give clear errors: unknown model_type, missing or mis-shaped tensor, missing folder; and `posttrain info`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from posttrain.cli.main import main
from posttrain.models import CheckpointError, UnsupportedModelError, from_pretrained


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type_names_supported(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        from_pretrained(path)
    msg = str(e.value)
    assert "gpt_neox" in msg
    for family in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"):
        assert family in msg


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        from_pretrained(path)


def test_misshaped_tensor_names_expected_and_found(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        from_pretrained(path)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(16, 64)" in msg and "(32, 64)" in msg


def test_missing_folder_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        from_pretrained(tmp_path / "empty")


def test_info_prints_architecture_params_dtype(hf_checkpoint, capsys):
    import transformers

    path = hf_checkpoint("qwen3")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(path).parameters())
    assert "Qwen3ForCausalLM" in out and f"{n:,}" in out and "float32" in out


def test_info_on_missing_folder_fails_cleanly(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_config_json_is_read_through_one_family_table():
    """`ModelConfig.from_hf` takes each family's defaults and switches from its row of `FAMILIES` (one per supported
    model type) and stays short; a few rows read as transformers writes them."""
    import ast
    import inspect
    import textwrap

    from posttrain.models.config import FAMILIES, SUPPORTED_MODEL_TYPES, ModelConfig

    assert tuple(FAMILIES) == SUPPORTED_MODEL_TYPES
    source = textwrap.dedent(inspect.getsource(ModelConfig.from_hf))
    fn = ast.parse(source).body[0]
    assert fn.end_lineno - fn.lineno + 1 <= 60
    # no family named in it (but Gemma 3's multimodal wrapper, whose text part it reads)
    named = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and n.value in SUPPORTED_MODEL_TYPES}
    assert named <= {"gemma3_text"}, named
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 6,
            "num_attention_heads": 2}
    llama = ModelConfig.from_hf(dict(base, model_type="llama", attention_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.sliding_layers) == (True, True, (False,) * 6)
    qwen2 = ModelConfig.from_hf(dict(base, model_type="qwen2", sliding_window=4, use_sliding_window=True,
                                     max_window_layers=4))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.sliding_layers) == (True, False, (False,) * 4 + (True,) * 2)
    mistral = ModelConfig.from_hf(dict(base, model_type="mistral", sliding_window=4))
    assert mistral.sliding_layers == (True,) * 6 and not mistral.qkv_bias
    gemma3 = ModelConfig.from_hf(dict(base, model_type="gemma3_text", sliding_window=4))
    assert gemma3.sliding_layers == (True,) * 5 + (False,) and gemma3.rope.theta == 1_000_000.0
    assert gemma3.rope_local.theta == 10000.0 and gemma3.tie_word_embeddings and gemma3.hidden_act == "gelu_tanh"
