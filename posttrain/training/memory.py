"""Compiled memory of a training step from abstract shapes: nothing is allocated or run.

`step_memory(cfg, batch, seq)` lowers and compiles one full-parameter SFT step (forward, backward through
the chunked loss, AdamW update; parameters and optimizer state donated, as `Trainer` does) for
`jax.ShapeDtypeStruct` inputs and returns XLA's `memory_analysis()` figures. Temporary bytes are the
activations and scratch the step needs beyond its arguments and outputs: what rematerialisation
(`ModelConfig.remat`) trades for recomputation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.algorithms.sft import sft_loss
from posttrain.models.config import ModelConfig, RopeConfig
from posttrain.models.transformer import Transformer

__all__ = ["step_memory", "llama_1b"]


def llama_1b(**overrides):
    """A Llama-3.2-1B-shaped config (16 layers, hidden 2048, mlp 8192, 32/8 heads x 64, vocab 128256, tied)."""
    fields = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                  num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
                  rope=RopeConfig(theta=500000.0), tie_word_embeddings=True, param_dtype="bfloat16",
                  compute_dtype="bfloat16")
    fields.update(overrides)
    return ModelConfig(**fields)


def step_memory(cfg, batch: int, seq: int, *, chunk_size: int | None = 1024) -> dict[str, int]:
    """Bytes of the compiled SFT step of `cfg` on a [batch, seq] batch: temp, argument, output, generated code."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    tx = optax.adamw(1e-4)
    opt = jax.eval_shape(tx.init, params)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    data = {"input_ids": ids, "loss_mask": ids}

    def step(params, opt, data):
        def loss(p):
            ls, w, _ = sft_loss(nnx.merge(graphdef, p), data, chunk_size=chunk_size)
            return ls / jnp.maximum(w, 1.0)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt, data).compile()
    m = compiled.memory_analysis()
    return {"temp": int(m.temp_size_in_bytes), "argument": int(m.argument_size_in_bytes),
            "output": int(m.output_size_in_bytes), "alias": int(m.alias_size_in_bytes),
            "code": int(m.generated_code_size_in_bytes)}
