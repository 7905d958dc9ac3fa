"""The decoder-only Transformer (Flax NNX) behind every supported family.

Layers are stored stacked: each per-layer parameter has a leading "layers" axis (created with
`nnx.vmap`), so the forward pass can `lax.scan` over layers (one compiled layer body, fast compiles)
or unroll them (`scan_layers=False`), with optional rematerialisation of the layer body. Calls with a
KV cache (sampling) unroll the layers, so each layer owns its cache arrays and updates them in place;
with the generic kernel set (`posttrain.models.kernels`) cached calls of many tokens (prefill) scan.

`model(input_ids, attention_mask=, positions=, segment_ids=)` -> float32 logits [B, T, V].
`model(..., cache=KVCache)` -> (logits, cache): the sampling engine's prefill and decode step.
`model.hidden_states(...)` and `model.logits(h)` split the two halves for chunked losses.

Mixtures of experts (`cfg.num_experts`, Qwen3-MoE, Mixtral, Qwen2-MoE): a block's MLP is the router and experts of
`posttrain.models.moe`; a model with dense layers too (`cfg.moe_layers`) gives every block both and picks one per
layer with the layer's flag. With `routing=True` every call above returns one more element, a `moe.Routing`: the
sparse layers' router logits (for the router losses, `posttrain.models.moe_loss`) and the router's own top-k
expert ids [B, T, L_sparse, k] (int8/int16, what a sampler records), from the same pass. `replay=` expert ids of
that shape route every token to the given experts (routing replay, `posttrain.models.moe`).

Vision-language checkpoints (`cfg.vision`, Gemma 3) add a SigLIP tower (`vision_tower`) and the projector
(`multi_modal_projector`); every call above also takes `pixel_values=` [N, C, H, W] float (the processor's
output) or `image_embeds=` [N, mm_tokens_per_image, D] (from `model.image_embeddings(pixel_values)`,
precomputed), which replace the embeddings of the image placeholder tokens in order (see
`posttrain.models.multimodal`) and make each image's tokens attend to each other bidirectionally. Without
either (text-only batches) the call is exactly the text model's: no vision tower, no extra mask work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import distributed
from posttrain.models import kernels as kernels_lib
from posttrain.models.attention import Attention, KVCache
from posttrain.models.config import ModelConfig
from posttrain.models import multimodal
from posttrain.models.layers import MLP, Embed, Linear, RMSNorm, dtype_of, rope_tables
from posttrain.models.mm_projector import Gemma3Projector
from posttrain.models.moe import Routing, SparseMoE, experts_dtype
from posttrain.models.siglip import SiglipEncoder


class Block(nnx.Module):
    """Pre-norm residual block; Gemma 2/3 add post-attention and post-MLP norms (and a pre-MLP norm).

    A mixture of experts' block holds the experts (`moe`, `posttrain.models.moe`) and, when some layers are dense
    (Qwen3-MoE's `mlp_only_layers`), the dense `mlp` too; the layer's flag picks one (the unused one's weights are
    zeros, never loaded or exported), so that the layers still stack and scan as one body.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg=cfg)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(d, cfg=cfg)
        if cfg.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(d, cfg=cfg)
            self.post_feedforward_layernorm = RMSNorm(d, cfg=cfg)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.mlp = MLP(cfg, rngs) if cfg.has_dense_mlp else None
        self.moe = SparseMoE(cfg, rngs) if cfg.is_moe else None

    def ffn(self, x, moe_l=None, replay=None, mesh=None):
        """(The dense MLP's or the experts' output, the router's (logits [B*T, E], own ids [B*T, k]) or None) per
        the layer's flag `moe_l` (a bool array under scan; a dense layer of a mixed model gives zeros)."""
        if self.moe is None:
            return self.mlp(x), None
        if self.mlp is None:
            y, logits, own = self.moe(x, replay, mesh)
            return y, (logits, own)

        def sparse(h):
            y, logits, own = self.moe(h, replay, mesh)
            return y, (logits, own)

        def dense(h):
            y = self.mlp(h)
            n = h.shape[0] * h.shape[1]
            return y, (jnp.zeros((n, self.moe.num_experts), y.dtype), jnp.zeros((n, self.moe.top_k), jnp.int32))

        return jax.lax.cond(moe_l, sparse, dense, x)

    def __call__(self, x, moe_l=None, replay=None, mesh=None, **attn_kw):
        """(x after the block, the layer's new cache arrays, its router output (logits, own ids) or None)."""
        h, new_cache = self.self_attn(self.input_layernorm(x), **attn_kw)
        if self.pre_feedforward_layernorm is not None:  # Gemma 2/3
            x = x + self.post_attention_layernorm(h)
            h, router = self.ffn(self.pre_feedforward_layernorm(x), moe_l, replay, mesh)
            h = self.post_feedforward_layernorm(h)
        else:
            x = x + h
            h, router = self.ffn(self.post_attention_layernorm(x), moe_l, replay, mesh)
        return x + h, new_cache, router


def _traced_at_model_precision(method):
    """Traces a model method under its kernel set's matmul precision (float32 compute stays float32 on GPU/TPU)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with jax.default_matmul_precision(kernels_lib.get(self.cfg).matmul_precision(self.cfg.compute_dtype)):
            return method(self, *args, **kwargs)

    return wrapped


class Transformer(nnx.Module):
    """Embedding, a stack of `Block`s, final norm and LM head (tied to the embedding when configured)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.kernels == "auto":  # resolved once, here (`posttrain.models.kernels.resolve`)
            cfg = cfg.replace(kernels=kernels_lib.resolve(cfg.kernels))
        self.cfg = cfg
        self.embed_tokens = Embed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg=cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear((cfg.hidden_size,), (cfg.vocab_size,), ("embed",), ("vocab",), bias=False,
                                  cfg=cfg, rngs=rngs)
        if cfg.vision is not None:
            self.vision_tower = SiglipEncoder(cfg, rngs)
            self.multi_modal_projector = Gemma3Projector(cfg, rngs)
        else:
            self.vision_tower = self.multi_modal_projector = None
        self.mesh = None  # set by from_pretrained(mesh=...) / distributed.shard_model

    # ------------------------------------------------------------------ helpers
    def _inputs(self, input_ids, attention_mask, positions, segment_ids):
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = (segment_ids != 0) if segment_ids is not None else jnp.ones((b, t), jnp.int32)
        attention_mask = attention_mask.astype(jnp.int32)
        if positions is None:
            # Left padding: real tokens count from 0 whatever the padding in front of them.
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
        return attention_mask, positions.astype(jnp.int32)

    def _rope(self, positions):
        cfg = self.cfg
        glob = rope_tables(positions, cfg.rope, cfg.head_dim)
        loc = rope_tables(positions, cfg.rope_local, cfg.head_dim) if cfg.rope_local is not None else None
        return glob, loc

    def embed(self, input_ids):
        cfg = self.cfg
        if cfg.vision is not None and cfg.vision.image_token_id >= cfg.vocab_size:  # an id outside the table
            input_ids = jnp.where(input_ids == cfg.vision.image_token_id, 0, input_ids)
        x = self.embed_tokens(input_ids).astype(dtype_of(cfg.compute_dtype))
        if cfg.embed_scale:
            x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)
        return x

    @_traced_at_model_precision
    def image_embeddings(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] images -> [N, mm_tokens_per_image, D] text-width embeddings (compute dtype)."""
        if self.vision_tower is None:
            raise ValueError(f"this {self.cfg.model_type} model has no vision tower: it takes text only")
        return self.multi_modal_projector(self.vision_tower(pixel_values, self.mesh))

    def _embed_inputs(self, input_ids, pixel_values, image_embeds):
        """Token embeddings with the image embeddings merged in, and the image block ids (None for text)."""
        x = self.embed(input_ids)
        if pixel_values is None and image_embeds is None:
            return x, None
        if pixel_values is not None and image_embeds is not None:
            raise ValueError("give pixel_values or image_embeds, not both")
        if image_embeds is None:
            image_embeds = self.image_embeddings(pixel_values)
        vc = self.cfg.vision
        x = multimodal.merge_image_embeddings(x, input_ids, image_embeds, vc)
        return x, multimodal.image_blocks(input_ids, vc)

    # ------------------------------------------------------------------ forward
    def layer_states(self) -> list[nnx.State]:
        """Per-layer parameter states, sliced once from the stacked layers (the sampler's decode loop takes
        them so that no step slices the stacked weights again)."""
        return _unstack(nnx.split(self.layers)[1], self.cfg.num_layers)

    @_traced_at_model_precision
    def hidden_states(self, input_ids, *, attention_mask=None, positions=None, segment_ids=None, cache=None,
                      layer_states=None, pixel_values=None, image_embeds=None, routing=False, replay=None):
        """(final-norm hidden states [B, T, D] (compute dtype), the updated cache or None without one).

        Without a cache the layers run under `lax.scan` (or unrolled, per `cfg.scan_layers`). With a
        `KVCache` (sampling) they are unrolled, each layer updating its own cache arrays in place, except
        that the generic kernel set scans calls of more than one token (prefill; `cfg.scan_layers`);
        `layer_states` (from `layer_states()`) supplies the per-layer weights already sliced.
        `pixel_values` / `image_embeds`: the images of a vision-language model (module docstring).
        A mixture of experts: `routing=True` appends a `moe.Routing` (router logits [L_sparse, B*T, E], the
        router's own ids [B, T, L_sparse, k]); `replay` [B, T, L_sparse, k] int routes to the given experts
        (`posttrain.models.moe`: gate weights from the current router; a negative entry: the router's own choice).
        """
        cfg = self.cfg
        if (routing or replay is not None) and not cfg.is_moe:
            raise ValueError(f"routing and replay need a mixture-of-experts model ({cfg.model_type} has no experts)")
        attention_mask, positions = self._inputs(input_ids, attention_mask, positions, segment_ids)
        x, blocks = self._embed_inputs(input_ids, pixel_values, image_embeds)
        x = distributed.constrain(x, ("batch", "seq", "act_embed"), self.mesh)
        glob, loc = self._rope(positions)
        flags = jnp.asarray([[s, m] for s, m in zip(cfg.sliding_layers, cfg.moe_layers)])  # per layer: window, experts
        replays = self._layer_replay(replay, input_ids.shape)
        graphdef, layer_state = nnx.split(self.layers)

        def run_layer(h, state_l, flags_l, mask_info, cache_kv, replay_l):
            block = nnx.merge(graphdef, state_l)
            sliding_l = flags_l[0]
            rope = glob if loc is None else jax.tree.map(lambda g, lo: jnp.where(sliding_l, lo, g), glob, loc)
            h, new_kv, router = block(h, moe_l=flags_l[1], replay=replay_l, mesh=self.mesh, rope=rope,
                                      mask_info=mask_info, sliding=sliding_l, positions=positions, cache_kv=cache_kv)
            h = distributed.constrain(h, ("batch", "seq", "act_embed"), self.mesh)
            return h, new_kv, (router if routing else None)

        if cache is not None:
            x, cache, routers = self._cached_layers(run_layer, x, layer_state, flags, replays, layer_states,
                                                    cache.mark(positions, attention_mask), blocks, positions)
        else:
            mask_info = _mask_info(input_ids.shape[1], attention_mask, segment_ids, blocks, positions)
            x, routers = self._uncached_layers(run_layer, x, layer_state, flags, replays, mask_info)
        out = (self.norm(x), cache)
        return out + (self._routing(routers, *input_ids.shape),) if routing else out

    def _cached_layers(self, run_layer, x, layer_state, flags, replays, layer_states, cache, blocks, positions):
        """The layers of a cached call (`hidden_states`): (x, the new cache, stacked router outputs or None)."""
        cfg = self.cfg
        info = None
        if blocks is not None:  # a prefill with images: each image's tokens also see the ones after them
            kb = multimodal.cache_blocks(blocks, positions, cache.max_len)
            info = {"image_overlay": multimodal.same_image(blocks, kb)}
        n = cfg.num_layers
        if kernels_lib.get(cfg).scan_prefill and cfg.scan_layers and x.shape[1] > 1 and layer_states is None:
            def body(h, xs):
                state_l, flags_l, k_l, v_l, replay_l = xs
                h, kv, router = run_layer(h, state_l, flags_l, info, (k_l, v_l, cache.valid), replay_l)
                return h, (kv, router)

            x, ((k_all, v_all), routers) = jax.lax.scan(
                body, x, (layer_state, flags, jnp.stack(cache.k), jnp.stack(cache.v), replays))
            return x, KVCache(tuple(k_all[i] for i in range(n)), tuple(v_all[i] for i in range(n)),
                              cache.valid), routers
        if layer_states is None:
            layer_states = _unstack(layer_state, n)
        ks, vs, routers = list(cache.k), list(cache.v), []
        for i in range(n):
            x, (ks[i], vs[i]), r = run_layer(x, layer_states[i], flags[i], info, (ks[i], vs[i], cache.valid),
                                             None if replays is None else replays[i])
            routers.append(r)
        return x, KVCache(tuple(ks), tuple(vs), cache.valid), _stack(routers)

    def _uncached_layers(self, run_layer, x, layer_state, flags, replays, mask_info):
        """The layers of a call without a cache, scanned or unrolled, rematerialised per `cfg.remat`:
        (x, stacked router outputs or None)."""
        cfg = self.cfg

        def body(h, xs):
            state_l, flags_l, replay_l = xs
            h, _, router = run_layer(h, state_l, flags_l, mask_info, None, replay_l)
            return h, router

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=kernels_lib.get(cfg).remat_policy(cfg.remat),
                                  prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            return jax.lax.scan(body, x, (layer_state, flags, replays))
        routers = []
        for i, state_l in enumerate(_unstack(layer_state, cfg.num_layers)):
            x, r = body(x, (state_l, flags[i], None if replays is None else replays[i]))
            routers.append(r)
        return x, _stack(routers)

    def _layer_replay(self, replay, shape) -> jax.Array | None:
        """Replayed ids [B, T, L_sparse, k] -> per layer [L, B*T, k] int32 (a dense layer's rows unused)."""
        if replay is None:
            return None
        cfg = self.cfg
        b, t = shape
        sparse = [i for i, m in enumerate(cfg.moe_layers) if m]
        want = (b, t, len(sparse), cfg.num_experts_per_tok)
        if tuple(replay.shape) != want:
            raise ValueError(f"replay has shape {tuple(replay.shape)}, expected {want} (batch, tokens, sparse "
                             "layers, experts per token)")
        per_sparse = jnp.moveaxis(jnp.asarray(replay).reshape(b * t, len(sparse), -1), 1, 0).astype(jnp.int32)
        return per_sparse[jnp.asarray([sparse.index(i) if m else 0 for i, m in enumerate(cfg.moe_layers)])]

    def _routing(self, routers, b: int, t: int) -> Routing:
        """The sparse layers' router outputs, stacked over all layers [L, B*T, ...], as a `Routing`."""
        cfg = self.cfg
        sparse = jnp.asarray([i for i, m in enumerate(cfg.moe_layers) if m])
        logits, own = routers[0][sparse], routers[1][sparse]  # [Ls, N, E], [Ls, N, k]
        experts = jnp.transpose(own.reshape(own.shape[0], b, t, -1), (1, 2, 0, 3))
        return Routing(logits=logits, experts=experts.astype(experts_dtype(cfg.num_experts)))

    def output_kernel(self) -> jax.Array:
        """The LM head as a [D, V] matrix (the embedding transposed when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.base_kernel()

    @_traced_at_model_precision
    def logits(self, h: jax.Array) -> jax.Array:
        """float32 logits from final hidden states (with Gemma's final soft-capping)."""
        cfg = self.cfg
        cd = dtype_of(cfg.compute_dtype)
        if self.lm_head is not None and self.lm_head.lora_a is not None:
            out = self.lm_head(h).astype(jnp.float32)
        else:
            out = kernels_lib.get(cfg).contract(h.astype(cd), self.output_kernel().astype(cd), 1, jnp.float32)
        if cfg.final_logit_softcap:
            cap = cfg.final_logit_softcap
            out = jnp.tanh(out / cap) * cap
        return out

    def __call__(self, input_ids, *, attention_mask=None, positions=None, segment_ids=None, cache=None,
                 layer_states=None, pixel_values=None, image_embeds=None, routing=False, replay=None):
        """float32 logits [B, T, V]; with a cache (logits, cache); `routing=True` appends a `moe.Routing`."""
        h, *rest = self.hidden_states(
            input_ids, attention_mask=attention_mask, positions=positions, segment_ids=segment_ids, cache=cache,
            layer_states=layer_states, pixel_values=pixel_values, image_embeds=image_embeds, routing=routing,
            replay=replay,
        )
        logits = self.logits(h)
        if cache is None:
            rest = rest[1:]  # the None cache slot
        return (logits, *rest) if rest else logits


def _mask_info(t: int, attention_mask, segment_ids, blocks, positions) -> dict:
    """What uncached attention needs for its mask: causal, real keys, same packed segment, bidirectional within
    each image (`blocks`, when images are given); the sliding window is applied per layer, over positions.

    A negative segment id marks a row's shared prefix (`posttrain.rl.packing`'s shared-prompt rows: one prompt, then
    several completions of it): its keys are visible to every later query of the row, while the other segments stay
    apart. The window's distance is taken between positions, not columns (the same in contiguous segments; in a
    shared-prompt row a completion's tokens are near its prompt in positions, not in columns)."""
    idx = jnp.arange(t)
    qi, ki = idx[None, :, None], idx[None, None, :]
    base = (qi >= ki) & (attention_mask[:, None, :] > 0)
    if segment_ids is not None:  # same packed segment, or a key in the row's shared prefix
        base = base & ((segment_ids[:, :, None] == segment_ids[:, None, :]) | (segment_ids[:, None, :] < 0))
    if blocks is not None:  # bidirectional within each image
        base = base | multimodal.same_image(blocks, blocks)
    base = base | (qi == ki)  # a padding query attends to itself only: no empty softmax rows
    # causal: no query sees a later column (images' bidirectional blocks break it)
    return {"base": base, "q_index": positions[:, :, None], "k_index": positions[:, None, :], "causal": blocks is None}


def _stack(outputs: list):
    """Per-layer pytrees (or Nones) stacked on a leading layer axis (None when they are None)."""
    if outputs[0] is None:
        return None
    return jax.tree.map(lambda *a: jnp.stack(a), *outputs)


def _unstack(layer_state: nnx.State, n: int) -> list[nnx.State]:
    """The per-layer states [i] of stacked layer parameters."""
    return [jax.tree.map(lambda a, i=i: a[i], layer_state) for i in range(n)]


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model (normal(0, 1/sqrt(fan_in)) kernels, 0.02 embeddings, unit norms)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))
