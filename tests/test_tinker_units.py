"""The Tinker service's parts without a server: the losses against hand computations, the optimizer step against
`torch.optim.AdamW` (Tinker's documented reference), the wire formats through the `tinker` SDK's own converters, the
seq_id ordering of the training worker, and the futures' long poll."""

from __future__ import annotations

import asyncio
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms import token_losses as tl

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.full_optimization  # numbers compared with references


def test_losses_are_the_documented_sums():
    logp = np.array([[-1.0, -2.0, -0.5, 7.0]], np.float32)  # the last position is padding
    q = np.array([[-1.2, -1.5, -0.5, -90.0]], np.float32)
    adv = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
    w = np.array([[1.0, 0.5, 0.0, 1.0]], np.float32)
    valid = np.array([[True, True, True, False]])
    ratio = np.exp(logp[0, :3] - q[0, :3])

    @jax.jit
    def every(lp):  # the three losses and the gradients of the policy ones, one program
        ce = tl.cross_entropy(lp, w, valid)
        is_, ppo = tl.importance_sampling(lp, q, adv, valid), tl.ppo(lp, q, adv, valid, 0.9, 1.1)
        grads = [jax.grad(lambda x, f=f: jnp.sum(f(x)))(lp) for f in
                 (lambda x: tl.importance_sampling(x, q, adv, valid), lambda x: tl.ppo(x, q, adv, valid))]
        return ce, is_, ppo, grads

    ce, is_, ppo, (is_grad, ppo_grad) = jax.tree.map(np.asarray, every(jnp.asarray(logp)))
    np.testing.assert_allclose(ce[0, :3], -w[0, :3] * logp[0, :3], rtol=1e-6)
    np.testing.assert_allclose(is_[0, :3], -ratio * adv[0, :3], rtol=1e-6)
    clipped = np.clip(ratio, 0.9, 1.1)
    np.testing.assert_allclose(ppo[0, :3], -np.minimum(ratio * adv[0, :3], clipped * adv[0, :3]), rtol=1e-6)
    for loss, grad in ((is_, is_grad), (ppo, ppo_grad)):  # padding: no loss, no inf/nan in the gradient
        assert loss[0, 3] == 0.0 and np.isfinite(grad).all() and grad[0, 3] == 0.0
    # importance sampling's gradient is -ratio * A per token (d/dlogp of -exp(logp - q) A)
    np.testing.assert_allclose(is_grad[0, :3], -ratio * adv[0, :3], rtol=1e-5)


def test_optim_step_is_torch_adamw():
    torch = pytest.importorskip("torch")
    from posttrain.training.tenants import AdamSettings, _adamw, _apply_update

    rng = np.random.default_rng(0)
    p0 = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) * 3 for k, v in p0.items()} for _ in range(3)]
    adam = AdamSettings(learning_rate=0.05, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=2.0)
    hp = {k: np.float32(getattr(adam, k)) for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                     "grad_clip_norm")}
    params = jax.tree.map(jnp.asarray, p0)
    state = jax.jit(_adamw().init)(params)
    update = jax.jit(_apply_update)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
    opt = torch.optim.AdamW(list(tp.values()), lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for g in grads:
        params, state, zeros, _ = update(params, state, jax.tree.map(jnp.asarray, g), hp)
        for k, t in tp.items():
            t.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 2.0)
        opt.step()
        assert all(float(jnp.abs(z).max()) == 0 for z in jax.tree.leaves(zeros))
    for k, t in tp.items():
        np.testing.assert_allclose(np.asarray(params[k]), t.detach().numpy(), rtol=1e-5, atol=1e-6)


def _request(data, loss="cross_entropy", config=None):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="m", seq_id=3)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_forward_backward_bodies_decode_and_bad_ones_name_the_field():
    import zstandard

    from posttrain.serve.tinker.wire import BadInput, read_forward_backward

    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0, -2.0, -3.0],
                                       "advantages": [0.5, 0.5, 0.5]})
    body = _request([good], "ppo", {"clip_high_threshold": 1.3})
    req = read_forward_backward(zstandard.ZstdCompressor().compress(body), "zstd", vocab=10, max_len=16)
    assert (req.model_id, req.seq_id, req.loss, req.forward_only) == ("m", 3, "ppo", False)
    assert dict(req.config) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}
    np.testing.assert_array_equal(req.rows[0].targets, [2, 3, 4])
    np.testing.assert_allclose(req.rows[0].inputs["logprobs"], [-1, -2, -3])

    def bad(data, loss="cross_entropy", config=None, vocab=10):
        with pytest.raises(BadInput) as e:
            read_forward_backward(_request(data, loss, config), None, vocab=vocab, max_len=16)
        assert (e.value.model_id, e.value.seq_id) == ("m", 3)  # the failure keeps its place in the order
        return str(e.value)

    ids = types.ModelInput.from_ints([1, 2, 3])
    assert "data[0].loss_fn_inputs.target_tokens: shape [2], expected [3]" in bad(
        [types.Datum(model_input=ids, loss_fn_inputs={"target_tokens": [2, 3]})])
    assert "data[0].loss_fn_inputs.weights: dtype int64, expected float32" in bad(
        [types.Datum(model_input=ids, loss_fn_inputs={"target_tokens": [2, 3, 4],
                                                      "weights": types.TensorData(data=[1, 1, 1], dtype="int64",
                                                                                  shape=[3])})])
    assert "loss_fn: 'dro'" in bad([good], "dro")
    assert "loss_fn_config.kl_coeff" in bad([good], "ppo", {"kl_coeff": 0.1})
    assert "data[0].loss_fn_inputs.advantages: not an input of loss 'cross_entropy'" in bad([good])
    assert "outside the vocabulary" in bad([good], "ppo", vocab=3)
    assert "required by loss 'importance_sampling'" in bad(
        [types.Datum(model_input=ids, loss_fn_inputs={"target_tokens": [2, 3, 4]})], "importance_sampling")
    with pytest.raises(BadInput, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xfe garbage", None, vocab=10, max_len=16)


def test_results_read_back_with_the_sdks_own_decoders():
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    from posttrain.serve.tinker.wire import SampledSequence, forward_backward_output, sample_response

    out = deserialize_forward_backward_output(forward_backward_output([np.array([-1.0, -2.0]), np.array([-3.0])],
                                                                      6.0))
    assert out.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    res = deserialize_sample_response(sample_response(
        [SampledSequence([5, 6], [-0.5, -0.25], True), SampledSequence([7], [-1.0], False)],
        np.array([np.nan, -1.5], np.float32)))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences] == [
        ([5, 6], [-0.5, -0.25], "stop"), ([7], [-1.0], "length")]
    assert res.prompt_logprobs[0] is None and res.prompt_logprobs[1] == -1.5


def test_operations_run_in_seq_order_once_and_past_failures():
    from posttrain.serve.tinker.futures import Futures, Reply
    from posttrain.serve.tinker.ops import OrderedOps

    futures = Futures()
    ops = OrderedOps(futures)
    ran, gate = [], threading.Event()

    def op(name, fail=False):
        def run():
            gate.wait(5)
            ran.append(name)
            if fail:
                raise ValueError(f"{name} is bad")
            return Reply(json={"name": name})
        return run

    ops.open("a")
    ops.open("b")
    r3 = ops.submit("a", 3, "three", op("a3"))  # ahead of its turn: waits for 1 and 2
    r2 = ops.submit("a", 2, "two", op("a2", fail=True))
    rb = ops.submit("b", 1, "b-one", op("b1"))
    r1 = ops.submit("a", 1, "one", op("a1"))
    assert ops.submit("a", 1, "one again", op("never")) == r1  # a retried request runs once
    gate.set()

    async def results():
        return [await futures.wait(r, 10) for r in (r1, r2, r3, rb)]

    replies = asyncio.run(results())
    assert [x for x in ran if x.startswith("a")] == ["a1", "a2", "a3"] and "never" not in ran
    assert replies[1].json == {"error": "two: a2 is bad", "category": "user"}
    assert replies[2].json == {"name": "a3"} and replies[3].json == {"name": "b1"}
    late = ops.submit("a", 2, "two", op("x"))
    assert late == r2
    unknown = asyncio.run(futures.wait(ops.submit("zzz", 1, "op", op("x")), 1))
    assert "unknown model_id 'zzz'" in unknown.json["error"]
    ops.stop()


def test_a_future_is_polled_until_it_settles():
    from posttrain.serve.tinker.futures import Futures, Reply

    futures = Futures()
    rid = futures.new()

    async def poll():
        t0 = time.monotonic()
        first = await futures.wait(rid, 0.2)  # still running: None after the poll window
        waited = time.monotonic() - t0
        threading.Timer(0.1, futures.resolve, (rid, Reply(proto=b"x"))).start()
        return first, waited, await futures.wait(rid, 5)

    first, waited, second = asyncio.run(poll())
    assert first is None and 0.15 < waited < 2 and second.proto == b"x"
    with pytest.raises(KeyError):
        asyncio.run(futures.wait("nope", 0.1))


def test_sessions_expire_and_snapshots_are_bounded(tmp_path):
    from types import SimpleNamespace

    from posttrain.serve.tinker.sampling import Weights
    from posttrain.serve.tinker.service import TinkerService, _Sampler

    pool = SimpleNamespace(cfg=SimpleNamespace(vocab_size=10, max_position_embeddings=32), max_len=32)
    closed = []  # the engine lanes the service lets go
    sampling = SimpleNamespace(pool=pool, max_len=32, close=lambda w: closed.append(w.lane))
    service = TinkerService(sampling, names=("m",), folder=tmp_path, checkpoints=tmp_path, session_ttl_s=0.05,
                            keep_snapshots=3)
    body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
    old = service.create_session(body)["session_id"]
    for i in range(5):
        key = f"{old}:sample:{i}"
        service._add_sampler(key, _Sampler(Weights(f"lane{i}"), owner=f"{old}:train:0"))
    assert sorted(service.samplers) == [f"{old}:sample:{i}" for i in (2, 3, 4)]  # the newest 3
    assert closed == ["lane0", "lane1"]  # the older snapshots' lanes left the engine
    time.sleep(0.1)
    service.create_session(body)  # sweeps the silent one
    assert service.sessions[old].finished and not service.samplers
    assert sorted(closed) == [f"lane{i}" for i in range(5)]
    from posttrain.serve.tinker.wire import BadInput

    with pytest.raises(BadInput) as e:
        service.session(old)
    assert e.value.status == 410
    service.close()
