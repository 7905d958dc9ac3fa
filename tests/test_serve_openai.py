"""`posttrain serve` with the real `openai` client against one live server on 127.0.0.1 (module-scoped): chat (plain,
tools, streamed tool-call deltas), completions (echo, log-probs, token-id prompts), the numbers (echo log-probs vs
transformers, completion log-probs vs teacher-forced scoring, top log-probs sorted), streaming equals not
streaming, seeds, stop strings, token endpoints, LoRA adapters, every error class (and the next request answered
after each), a mid-stream failure as an SSE error event, and 16 concurrent clients against the same 16 requests
one after another.

The model is the scripted checkpoint of `serve_models` (greedy chat replies are a Hermes tool call).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest
from serve_models import ADD_TOOL, CALL, lora_run, peft_adapter, scripted_checkpoint, with_adapters

from posttrain.models import tokenizer as tok_lib
from posttrain.rollout.policy import Policy
from posttrain.sampling.scoring import Scorer
from posttrain.serve import ServeConfig, Server

# the whole module: one live server for its tests, started once (about a minute of the fast subset)
pytestmark = pytest.mark.slow

KEY = "sk-test"
NAME = "scripted"
LORA = "scripted-lora"
PEFT = "scripted-peft"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    folder = scripted_checkpoint(root)
    run = lora_run(root / "lora-run", folder)
    peft = peft_adapter(root / "peft", folder)
    config = ServeConfig(model=str(folder), served_model_name=NAME, port=0, api_key=KEY,
                         loras=((LORA, str(run)), (PEFT, str(peft))),
                         max_slots=16, max_queue=24, max_body_bytes=1 << 16, segment_steps=8, warmup=False)
    server = Server(config)
    server.engine.warmup(NAME)  # the adapter's lane compiles when the test that uses it runs
    server.start()
    yield {"server": server, "url": server.url, "folder": folder, "run": run, "peft": peft,
           "tok": tok_lib.load(folder)}
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _ids(served, text: str) -> list[int]:
    return served["tok"].encode(text, add_special_tokens=False)


def _answers(client) -> None:
    """The server answers a plain request (after an error)."""
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


# ---------------------------------------------------------------------------------------------------- chat
def test_chat_plain_streamed_equals_whole(client):
    msgs = [{"role": "user", "content": "hello world"}]
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0)
    c = whole.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content.startswith("<tool_call>")  # no tools given: the call is plain text
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_tools_parsed_into_tool_calls(client):
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=[ADD_TOOL], max_tokens=20, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == CALL["arguments"]
    # the conversation goes on with the call and its result (the template has no tool role: a user turn)
    msgs += [c.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    again = client.chat.completions.create(model=NAME, messages=msgs, tools=[ADD_TOOL], max_tokens=20,
                                           temperature=0)
    assert again.choices[0].message.tool_calls[0].function.name == "add"
    none = client.chat.completions.create(model=NAME, messages=msgs, tools=[ADD_TOOL], tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert none.choices[0].finish_reason == "stop" and "<tool_call>" in none.choices[0].message.content


def test_chat_streamed_tool_call_deltas_reassembled_by_the_client(client):
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "hello"}], tools=[ADD_TOOL], max_tokens=20,
                  temperature=0)
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("add", CALL["arguments"])]
    deltas = [ch.choices[0].delta for ch in client.chat.completions.create(**kwargs, stream=True) if ch.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert calls[0].index == 0 and calls[0].function.name == "add" and calls[0].id.startswith("call_")
    assert not any(d.content for d in deltas)  # the call's text is not streamed as content


def test_chat_logprobs_and_token_ids(client, served):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "yes"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=5,
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt[-1] == served["tok"].hf.convert_tokens_to_ids("<|assistant|>") and len(ids) == 4
    for e in c.logprobs.content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0]
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy


# ---------------------------------------------------------------------------------------------------- completions
def test_echo_logprobs_equal_transformers(client, served):
    import torch
    import transformers

    prompt = _ids(served, "hello w3 w17 world w40 no w2 yes")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(served["folder"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1).numpy()
    want = [ref[t, prompt[t + 1]] for t in range(len(prompt) - 1)] + [ref[-1].max()]  # + the greedy token
    assert np.abs(np.asarray(lp.token_logprobs[1:]) - np.asarray(want)).max() <= 1e-4
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        values = list(top.values())
        assert values == sorted(values, reverse=True) and chosen <= values[0] and top[tok] == chosen


def test_completion_logprobs_are_the_learners(client, served):
    """Sampled tokens' log-probs equal teacher-forced scoring of prompt + completion (the learner's numbers)."""
    prompt = _ids(served, "w5 w6 w7")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=3, logprobs=2,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    ref = served["server"].models[NAME].policy.score([prompt], [ids])[0]  # what RL's learner computes
    assert np.abs(np.asarray(c.logprobs.token_logprobs) - ref).max() <= 1e-5
    assert c.text == served["tok"].decode(ids)


def test_prompt_forms_n_and_seeds(client, served):
    kw = dict(model=NAME, max_tokens=8, temperature=1.0, seed=11)
    one = client.completions.create(prompt="w1 w2", **kw)
    many = client.completions.create(prompt=["w1 w2", "yes no"], n=3, **kw)
    ids = client.completions.create(prompt=[_ids(served, "w1 w2"), _ids(served, "yes no")], n=3, **kw)
    assert [c.index for c in many.choices] == list(range(6))
    assert many.choices[0].text == one.choices[0].text == ids.choices[0].text  # same prompt, seed, sample
    assert [c.text for c in ids.choices] == [c.text for c in many.choices]
    assert len({c.text for c in many.choices[:3]}) > 1  # the samples of a prompt differ
    assert many.usage.prompt_tokens == 4


def test_streamed_completion_equals_whole_and_stop_strings(client):
    kw = dict(model=NAME, prompt="w9", max_tokens=16, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == whole and len(whole.split()) == 16
    stop = " ".join(whole.split()[5:7])
    cut = client.completions.create(**kw, stop=[stop, "zzz"])
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    cut_stream = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)
                         if c.choices)
    assert cut_stream == cut.choices[0].text


def test_token_endpoints(served):
    h = {"Authorization": f"Bearer {KEY}"}
    url = served["url"]
    info = httpx.get(f"{url}/tokenizer_info", headers=h).json()
    assert info["eos_token"] == "<eos>" and "chat_template" in info
    tok = httpx.post(f"{url}/tokenize", headers=h, json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert tok["tokens"] == _ids(served, "hello world") and tok["count"] == 2
    chat = httpx.post(f"{url}/tokenize", headers=h, json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][-1] == served["tok"].hf.convert_tokens_to_ids("<|assistant|>")
    text = httpx.post(f"{url}/detokenize", headers=h, json={"tokens": tok["tokens"]}).json()
    assert text == {"prompt": "hello world"}


def test_models_health_and_metrics(client, served):
    assert [m.id for m in client.models.list()] == [NAME, LORA, PEFT]
    assert httpx.get(served["url"] + "/health").status_code == 200
    metrics = httpx.get(served["url"] + "/metrics").text
    for name in ("posttrain_requests_total", "posttrain_prompt_tokens_total", "posttrain_completion_tokens_total",
                 "posttrain_queue_depth", "posttrain_slots_busy", "posttrain_time_to_first_token_seconds_bucket",
                 "posttrain_inter_token_latency_seconds_bucket"):
        assert name in metrics


@pytest.mark.slow  # two adapter lanes compile and a PEFT folder is opened as a Policy (~35 s on 2 cores)
def test_lora_adapter_served_over_the_base(client, served):
    prompt = _ids(served, "hello w3 w17 world")
    kw = dict(prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    base = client.completions.create(model=NAME, **kw).choices[0].logprobs.token_logprobs[1:-1]
    adapted = client.completions.create(model=LORA, **kw).choices[0].logprobs.token_logprobs[1:-1]
    ref = Scorer(with_adapters(served["folder"], served["run"])).score([prompt])[0].logprobs
    assert np.abs(np.asarray(adapted) - ref).max() <= 1e-5
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-3
    # a PEFT adapter folder: the policy that opens it (merged into its base) is the reference
    peft = client.completions.create(model=PEFT, **kw).choices[0].logprobs.token_logprobs[1:-1]
    ref = Policy.open(served["peft"], max_slots=1).score([prompt[:1]], [prompt[1:]])[0]
    assert np.abs(np.asarray(peft) - ref).max() <= 1e-5
    assert np.abs(np.asarray(peft) - np.asarray(base)).max() > 1e-3
    assert served["server"].models[NAME].model.layers.self_attn.q_proj.kernel.get_value() is not \
        served["server"].models[PEFT].model.layers.self_attn.q_proj.kernel.get_value()
    assert served["server"].models[NAME].model.embed_tokens.embedding.get_value() is \
        served["server"].models[PEFT].model.embed_tokens.embedding.get_value()  # unadapted weights shared


# ---------------------------------------------------------------------------------------------------- errors
def test_bad_bodies_are_400_naming_the_field(client, served):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = served["url"] + "/v1/completions"
    r = httpx.post(url, headers=h, content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    _answers(client)
    r = httpx.post(url, headers=h, json={"model": NAME, "prompt": "hi", "max_tokens": "ten"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", presence_penalty=0.5)
    assert e.value.body["param"] == "presence_penalty"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="text-only"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [image]}])
    _answers(client)


def test_prompt_over_the_context_is_400_maximum_context_length(client, served):
    long = _ids(served, " ".join(["w1"] * 600))
    for call in (lambda: client.completions.create(model=NAME, prompt=long, max_tokens=4),
                 lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w1 " * 600}])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "maximum context length" in e.value.message and e.value.code == "context_length_exceeded"
    _answers(client)


def test_unknown_model_404_missing_key_401_big_body_413(client, served):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    _answers(client)
    bad = openai.OpenAI(base_url=served["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(served["url"] + "/v1/models").status_code == 401
    _answers(client)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=NAME, prompt="w1 " * 30000, max_tokens=2)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    _answers(client)


def test_full_queue_is_429(client):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(client.completions.create, model=NAME, prompt="w1", n=16, max_tokens=400, temperature=0)
        time.sleep(0.5)  # its 16 sequences in the 16 slots
        waiting = pool.submit(client.completions.create, model=NAME, prompt="w2", n=16, max_tokens=4)
        time.sleep(0.5)  # 16 of the queue's 24 places taken
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=NAME, prompt="w3", n=12, max_tokens=4)
        assert e.value.code == "queue_full"
        assert len(busy.result().choices) == 16 and len(waiting.result().choices) == 16
    _answers(client)


def test_failure_mid_stream_is_an_sse_error_event(client, served):
    lane = served["server"].engine._lanes[NAME]
    calls = {"n": 0}
    real = lane.jitted.decode

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost (injected)")
        return real(*args, **kwargs)

    lane.jitted = lane.jitted._replace(decode=failing)
    try:
        stream = client.completions.create(model=NAME, prompt="w1", max_tokens=60, temperature=0, stream=True)
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert "device lost (injected)" in e.value.message
    finally:
        lane.bind()
    _answers(client)


def test_a_draining_server_answers_503(served):
    import dataclasses
    import threading

    import uvicorn

    from posttrain.serve.app import build_app

    state = dataclasses.replace(served["server"].state, draining=True)  # the same engine, a second front door
    uv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    while not uv.started:
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    drained = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        drained.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
    uv.should_exit = True
    t.join(10)
    _answers(openai.OpenAI(base_url=served["url"] + "/v1", api_key=KEY, max_retries=0))


def _cancelled(served) -> float:
    text = httpx.get(served["url"] + "/metrics").text
    m = re.search(r'^posttrain_sequences_total\{finish="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_that_leaves_frees_its_slot(served, client):
    """Streamed or not, a client that disconnects cancels its sequence: the slot is free long before the answer
    would have ended."""
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "w1", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    lane = served["server"].engine._lanes[NAME]
    real = lane.jitted.decode

    def slow(*args, **kwargs):  # 480 tokens take 3 s or more: long after the clients leave
        time.sleep(0.05)
        return real(*args, **kwargs)

    lane.jitted = lane.jitted._replace(decode=slow)
    before = _cancelled(served)
    try:
        with httpx.stream("POST", served["url"] + "/v1/completions", headers=h, json={**body, "stream": True}) as r:
            next(r.iter_lines())  # the first chunk, then the client goes away
        with pytest.raises(httpx.ReadTimeout):  # a whole answer the client stops waiting for
            httpx.post(served["url"] + "/v1/completions", headers=h, json=body, timeout=0.3)
        for _ in range(100):
            if _cancelled(served) >= before + 2 and served["server"].engine.stats()["running"] == 0:
                break
            time.sleep(0.05)
        assert _cancelled(served) == before + 2 and served["server"].engine.stats()["running"] == 0
    finally:
        lane.bind()
    _answers(client)


# ---------------------------------------------------------------------------------------------------- concurrency
def test_sixteen_clients_at_once_beat_sixteen_in_a_row(client):
    prompts = [f"w{i}" for i in range(16)]

    def one(p):
        return client.completions.create(model=NAME, prompt=p, max_tokens=96, temperature=0).choices[0].text

    ratios = []
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(2):  # the better of two rounds (a shared machine's load comes and goes)
            t0 = time.perf_counter()
            seq = [one(p) for p in prompts]
            t_seq = time.perf_counter() - t0
            t0 = time.perf_counter()
            par = list(pool.map(one, prompts))
            ratios.append(t_seq / (time.perf_counter() - t0))
            assert par == seq
    assert max(ratios) >= 3.0, ratios  # the benchmark reports the figure (goal >= 4x); looser here


# ---------------------------------------------------------------------------------------------------- lm-eval
MC_TASK = """task: posttrain_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_loglikelihoods_equal_our_scores(served, tmp_path, monkeypatch):
    """lm-eval's `local-completions` on an offline multiple-choice task (a local JSONL through --include_path's
    YAML): it finds the server's tokenizer (/tokenizer_info, /tokenize), sends token-id prompts with echo, and every
    loglikelihood it reads equals our own teacher-forced score of context + continuation."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    docs = [{"question": "w1 w2 hello", "choices": ["yes", "no", "world"], "answer": 0},
            {"question": "w7 no", "choices": ["w3 w4", "hello world", "w9"], "answer": 2},
            {"question": "yes yes w40", "choices": ["no", "w41"], "answer": 1}]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "posttrain_mc.yaml").write_text(MC_TASK.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["posttrain_mc"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        model_args=f"model={NAME},base_url={served['url']}/v1/completions,auth_token={KEY},num_concurrent=1,"
                   "max_retries=1,tokenized_requests=True", log_samples=True)
    samples = out["samples"]["posttrain_mc"]
    assert len(samples) == len(docs) and 0.0 <= out["results"]["posttrain_mc"]["acc,none"] <= 1.0
    tok, scorer = served["tok"], Scorer(served["server"].models[NAME].model)
    for sample in samples:
        for (ctx, cont), resp in zip(sample["arguments"], sample["resps"]):
            ctx_ids = tok.encode(ctx, add_special_tokens=False)
            cont_ids = tok.encode(cont, add_special_tokens=False)
            lps = scorer.score([ctx_ids + cont_ids])[0].logprobs
            assert abs(resp[0][0] - sum(lps[len(ctx_ids) - 1:])) <= 1e-4, (ctx, cont)
