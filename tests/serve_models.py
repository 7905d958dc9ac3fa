"""A tiny "scripted" checkpoint for the server's tests: a Llama whose greedy continuation of each token is fixed
by construction, so that a chat reply is a Hermes tool call and other prompts give varied text.

The tokenizer is word-level (`build_tokenizer(kind="word")`): besides filler words it has three whole-piece
tokens, `<tool_call>`, one JSON call and `</tool_call>`. Embeddings are one-hot (hidden size >= vocabulary), the
LM head maps each token to its successor with a margin of `MARGIN` logits, and the layers' output projections are
scaled down so that attention and MLPs still change every log-prob (the echo tests compare them with
transformers) without changing the greedy successor: after the generation prompt `<|assistant|>` the model says
`<tool_call> {"name": "add", ...} </tool_call>` then end-of-sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(56)] + ["hello", "world", "yes", "no"]
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
CALL_TEXT = json.dumps(CALL)
TOOL_TOKENS = ["<tool_call>", CALL_TEXT, "</tool_call>"]
MARGIN = 6.0
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                             "parameters": {"type": "object", "properties": {
                                                 "a": {"type": "integer"}, "b": {"type": "integer"}},
                                                 "required": ["a", "b"]}}}


def successors(tok) -> dict[int, int]:
    """The greedy successor of every token id."""
    ids = {w: tok.encode(w, add_special_tokens=False)[0] for w in WORDS}
    call = [tok.hf.convert_tokens_to_ids(t) for t in TOOL_TOKENS]
    assistant, eos = tok.hf.convert_tokens_to_ids("<|assistant|>"), tok.eos_token_id
    words = [ids[w] for w in WORDS]
    nxt = {t: words[(7 * k + 3) % len(words)] for k, t in enumerate(range(len(tok)))}
    nxt.update({assistant: call[0], call[0]: call[1], call[1]: call[2], call[2]: eos})
    return nxt


def scripted_checkpoint(folder: str | Path) -> Path:
    """Writes the scripted model's HF folder (built with transformers: no compile) and returns it."""
    import torch
    import transformers

    from posttrain.models.tokenizer import build_tokenizer

    folder = Path(folder) / "hf"
    tok = build_tokenizer(folder, vocab=WORDS + TOOL_TOKENS, kind="word")
    v, d = len(tok), 128
    config = transformers.LlamaConfig(vocab_size=v, hidden_size=d, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=tok.eos_token_id,
                                      pad_token_id=0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    head = torch.zeros(v, d)
    for t, n in successors(tok).items():
        head[n, t] = MARGIN / d ** 0.5  # the final norm scales a one-hot row by sqrt(d)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(v, d))
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
    model.save_pretrained(folder)
    return folder


def lora_run(folder: str | Path, base: str | Path, rank: int = 4, seed: int = 1) -> Path:
    """A LoRA run's output folder as `posttrain sft ... lora.enabled=true` leaves it (config.yaml and a checkpoint
    of the adapters, written by the trainer's own `Checkpointer`), with random non-zero adapters over `base`."""
    import jax
    from flax import nnx

    from posttrain.models import from_pretrained
    from posttrain.models import lora as lora_lib
    from posttrain.training.checkpoint import Checkpointer

    folder = Path(folder)
    model = from_pretrained(base)
    lora_lib.attach(model, rank=rank, alpha=2.0 * rank, seed=seed)
    rng = np.random.default_rng(seed)
    params = nnx.state(model, nnx.LoRAParam)
    params = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32), params)

    class Saved:  # what `Checkpointer.save` reads of a trainer
        step_count = 1

        def state_dict(self):
            return {"params": params, "opt_state": {}, "step": np.asarray(1, np.int64),
                    "rng": np.zeros(2, np.uint32)}

    ck = Checkpointer(folder / "checkpoints", async_save=False)
    ck.save(Saved())
    ck.close()
    (folder / "config.yaml").write_text(f"model:\n  path: {base}\nlora:\n  enabled: true\n  rank: {rank}\n"
                                        f"  alpha: {2.0 * rank}\n")
    return folder


def with_adapters(base: str | Path, run: str | Path):
    """The base model with a LoRA run's adapters attached (the reference for the served adapter)."""
    from posttrain.models import from_pretrained
    from posttrain.models import lora as lora_lib
    from posttrain.models.weights import load_flat_weights
    from posttrain.training.checkpoint import read_trained_params

    model = from_pretrained(base)
    lora_lib.attach(model, rank=4, alpha=8.0)
    load_flat_weights(model, read_trained_params(Path(run) / "checkpoints")[1])
    return model


def peft_adapter(folder: str | Path, base: str | Path, rank: int = 2, alpha: float = 6.0, seed: int = 2) -> Path:
    """A LoRA adapter folder in PEFT's format over `base` (two adapted layers, random A and B), as `peft` writes it."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        tensors[f"base_model.model.{name}.lora_A.weight"] = rng.normal(size=(rank, 128)).astype(np.float32)
        tensors[f"base_model.model.{name}.lora_B.weight"] = 0.3 * rng.normal(size=(128, rank)).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "peft_type": "LORA",
                                                            "r": rank, "lora_alpha": alpha, "bias": "none"}))
    return folder
