"""Packed RL batches (`posttrain.rl.packing`): the packed loss and its gradient equal the padded batch's for the
policy-loss presets with a KL term, attention never crosses sequences, the loss mask is carried as it is, and
the learner's packed update equals its padded update."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.algorithms.registry import get_preset
from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.rl.batch import build_rl_batch
from posttrain.rl.config import LearnerConfig
from posttrain.rl.loss import packed_logprobs, rl_loss
from posttrain.rl.packing import bucket_rows, pack_rl_batch
from posttrain.rollout.rollouts import Rollouts
from posttrain.rl.learner import policy_loss_kwargs

pytestmark = pytest.mark.full_optimization  # numbers against a reference: compiled as users' runs are (tests/conftest.py)

CFG = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)
PROMPTS = (5, 3, 7, 4, 2, 6)
COMPLETIONS = (6, 2, 11, 4, 1, 9)


def _batch(seed=0, *, comps=COMPLETIONS, seq_weights=None):
    """Six sequences of varied lengths, two groups; behaviour/ref log-probs near each other; a loss mask with
    holes (multi-turn: tokens the model did not sample) and, with `seq_weights`, filtered sequences."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in PROMPTS]
    completions = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in comps]
    ro = Rollouts(group_size=3, record_index=[0, 0, 0, 1, 1, 1], prompt_ids=prompts, completion_ids=completions,
                  logprobs=[(-rng.uniform(0.5, 4.0, size=n)).tolist() for n in comps],
                  finish_reasons=["stop"] * 6, texts=[""] * 6, prompts_text=[""] * 6,
                  rewards=np.zeros(6, np.float32), per_reward={}, reward_stats={})
    b = build_rl_batch(ro, np.array([0.9, -0.4, -0.5, 1.2, 0.3, -1.5], np.float32), seq_weights=seq_weights,
                       multiple=8)
    mask = b.loss_mask.copy()
    mask[0, 2:4] = 0.0  # appended tool tokens inside a completion
    mask[2, 5] = 0.0
    ref = (b.behaviour_logp + rng.uniform(-0.3, 0.3, size=mask.shape)).astype(np.float32)
    old = (b.behaviour_logp + rng.uniform(-0.2, 0.2, size=mask.shape)).astype(np.float32)
    return b.replace(loss_mask=mask, ref_logp=ref * (mask > 0), old_logp=old * (mask > 0))


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _kwargs(preset):
    kw = policy_loss_kwargs(get_preset(preset, beta=0.05), 16)
    return kw


def _loss_and_grads(model, batch, kw):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p, b):
        loss_sum, w, metrics = rl_loss(nnx.merge(graphdef, p, rest), b, loss_kwargs=kw)
        return loss_sum / w, (w, metrics)

    (loss, (w, metrics)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, batch)
    return float(loss), float(w), {k: float(v[0] / v[1]) for k, v in metrics.items()}, grads


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "gspo", "per-token advantages"])
@pytest.mark.slow
def test_packed_gradients_equal_padded(model, preset):
    batch = _batch(seq_weights=np.array([1, 1, 1, 1, 0, 1], np.float32))  # one sequence filtered (DAPO)
    if preset == "dr_grpo":
        batch = batch.replace(advantages=np.asarray(batch.advantages) - 0.1)
    if preset == "per-token advantages":  # on-policy distillation's [N, C] advantages
        preset = "grpo"
        rng = np.random.default_rng(3)
        batch = batch.replace(advantages=rng.normal(size=batch.loss_mask.shape).astype(np.float32))
    packed, layout = pack_rl_batch(batch, row_multiple=2)
    assert len(packed) < len(batch) and len(packed) % 2 == 0 and layout.packed_cells < layout.padded_cells
    kw = _kwargs(preset)
    loss_p, w_p, m_p, g_p = _loss_and_grads(model, batch, kw)
    loss_k, w_k, m_k, g_k = _loss_and_grads(model, packed, kw)
    assert w_k == w_p and loss_k == pytest.approx(loss_p, rel=1e-5, abs=1e-6)
    assert m_k.keys() == m_p.keys() and "kl" in m_k
    for k in m_p:
        assert m_k[k] == pytest.approx(m_p[k], rel=1e-5, abs=1e-6), k
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree.leaves(g_k)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5, err_msg=str(path))
    assert max(float(np.abs(np.asarray(a)).max()) for a in jax.tree.leaves(g_p)) > 1e-3  # a real gradient


@pytest.mark.slow  # two eager forwards: ~6 s on the loaded 2-core machine
def test_attention_never_crosses_sequences(model):
    batch = _batch()
    packed, layout = pack_rl_batch(batch)
    assert (np.bincount(layout.row) > 1).any()  # some row holds several sequences
    base = layout.unpack(np.asarray(packed_logprobs(model, packed)[0]))
    ids = np.asarray(batch.input_ids).copy()
    t, c = ids.shape[1], batch.completion_len
    i = int(np.flatnonzero(np.bincount(layout.row)[layout.row] > 1)[0])  # a sequence that shares its row
    ids[i, t - c: t - c + COMPLETIONS[i]] = (ids[i, t - c: t - c + COMPLETIONS[i]] + 7) % CFG.vocab_size
    ids[i, t - c - 1] = (ids[i, t - c - 1] + 3) % CFG.vocab_size  # and its last prompt token
    changed, layout2 = pack_rl_batch(batch.replace(input_ids=ids))
    assert (layout2.row == layout.row).all() and (layout2.slot == layout.slot).all()
    after = layout.unpack(np.asarray(packed_logprobs(model, changed)[0]))
    m = batch.loss_mask > 0
    others = np.arange(len(batch)) != i
    np.testing.assert_array_equal(after[others] * m[others], base[others] * m[others])
    assert np.abs((after[i] - base[i]) * m[i]).max() > 1e-3


def test_pack_carries_the_loss_mask_and_fields():
    batch = _batch(seq_weights=np.array([1, 0, 1, 1, 1, 1], np.float32))
    packed, layout = pack_rl_batch(batch, row_multiple=4)
    assert len(packed) % 4 == 0 and layout.tokens == int(np.asarray(batch.attention_mask).sum())
    for name in ("loss_mask", "behaviour_logp", "old_logp", "ref_logp"):
        np.testing.assert_array_equal(layout.unpack(getattr(packed, name)), getattr(batch, name), err_msg=name)
    np.testing.assert_array_equal(packed.advantages[layout.row, layout.slot], batch.advantages)
    assert packed.seq_valid.sum() == len(batch)
    # exactly the loss tokens are projected; every row's tokens are its sequences' real tokens, positions from 0
    assert (packed.token_dst < packed.loss_mask.shape[1] * packed.loss_mask.shape[2]).sum() == (batch.loss_mask > 0).sum()
    assert int(packed.attention_mask.sum()) == layout.tokens
    for i in range(len(batch)):
        real = np.asarray(batch.input_ids)[i][np.asarray(batch.attention_mask)[i] > 0]
        seg = packed.segment_ids[layout.row[i]] == layout.slot[i] + 1
        np.testing.assert_array_equal(packed.input_ids[layout.row[i]][seg], real)
        np.testing.assert_array_equal(packed.positions[layout.row[i]][seg], np.arange(len(real)))


def test_pack_sizes_only_grow():
    batch = _batch()
    _, layout = pack_rl_batch(batch)
    big, big_layout = pack_rl_batch(batch, at_least=(layout.row_len + 16, layout.slots * 2, layout.proj + 16))
    assert big_layout.sizes == (layout.row_len + 16, layout.slots * 2, layout.proj + 16)
    assert big.input_ids.shape[1] == big_layout.row_len and big.token_src.shape[1] == big_layout.proj
    for name in ("loss_mask", "behaviour_logp", "ref_logp"):
        np.testing.assert_array_equal(big_layout.unpack(getattr(big, name)), getattr(batch, name), err_msg=name)


def test_bucket_rows_few_shapes():
    assert [bucket_rows(r) for r in (1, 2, 3, 5, 7, 9, 13, 17, 33)] == [1, 2, 3, 5, 7, 10, 14, 20, 40]
    assert bucket_rows(5, 4) == 8 and bucket_rows(9, 4) == 12
    assert len({bucket_rows(r) for r in range(1, 257)}) <= 4 * 8 + 8


def _learner_updates(batch, variants: list[dict]):
    """(metrics, weights) of one learner update per variant (Learner keyword arguments: pack, attn_span) from the
    same start: recomputed old log-probs, a frozen reference, 2 epochs x 2 minibatches x grad_accum 2, SGD."""
    from posttrain.rl.learner import FrozenScorer, Learner
    from posttrain.rl.loss import make_rl_loss
    from posttrain.training.config import OptimConfig
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer

    out = []
    for kw in variants:
        tx = make_optimizer(OptimConfig(name="sgd", lr=0.5, momentum=0.0, decay="constant", clip_norm=0.0), 10)[0]
        trainer = Trainer(init_model(CFG, seed=0), tx, grad_accum=2, donate=False)
        learner = Learner(trainer, make_rl_loss(_kwargs("grpo")), ppo_epochs=2, minibatches=2, seed=0,
                          recompute_old=True, correction=LearnerConfig().settings(),
                          ref_fn=FrozenScorer(init_model(CFG, seed=1), trainer), **kw)
        metrics = learner.update(batch, step=1)
        out.append((metrics, jax.tree.leaves(nnx.state(trainer.model(), nnx.Param))))
    return out


@pytest.mark.slow
def test_learner_packed_update_equals_padded():
    """The whole learner path (recomputed old log-probs, a frozen reference, 2 minibatches x grad_accum 2):
    packed and padded updates give the same weights."""
    batch = _batch(seed=1, comps=(6, 2, 11, 4, 3, 9)).replace(old_logp=None, ref_logp=None)
    batch = dataclasses.replace(batch, input_ids=np.concatenate([batch.input_ids] * 2),
                                **{k: np.concatenate([getattr(batch, k)] * 2) for k in
                                   ("attention_mask", "positions", "loss_mask", "advantages", "behaviour_logp")})
    (m0, p0), (m1, p1) = _learner_updates(batch, [dict(pack=False), dict(pack=True)])
    # (kl and the clip fractions are token means weighted per micro-batch: they depend on which sequences share
    # a micro-batch, which packing changes; the loss, its gradient and the token-weighted entropy do not)
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(p0, p1):  # to 1e-5 of each tensor's scale: near-zero entries carry float32 rounding only
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


# ---------------------------------------------------------------------------------------- shared-prompt rows
GROUP_PROMPTS = (7, 12)  # two groups of three completions, each group sharing its prompt


def _group_batch(seed=0, comps=(6, 2, 11, 4, 1, 9)):
    """`_batch`'s fields for two groups of three sequences with one prompt per group (GRPO's layout)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in GROUP_PROMPTS]
    completions = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in comps]
    ro = Rollouts(group_size=3, record_index=[0, 0, 0, 1, 1, 1], prompt_ids=[prompts[i // 3] for i in range(6)],
                  completion_ids=completions, logprobs=[(-rng.uniform(0.5, 4.0, size=n)).tolist() for n in comps],
                  finish_reasons=["stop"] * 6, texts=[""] * 6, prompts_text=[""] * 6,
                  rewards=np.zeros(6, np.float32), per_reward={}, reward_stats={})
    b = build_rl_batch(ro, np.array([0.9, -0.4, -0.5, 1.2, 0.3, -1.5], np.float32), multiple=8)
    mask = b.loss_mask.copy()
    mask[0, 2:4] = 0.0  # appended tool tokens inside a completion: not projected, not learned
    mask[3, 0] = 0.0  # a completion whose first token is not learned
    ref = (b.behaviour_logp + rng.uniform(-0.3, 0.3, size=mask.shape)).astype(np.float32)
    old = (b.behaviour_logp + rng.uniform(-0.2, 0.2, size=mask.shape)).astype(np.float32)
    return b.replace(loss_mask=mask, ref_logp=ref * (mask > 0), old_logp=old * (mask > 0))


def test_shared_prompt_rows_hold_each_prompt_once_and_carry_the_fields():
    from posttrain.rl.packing import pack_shared_prompts, prompt_groups

    batch = _group_batch()
    order = np.array([4, 0, 3, 1, 5, 2])  # a minibatch split shuffles sequences: groups are found by prompt
    batch = batch.rows(order)
    assert sorted(map(sorted, prompt_groups(batch))) == [[0, 2, 4], [1, 3, 5]]
    packed, layout = pack_shared_prompts(batch, per_row=2, row_multiple=2)
    assert len(packed) == 4 and layout.slots == 2  # each group: a row of 2 completions and a row of 1
    for name in ("loss_mask", "behaviour_logp", "old_logp", "ref_logp"):
        np.testing.assert_array_equal(layout.unpack(getattr(packed, name)), getattr(batch, name), err_msg=name)
    np.testing.assert_array_equal(packed.advantages[layout.row, layout.slot], batch.advantages)
    ids, am = np.asarray(batch.input_ids), np.asarray(batch.attention_mask)
    t, c = ids.shape[1], batch.completion_len
    for i in range(len(batch)):
        r, s = layout.row[i], layout.slot[i]
        prompt = ids[i, : t - c][am[i, : t - c] > 0]
        comp = ids[i, t - c:][am[i, t - c:] > 0]
        np.testing.assert_array_equal(packed.input_ids[r][packed.segment_ids[r] == -1], prompt)  # once, first
        assert (packed.segment_ids[r][: len(prompt)] == -1).all()
        seg = packed.segment_ids[r] == s + 1
        np.testing.assert_array_equal(packed.input_ids[r][seg], comp)
        np.testing.assert_array_equal(packed.positions[r][seg], len(prompt) + np.arange(len(comp)))
        # what each projected token predicts, and from where: token 0 from the prompt's last column
        mine = (packed.token_dst[r] >= s * c) & (packed.token_dst[r] < (s + 1) * c)
        j = packed.token_dst[r][mine] - s * c
        np.testing.assert_array_equal(packed.token_tgt[r][mine], comp[j])
        cols = np.flatnonzero(seg)
        np.testing.assert_array_equal(packed.token_src[r][mine], np.where(j == 0, len(prompt) - 1, cols[0] + j - 1))


@pytest.mark.parametrize("preset", ["grpo", pytest.param("gspo", marks=pytest.mark.slow),
                                    pytest.param("dr_grpo", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_shared_prompt_gradients_equal_padded(model, preset):
    from posttrain.rl.packing import pack_shared_prompts

    batch = _group_batch()
    packed, layout = pack_shared_prompts(batch, per_row=3)
    assert len(packed) == 2 and layout.packed_cells < layout.padded_cells
    kw = _kwargs(preset)
    loss_p, w_p, m_p, g_p = _loss_and_grads(model, batch, kw)
    loss_k, w_k, m_k, g_k = _loss_and_grads(model, packed, kw)
    assert w_k == w_p and loss_k == pytest.approx(loss_p, rel=1e-5, abs=1e-6)
    for k in m_p:
        assert m_k[k] == pytest.approx(m_p[k], rel=1e-5, abs=1e-6), k
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree.leaves(g_k)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5, err_msg=str(path))
    assert max(float(np.abs(np.asarray(a)).max()) for a in jax.tree.leaves(g_p)) > 1e-3  # a real gradient


@pytest.mark.slow
def test_shared_prompt_log_probs_equal_padded_with_a_sliding_window():
    """Sliding-window layers measure the window in positions: in a shared-prompt row a completion's tokens sit
    far from its prompt in columns, not in positions. Log-probs equal the padded batch's."""
    from posttrain.rl.loss import padded_logprobs
    from posttrain.rl.packing import pack_shared_prompts

    cfg = dataclasses.replace(CFG, sliding_window=5, layer_types=("sliding_attention", "full_attention"))
    m = init_model(cfg, seed=0)
    batch = _group_batch(comps=(9, 6, 11, 8, 7, 10))
    packed, layout = pack_shared_prompts(batch, per_row=3)
    padded = np.asarray(padded_logprobs(m, batch)[0])
    shared = layout.unpack(np.asarray(packed_logprobs(m, packed)[0]))
    mask = batch.loss_mask > 0
    np.testing.assert_allclose(shared * mask, padded * mask, rtol=1e-5, atol=1e-5)
    # and the window is in force: without it (all layers full) the log-probs differ
    full = np.asarray(padded_logprobs(init_model(dataclasses.replace(cfg, sliding_window=None), seed=0), batch)[0])
    assert np.abs((full - padded) * mask).max() > 1e-4


def test_pack_cheapest_shares_long_prompts_and_not_long_completions():
    from posttrain.rl.packing import pack_cheapest

    batch = _group_batch(comps=(2, 1, 3, 2, 1, 2))  # completions short against the 7/12-token prompts
    packed, layout = pack_cheapest(batch, attn_span=1e4)
    _, by_sequence = pack_rl_batch(batch)
    assert (packed.segment_ids == -1).any() and layout.packed_cells < by_sequence.packed_cells
    batch = _group_batch(comps=(30,) * 6)  # long completions and costly attention: one sequence a row
    packed, layout = pack_cheapest(batch, attn_span=1.0)
    assert not (packed.segment_ids == -1).any()


@pytest.mark.slow
def test_learner_shared_prompt_update_equals_padded():
    """The learner with `learner.share_prompts` (recomputed old log-probs, a frozen reference, 2 minibatches x
    grad_accum 2): the same weights as the padded update, and prompts were shared."""
    from posttrain.rl.packing import attention_span

    batch = _group_batch(seed=1).replace(old_logp=None, ref_logp=None)
    batch = batch.rows(np.concatenate([np.arange(6)] * 2))  # 4 sequences a prompt
    (m0, p0), (m1, p1) = _learner_updates(batch, [dict(pack=False), dict(pack=True, attn_span=attention_span(CFG))])
    assert m1["pack/packed_cells"] < m1["pack/padded_cells"] and m1["pack/tokens"] < 2 * int(batch.attention_mask.sum())
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(p0, p1):  # after 4 updates at lr 0.5 (one step's gradient: equal to 1e-5, above)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------- one shape a run
def _varied_batch(seed: int, bounds=(16, 24)):
    """Two groups of three with random completion lengths (1..24), padded to the run's bounds (P, C)."""
    rng = np.random.default_rng(seed)
    comps = rng.integers(1, 25, size=6).tolist()
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in (int(rng.integers(3, 15)), 3)]
    ro = Rollouts(group_size=3, record_index=[0, 0, 0, 1, 1, 1], prompt_ids=[prompts[i // 3] for i in range(6)],
                  completion_ids=[rng.integers(3, CFG.vocab_size, size=n).tolist() for n in comps],
                  logprobs=[(-rng.uniform(0.5, 4.0, size=n)).tolist() for n in comps],
                  finish_reasons=["stop"] * 6, texts=[""] * 6, prompts_text=[""] * 6,
                  rewards=np.zeros(6, np.float32), per_reward={}, reward_stats={})
    return build_rl_batch(ro, rng.normal(size=6).astype(np.float32), multiple=8, at_least=bounds)


@pytest.mark.parametrize("attn_span", [None, 1.0])
def test_pack_plan_gives_one_shape_whatever_the_completion_lengths(attn_span):
    """With the run's shortest prompt (3 tokens) the plan fixes the sizes at the first batch: twenty batches of
    random completion lengths (sequence rows, or shared-prompt rows) pack to at most two shapes (the first with
    headroom, then the worst case), and unpack to their own fields."""
    from posttrain.rl.packing import PackPlan

    plan = PackPlan(attn_span=attn_span, prompt_min=3, multiple=8)
    shapes = []
    for seed in range(20):
        batch = _varied_batch(seed)
        assert batch.input_ids.shape == (6, 40)  # the padded batch: one shape too
        packed, layout = plan.pack(batch)
        shapes.append(tuple(np.shape(x) for x in jax.tree.leaves(packed)))
        for name in ("loss_mask", "behaviour_logp"):
            np.testing.assert_array_equal(layout.unpack(getattr(packed, name)), getattr(batch, name), err_msg=name)
    changes = sum(a != b for a, b in zip(shapes, shapes[1:]))
    assert changes <= 1 and len(set(shapes)) <= 2, set(shapes)
    grow = PackPlan(attn_span=attn_span, multiple=8)  # without the bound: sizes follow the batches
    assert len({tuple(np.shape(x) for x in jax.tree.leaves(grow.pack(_varied_batch(s))[0])) for s in range(20)}) > 2


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True])
def test_learner_compiles_its_step_and_scoring_once_over_varied_lengths(pack):
    """Four updates on batches of different completion lengths (old log-probs recomputed, a frozen reference):
    padded, the train step and each scoring program compile once; packed, at most twice (the first batch's rows
    with headroom, then the worst case: `PackPlan`)."""
    from compile_counter import count_compiles

    from posttrain.rl.learner import FrozenScorer, Learner
    from posttrain.rl.loss import make_rl_loss
    from posttrain.training.config import OptimConfig
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer

    tx = make_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.0, decay="constant", clip_norm=0.0), 10)[0]
    trainer = Trainer(init_model(CFG, seed=0), tx, donate=False)
    learner = Learner(trainer, make_rl_loss(_kwargs("grpo")), ppo_epochs=1, minibatches=1, seed=0,
                      recompute_old=True, correction=LearnerConfig().settings(),
                      ref_fn=FrozenScorer(init_model(CFG, seed=1), trainer),
                      pack=pack, attn_span=1.0 if pack else None, prompt_min=3)
    with count_compiles() as c:
        for seed in (3, 4, 5, 6):
            learner.update(_varied_batch(seed), step=seed)
    most = 2 if pack else 1
    assert 1 <= c["jit(step_fn)"] <= most, c.names
    scorers = 2 if pack else 1  # packed: the policy's and the reference's program have one name
    again = {k: n for k, n in c.names.items() if n > most * (scorers if "packed_lp" in k else 1)}
    assert not again, c.names
