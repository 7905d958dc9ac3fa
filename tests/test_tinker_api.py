"""The Tinker training API (`posttrain.serve.tinker`) with the real `tinker` SDK (0.38.0) against a live server on
127.0.0.1 (one per module, tiny:llama): training clients that learn, forward log-probs equal to the sampling
client's prompt log-probs, sampling, importance sampling moving log-probs the right way, two clients that do not
touch each other, operations computed when submitted and in `seq_id` order, checkpoints, and bad requests answered
with the SDK's `RequestFailedError` naming the field (and the server answering the next request)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "tiny:llama"
#: end to end: the SDK over HTTP into a server that compiles its programs on first use (~80 s on the 2-core machine)
pytestmark = pytest.mark.slow


KEY = "tml-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`posttrain serve tiny:llama --tinker --api-key tml-test` in this process (the OpenAI routes beside)."""
    from posttrain.serve import ServeConfig, Server

    config = ServeConfig(model=BASE, port=0, api_key=KEY, max_slots=8, segment_steps=8, tinker=True,
                         tinker_checkpoints=str(tmp_path_factory.mktemp("tinker-ckpts")))
    srv = Server(config).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def tokenizer(client):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    return tc.get_tokenizer()


def datum(ids: list[int], **inputs) -> types.Datum:
    """Input ids[:-1] predicting ids[1:] (the Tinker alignment), with the loss inputs given (one per target)."""
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], **inputs})


def logprobs_of(result) -> list[np.ndarray]:
    return [np.asarray(out["logprobs"].data, np.float32) for out in result.loss_fn_outputs]


def test_memorises_a_sequence_and_reports_per_token_logprobs(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    ids = tokenizer.encode("the cat sat down")
    d = datum(ids, weights=[1.0] * (len(ids) - 1))
    losses = []
    for _ in range(6):
        fb = tc.forward_backward([d], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))  # submitted before waiting on either
        out = fb.result()
        assert "optim/grad_norm" in opt.result().metrics
        lp = logprobs_of(out)[0]
        assert lp.shape == (len(ids) - 1,)
        np.testing.assert_allclose(-lp.sum(), out.metrics["loss:sum"], rtol=1e-4)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] / 2, losses


def test_forward_logprobs_equal_the_sampling_clients(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    ids = tokenizer.encode("a short prompt")
    d = datum(ids, weights=[1.0] * (len(ids) - 1))
    before = logprobs_of(tc.forward([d], "cross_entropy").result())[0]
    tc.forward_backward([d], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    train = logprobs_of(tc.forward([d], "cross_entropy").result())[0]
    prompt = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert prompt[0] is None and len(prompt) == len(ids)
    assert np.abs(np.asarray(prompt[1:], np.float32) - train).max() <= 2e-3
    assert np.abs(np.asarray(prompt[1:], np.float32) - before).max() > 1e-2  # the sampler has the new weights


def test_sample_returns_the_sequences_asked_for_with_their_logprobs(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("once upon")
    res = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, seed=7)).result()
    assert len(res.sequences) == 3
    assert len({s.sequence_id for s in res.sequences}) == 3
    for s in res.sequences:
        assert 1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0 for lp in s.logprobs)
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # same seed, same tokens
    # the sampler's log-probs are the learner's: a forward over prompt + sample scores the same numbers
    s = res.sequences[0]
    full = prompt + list(s.tokens)
    train = logprobs_of(tc.forward([datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result())[0]
    assert np.abs(train[len(prompt) - 1:] - np.asarray(s.logprobs)).max() <= 2e-3


def test_importance_sampling_moves_logprobs_the_way_the_advantages_say(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    good, bad = tokenizer.encode("yes yes yes"), tokenizer.encode("no no no no")

    def rl_datum(ids, advantage):
        n = len(ids) - 1
        return datum(ids, logprobs=[0.0] * n, advantages=[advantage] * n)

    def seq_logprob(ids):
        return float(logprobs_of(tc.forward([datum(ids, weights=[1.0] * (len(ids) - 1))], "cross_entropy")
                                 .result())[0].sum())

    before = seq_logprob(good), seq_logprob(bad)
    for _ in range(2):  # two calls, one datum each: their gradients add up before the step
        outs = [tc.forward_backward([rl_datum(good, 1.0)], "importance_sampling"),
                tc.forward_backward([rl_datum(bad, -1.0)], "importance_sampling")]
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert [len(o.result().loss_fn_outputs) for o in outs] == [1, 1]
    after = seq_logprob(good), seq_logprob(bad)
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_two_training_clients_do_not_touch_each_others_weights(client, tokenizer):
    a = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    b = client.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()
    ids = tokenizer.encode("shared text")
    d = datum(ids, weights=[1.0] * (len(ids) - 1))
    b_before = logprobs_of(b.forward([d], "cross_entropy").result())[0]
    futures = []
    for _ in range(3):  # interleaved: a trains while b only reads
        futures += [a.forward_backward([d], "cross_entropy"), a.optim_step(types.AdamParams(learning_rate=5e-2)),
                    b.forward([d], "cross_entropy")]
    results = [f.result() for f in futures]
    for r in results[2::3]:
        np.testing.assert_array_equal(logprobs_of(r)[0], b_before)
    a_after = logprobs_of(a.forward([d], "cross_entropy").result())[0]
    assert np.abs(a_after - b_before).max() > 1e-2


def test_operations_run_in_seq_order_when_submitted(server, client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=8).result()
    ids = tokenizer.encode("order matters")
    d = datum(ids, weights=[1.0] * (len(ids) - 1))
    before = tc.forward([d], "cross_entropy")
    tc.forward_backward([d], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2))
    after = tc.forward([d], "cross_entropy")
    lp_before, lp_after = logprobs_of(before.result())[0], logprobs_of(after.result())[0]
    assert lp_after.sum() > lp_before.sum()  # the forward submitted after the step saw it
    # computed when submitted, not when polled: with nobody polling, the future settles anyway
    service = server.state.tinker
    rid = service.forward_backward(_proto(tc.model_id, 4, ids), None)
    deadline = time.monotonic() + 60
    while service.futures.settled(rid) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert service.futures.settled(rid).proto is not None


def _proto(model_id: str, seq: int, ids: list[int]) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum(ids, weights=[1.0] * (len(ids) - 1))],
                                                          loss_fn="cross_entropy"), model_id=model_id, seq_id=seq)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_state_and_sampler_checkpoints_resume(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
    ids = tokenizer.encode("resume me")
    d = datum(ids, weights=[1.0] * (len(ids) - 1))
    tc.forward_backward([d], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2))
    state = tc.save_state("step1").result().path
    sampler_path = tc.save_weights_for_sampler("step1").result().path
    assert state.startswith("tinker://") and "/weights/" in state and "/sampler_weights/" in sampler_path
    expected = logprobs_of(tc.forward([d], "cross_entropy").result())[0]
    resumed = client.create_training_client_from_state_with_optimizer(state).result()
    np.testing.assert_allclose(logprobs_of(resumed.forward([d], "cross_entropy").result())[0], expected, atol=1e-6)
    # one more identical step on both: the optimizer state came back too
    for c in (tc, resumed):
        c.forward_backward([d], "cross_entropy")
        c.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    np.testing.assert_allclose(logprobs_of(resumed.forward([d], "cross_entropy").result())[0],
                               logprobs_of(tc.forward([d], "cross_entropy").result())[0], atol=1e-5)
    sampler = client.create_sampling_client(model_path=sampler_path).result()
    lp = np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], np.float32)
    assert np.abs(lp - expected).max() <= 2e-3


def _fails(future, *words):
    with pytest.raises(tinker.RequestFailedError) as e:
        future.result()
    for w in words:
        assert w in str(e.value), str(e.value)
    return e.value


def test_bad_requests_fail_with_the_field_named_and_the_server_goes_on(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
    ids = tokenizer.encode("bad inputs")
    n = len(ids) - 1
    good = datum(ids, weights=[1.0] * n)
    ghost = tinker.TrainingClient(tc.holder, model_seq_id=99, model_id="no-such-model", info=tc.get_info())
    err = _fails(ghost.forward([good], "cross_entropy"), "model_id", "no-such-model")
    assert err.category == types.RequestErrorCategory.User
    _fails(tc.forward([datum(ids, weights=[1.0] * (n - 1))], "cross_entropy"),
           "data[0].loss_fn_inputs.weights", f"expected [{n}]")
    wrong_dtype = types.TensorData(data=[1] * n, dtype="int64", shape=[n])
    _fails(tc.forward([datum(ids, weights=wrong_dtype)], "cross_entropy"), "weights", "dtype int64")
    _fails(tc.forward([good], "cispo"), "loss_fn", "cispo")
    _fails(tc.forward([datum(ids, logprobs=[0.0] * n)], "importance_sampling"), "advantages", "required")
    _fails(tc.forward([good], "ppo"), "advantages", "required by loss 'ppo'")
    _fails(tc.forward_backward([good], "ppo", {"epsilon": 0.1}), "loss_fn_config.epsilon")
    _fails(tc.optim_step(types.AdamParams(learning_rate=-1.0)), "learning_rate")
    out = tc.forward([good], "cross_entropy").result()  # the client's order went on past every failure
    assert len(logprobs_of(out)[0]) == n
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(ids)
    _fails(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), topk_sample_logprobs=2),
           "topk_sample_logprobs")
    _fails(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10**6)), "max_tokens")
    _fails(sampler.sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=2)), "vocabulary")
    assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1
    with pytest.raises(tinker.APIStatusError, match="base_model"):  # answered at once, not through a future
        client.create_sampling_client(base_model="not-served").result()
    with pytest.raises(tinker.RequestFailedError, match="base_model"):
        client.create_lora_training_client(base_model="not-served", rank=4).result()


def test_rest_endpoints_the_api_key_and_the_openai_routes_beside(server):
    import httpx

    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert caps.supported_models[0].model_name == BASE and caps.supported_models[0].trainable
    assert httpx.get(f"{server.url}/api/v1/healthz", headers={"X-API-Key": KEY}).json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/api/v1/healthz", headers={"X-API-Key": "tml-x"}).status_code == 401
    assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=server.url, api_key="tml-wrong").get_server_capabilities().result()
    # the same server, the same key as a bearer token: the OpenAI-compatible routes
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [BASE]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'endpoint="/api/v1/create_session"' in metrics and 'endpoint="/api/v1/retrieve_future"' in metrics


def test_new_restored_and_sampling_clients_of_a_known_shape_compile_nothing(client, tokenizer):
    from compile_counter import count_compiles

    ids = tokenizer.encode("no compiles")
    d = datum(ids, weights=[1.0] * (len(ids) - 1))
    first = client.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    first.forward_backward([d], "cross_entropy")
    first.optim_step(types.AdamParams(learning_rate=1e-2))
    first.forward([d], "cross_entropy")
    first.save_weights_and_get_sampling_client().result().compute_logprobs(
        types.ModelInput.from_ints(ids)).result()  # every program of this shape exists now
    with count_compiles() as compiles:
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=12).result()
        tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        resumed = client.create_training_client_from_state_with_optimizer(tc.save_state("c").result().path).result()
        resumed.forward_backward([d], "cross_entropy")
        resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = resumed.save_weights_and_get_sampling_client().result()
        sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert compiles.total == 0, compiles
