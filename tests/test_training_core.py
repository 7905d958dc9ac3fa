"""Trainer core: schedules, decay masks, accumulation equivalence, the non-finite guard, checkpoints, learning."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms.sft import make_sft_loss
from posttrain.models.config import llama_like
from posttrain.models.transformer import init_model
from posttrain.training.checkpoint import Checkpointer
from posttrain.training.config import OptimConfig
from posttrain.training.optim import decay_mask, make_optimizer, make_schedule, path_names
from posttrain.training.trainer import Trainer, flops_per_token

CFG = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)



@pytest.fixture(scope="module")
def model_state():
    """One random model, split once; `fresh()` rebuilds identical copies cheaply."""
    from flax import nnx

    graphdef, state = nnx.split(init_model(CFG, seed=0))
    return lambda: nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _tx(name="adamw"):
    """The one optimizer of these tests: same program in every test, so the compile cache hits."""
    return make_optimizer(OptimConfig(name=name, lr=1e-2, warmup_steps=2, decay="cosine", min_lr_ratio=0.1,
                                      weight_decay=0.01), 120)


def _batches(n, b=8, t=24, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, CFG.vocab_size, size=(b, t)).astype(np.int32)
        mask = (rng.random((b, t)) < 0.7).astype(np.float32)
        mask[:, 0] = 0
        out.append({"input_ids": ids, "loss_mask": mask, "attention_mask": np.ones((b, t), np.int32),
                    "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
                    "segment_ids": np.ones((b, t), np.int32)})
    return out


# ---------------------------------------------------------------------- schedules and masks
@pytest.mark.parametrize("decay,at35", [("cosine", 0.1 + 0.45 * (1 + math.cos(math.pi * 0.25))),
                                        ("linear", 1.0 - 0.9 * 0.25), ("constant", 1.0)])
def test_schedule_hand_values(decay, at35):
    s = make_schedule(OptimConfig(lr=1.0, warmup_steps=10, decay=decay, min_lr_ratio=0.1), total_steps=110)
    np.testing.assert_allclose([float(s(0)), float(s(5)), float(s(10))], [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(float(s(35)), at35, rtol=1e-5)
    np.testing.assert_allclose(float(s(110)), 1.0 if decay == "constant" else 0.1, rtol=1e-5)


@pytest.mark.slow
def test_decay_mask_skips_norms_biases_embeddings(model_state):
    from flax import nnx

    model = init_model(llama_like(vocab_size=64, num_layers=1, qkv_bias=True, qk_norm=True, model_type="qwen3"))
    params = nnx.state(model, nnx.Param)
    flat = {"/".join(n for n in path_names(p) if n != "value"): m
            for p, m in jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]}
    assert flat["layers/self_attn/q_proj/kernel"] and flat["layers/mlp/down_proj/kernel"] and flat["lm_head/kernel"]
    assert not flat["layers/self_attn/q_proj/bias"]
    assert not flat["layers/input_layernorm/weight"] and not flat["layers/self_attn/q_norm/weight"]
    assert not flat["norm/weight"] and not flat["embed_tokens/embedding"]
    with_emb = decay_mask(params, decay_embeddings=True)
    assert with_emb["embed_tokens"]["embedding"].get_value() is True


@pytest.mark.slow
def test_weight_decay_respects_mask():
    """AdamW with zero gradients moves only decayed weights (by lr * wd * w)."""
    from flax import nnx

    model = init_model(llama_like(vocab_size=64, num_layers=1))
    params = nnx.state(model, nnx.Param)
    tx, _ = make_optimizer(OptimConfig(lr=0.5, weight_decay=0.1, decay="constant", clip_norm=0.0), 10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["layers"]["mlp"]["up_proj"]["kernel"][...]),
                               -0.05 * np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"][...]), rtol=1e-6)
    assert not np.any(np.asarray(updates["norm"]["weight"][...]))
    assert not np.any(np.asarray(updates["embed_tokens"]["embedding"][...]))


@pytest.mark.parametrize("name", ["sgd", "adafactor"])
@pytest.mark.slow
def test_other_optimizers_step(name, model_state):
    tx, sched = _tx(name)
    tr = Trainer(model_state(), tx, loss_fn=make_sft_loss(), schedule=sched)
    b = _batches(1)[0]
    losses = [tr.step(b)["loss"] for _ in range(4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


# ---------------------------------------------------------------------- the step
@pytest.mark.slow
def test_grad_accumulation_equals_full_batch(model_state):
    batches = _batches(3)
    runs = {}
    for k in (1, 4):
        tx, sched = _tx()
        tr = Trainer(model_state(), tx, loss_fn=make_sft_loss(), grad_accum=k, schedule=sched)
        runs[k] = ([tr.step(b) for b in batches], tr)
    for m1, m4 in zip(runs[1][0], runs[4][0]):
        np.testing.assert_allclose(m4["loss"], m1["loss"], atol=2e-6)
        np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
        assert m1["weight"] == m4["weight"] and m1["tokens"] == m4["tokens"] == 8 * 24
    np.testing.assert_allclose(runs[1][0][0]["lr"], 0.0)
    np.testing.assert_allclose(runs[1][0][1]["lr"], 5e-3, rtol=1e-6)
    np.testing.assert_allclose(runs[1][0][2]["lr"], 1e-2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(runs[1][1].params), jax.tree.leaves(runs[4][1].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    with pytest.raises(ValueError, match="not divisible by grad_accum"):
        runs[4][1].step(_batches(1, b=6)[0])


def test_nonfinite_update_is_not_applied(model_state):
    tx, sched = _tx()
    tr = Trainer(model_state(), tx, loss_fn=make_sft_loss(), schedule=sched)
    good = _batches(1)[0]
    tr.step(good)
    before = jax.tree.map(np.asarray, tr.params)
    bad = dict(good, loss_mask=np.where(good["loss_mask"] > 0, np.nan, 0).astype(np.float32))
    m = tr.step(bad)
    assert math.isnan(m["loss"]) and m["skipped"] == 1.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(tr.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    empty = dict(good, loss_mask=np.zeros_like(good["loss_mask"]))
    assert tr.step(empty)["skipped"] == 1.0
    assert tr.step(good)["skipped"] == 0.0


def test_training_drives_loss_down(model_state):
    """Memorising 2 fixed batches of random tokens: the loss falls from ~ln(64) to a fraction of it."""
    tx, sched = _tx()
    tr = Trainer(model_state(), tx, loss_fn=make_sft_loss(), grad_accum=4, schedule=sched)
    batches = _batches(2)
    losses = [tr.step(batches[i % 2])["loss"] for i in range(120)]
    first, last = np.mean(losses[:4]), np.mean(losses[-4:])
    print(f"\ntrainer loss: first 4 steps {first:.3f} -> last 4 steps {last:.3f}")
    assert first > 0.9 * math.log(64)
    assert last < 0.25 * first


@pytest.mark.slow
def test_trainer_token_logprobs(model_state):
    from posttrain.algorithms.sft import token_logprobs

    model = model_state()
    b = _batches(1)[0]
    ref = token_logprobs(model, jnp.asarray(b["input_ids"]))
    tr = Trainer(model, _tx()[0], loss_fn=make_sft_loss(), logprob_chunk_size=50)
    got = tr.token_logprobs(b)
    assert got.shape == (8, 23)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 16])
def test_trainer_token_logprobs_of_the_last_positions_only(model_state, chunk):
    """`last=C` gives the last C columns of the full result, and projects the vocabulary only there."""
    from posttrain.rl.batch import RLBatch, completion_logprobs

    model = model_state()
    b = _batches(1)[0]
    b["attention_mask"] = np.ones_like(b["input_ids"])
    c = 5
    tr = Trainer(model, _tx()[0], loss_fn=make_sft_loss(), logprob_chunk_size=chunk)
    full = np.asarray(tr.token_logprobs(b))
    got = np.asarray(tr.token_logprobs(b, last=c))
    assert got.shape == (8, c)
    np.testing.assert_allclose(got, completion_logprobs(full, RLBatch(*[np.zeros((8, c))] * 6)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(tr.token_logprobs(b, adapters=False, last=c)), got, atol=1e-5)

    def flops(last):
        args = (tr.params, tr.rest, *(jnp.asarray(b[k]) for k in ("input_ids", "attention_mask")), None, None)
        return tr.logprob_fn(last=last).lower(*args).compile().cost_analysis()["flops"]

    t = b["input_ids"].shape[1]
    if chunk is None:  # (XLA's cost analysis counts a loop body once: compare unchunked programs)
        head = 2 * 8 * CFG.hidden_size * CFG.vocab_size  # the LM head's FLOPs per position (all rows)
        assert flops(c) < flops(None) - 0.9 * head * (t - 1 - c)
    with pytest.raises(ValueError, match="last="):
        tr.token_logprobs(b, last=t)


def test_flops_per_token_formula():
    cfg = llama_like(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=4)
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k+v, o, gate+up+down
    n = 2 * per_layer + 100 * 8
    assert flops_per_token(cfg, 32) == 6 * n + 12 * 2 * 2 * 4 * 32


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_checkpoint_roundtrip_continues_identically(tmp_path, name, model_state):
    batches = _batches(4)

    def make():
        tx, sched = _tx(name)
        return Trainer(model_state(), tx, loss_fn=make_sft_loss(), schedule=sched, seed=7)

    tr = make()
    for b in batches[:2]:
        tr.step(b)
    tr.next_rng()
    ck = Checkpointer(tmp_path / "ck", keep=2)
    ck.save(tr, data_state={"next_index": 2}, metadata={"note": "x"})
    ref = [tr.step(b)["loss"] for b in batches[2:]]
    ck.close()

    fresh = make()
    fresh.step(batches[3])  # different state, overwritten by the restore
    ck2 = Checkpointer(tmp_path / "ck", keep=2)
    meta = ck2.restore(fresh)
    assert meta["step"] == 2 and meta["data_state"] == {"next_index": 2} and meta["metadata"] == {"note": "x"}
    assert fresh.step_count == 2
    np.testing.assert_array_equal(np.asarray(fresh.rng), np.asarray(jax.random.key_data(
        jax.random.split(jax.random.key(7))[0])))
    got = [fresh.step(b)["loss"] for b in batches[2:]]
    np.testing.assert_allclose(got, ref, atol=1e-6)
    ck2.close()


def test_checkpoint_keeps_last_n_and_ignores_unfinished(tmp_path, model_state):
    tx, sched = _tx("sgd")
    tr = Trainer(model_state(), tx, loss_fn=make_sft_loss(), schedule=sched)
    ck = Checkpointer(tmp_path / "ck", keep=2, async_save=False)
    b = _batches(1)[0]
    for _ in range(3):
        tr.step(b)
        ck.save(tr)
    assert ck.all_steps() == [2, 3]
    # A save that died half-way leaves only a temporary folder, which is never taken for a checkpoint.
    (tmp_path / "ck" / "4.orbax-checkpoint-tmp-123").mkdir()
    ck.close()
    assert Checkpointer(tmp_path / "ck", keep=2).latest_step() == 3


def _step_program(tr, batch):
    """The trainer's step as (jaxpr text, lowered StableHLO text) for `batch`."""
    fn = tr._build_step(tr.loss_fn)
    args = (tr.params, tr.opt_state, tr.rest, {}, tr.put_batch(batch), jnp.int32(0))  # {}: no frozen models
    return str(jax.make_jaxpr(fn)(*args)), fn.lower(*args).as_text()


def test_bf16_compute_with_float32_master_weights_and_remat(model_state):
    """compute_dtype=bfloat16 keeps float32 params and optimizer state, multiplies in bfloat16 inside the
    compiled step, rematerialises the layer body (remat=full), and follows float32 closely but not exactly."""
    batches = _batches(2)
    tx, sched = _tx()
    f32 = Trainer(model_state(), tx, loss_fn=make_sft_loss(), schedule=sched)
    ref = [f32.step(batches[i % 2])["loss"] for i in range(4)]
    # Same seed, same float32 weights; bfloat16 matmuls and a rematerialised layer body.
    tr = Trainer(init_model(CFG.replace(compute_dtype="bfloat16", remat="full"), seed=0), tx,
                 loss_fn=make_sft_loss(), schedule=sched)
    got = [tr.step(batches[i % 2])["loss"] for i in range(4)]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tr.params))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(tr.opt_state))
    assert got[-1] < got[0]
    rel = np.abs(np.subtract(got, ref)) / np.asarray(ref)
    print(f"\nbf16 vs float32 loss, relative difference per step: {np.round(rel, 5).tolist()}")
    # bf16 rounding (2^-8 relative) shows in the loss (measured ~1e-3), but stays small
    assert rel.max() > 2e-4 and rel.max() < 2e-2
    # The compiled programs: the weight matmuls take bf16 operands (none in the float32 program), and the
    # layer body sits in a remat (checkpoint) with the policy of remat=full.
    for trainer, bf16, remat in ((tr, True, True), (f32, False, False)):
        jaxpr, hlo = _step_program(trainer, batches[0])
        dots = re.findall(r"stablehlo\.dot_general[^\n]*", hlo)
        n_bf16 = sum("xbf16>" in d.split("->")[0] for d in dots)
        assert len(dots) >= 20 and (n_bf16 >= len(dots) - 2 if bf16 else n_bf16 == 0), (n_bf16, len(dots))
        assert ("remat" in jaxpr and "nothing_saveable" in jaxpr) == remat


def test_remat_policies_give_the_same_gradients_in_less_memory():
    """remat=dots / dots_no_batch (as configs set `model.remat`) compute what remat=none computes, with less
    temporary memory in the compiled forward + backward (XLA's memory analysis of the compiled program)."""
    from flax import nnx

    batch = {k: jnp.asarray(v) for k, v in _batches(1, t=64)[0].items()}
    loss_fn = make_sft_loss()
    temp, results = {}, {}
    for remat in ("none", "dots", "dots_no_batch"):
        graphdef, params = nnx.split(init_model(CFG.replace(remat=remat), seed=0))

        def mean_loss(p, graphdef=graphdef):
            loss_sum, weight, _ = loss_fn(nnx.merge(graphdef, p), batch)
            return loss_sum / weight

        compiled = jax.jit(jax.value_and_grad(mean_loss)).lower(params).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        results[remat] = jax.tree.leaves(compiled(params))
    print(f"\ntemporary bytes of forward + backward by remat policy: {temp}")
    for remat in ("dots", "dots_no_batch"):
        assert temp[remat] < 0.8 * temp["none"], temp
        for a, b in zip(results[remat], results["none"]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
