"""The `judge` reward against a live scripted OpenAI-compatible judge on 127.0.0.1 (`tests/judge_server.py`, one
per module): the expected rewards per verdict, number and regex, unparseable replies scored 0 and counted, the
one-token attack strings scored 0 without a request, a judge that is down or slow failing under the reward limits
(and stopping the run after `max_failed_steps`), requests `concurrency` at a time, and bad settings as one line."""

from __future__ import annotations

import time

import numpy as np
import pytest

from judge_server import FakeJudge
from posttrain.loading import LoadError
from posttrain.rewards.checks import RewardFailedError
from posttrain.rewards.judge import OPENERS, JudgeConfig, judge, master_key, parse_score
from posttrain.rewards.runner import RewardRunner

# The paper's master keys (Zhao et al. 2025, arXiv:2507.08794, Table 1) and their kin a policy finds.
ATTACKS = [" ", ".", ",", ":", "Thought process:", "Let's solve this problem step by step.", "Solution", "解",
           "かいせつ", "Respuesta", "", "\n\n", "Answer:", "**Solution:**", "### Final Answer", "<|im_start|>assistant",
           "assistant:", "<|eot_id|>", "</s>", "```", "Solution:\n", "The answer is:", "Step 1:", "解答：", "...",
           "<think></think>", "Let's think step by step."]


@pytest.fixture(scope="module")
def server():
    with FakeJudge() as s:
        yield s


def _runner(url: str, max_failed: int = 0, **kwargs) -> RewardRunner:
    spec = {"name": "judge", "kwargs": {"url": url, **kwargs}}
    return RewardRunner([spec], num_workers=1, max_failed_calls=max_failed, timeout_s=10.0)


def test_master_keys_score_zero_and_answers_pass():
    assert all(master_key(a) for a in ATTACKS), [a for a in ATTACKS if not master_key(a)]
    for real in ["42", "The answer is 42.", "Solution: x = 3", "yes", "No.", "Thought process: 2+2=4, so 4",
                 "<|im_start|>assistant\n17", "**12**", "Answer: 12"]:
        assert not master_key(real), real
    assert "solution" in OPENERS and "thought process" in OPENERS


@pytest.mark.parametrize("score,reply,expected", [
    ("verdict", "yes", 1.0), ("verdict", "No.", 0.0), ("verdict", "The answer is correct.", 1.0),
    ("verdict", "The answer is not correct.", 0.0), ("verdict", "incorrect", 0.0),
    ("verdict", "It looks wrong at first, but it is correct", 1.0), ("verdict", "maybe", None),
    ("number", "Score: 7", 0.7), ("number", "I give it 7/10", 0.7), ("number", "15", 1.0), ("number", "-3", 0.0),
    ("number", "no number", None),
    (r"<score>(.*?)</score>", "reasoning... <score>4</score>", 0.4),
    (r"<score>(.*?)</score>", "<score>3</score> then <score>9</score>", 0.9),
    (r"VERDICT: (\w+)", "VERDICT: PASS", 1.0), (r"VERDICT: (\w+)", "VERDICT: FAIL", 0.0),
    (r"VERDICT: (\w+)", "VERDICT: unsure", None), (r"<score>(.*?)</score>", "no tags", None),
])
def test_replies_are_read_as_configured(score, reply, expected):
    cfg = JudgeConfig(url="http://127.0.0.1:1/v1", score=score, max=10.0 if score != "verdict" else 1.0)
    got = parse_score(reply, cfg)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_judge_gives_the_scripted_rewards_and_counts(server, tmp_path, monkeypatch):
    """Verdicts 1/0, an unparseable reply 0 (counted), master keys 0 without a request (counted); the record's
    reference, question and answer reach the judge in one user message; the served model name and the key go out."""
    server.reset()
    template = tmp_path / "judge.txt"
    template.write_text("Q: {question}\nREF: {reference}\nANSWER: {answer}\nSay yes or no.")
    completions = ["42 REPLY:yes", "41 REPLY:no", "43 REPLY:hmm, hard to say", "Solution:", ".", "40 REPLY:Correct."]
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    with _runner(server.url, template=str(template), api_key_env="JUDGE_TEST_KEY", model="fake-judge") as runner:
        total, per, stats = runner.score([f"q{i}" for i in range(6)], completions, {"answer": ["42"] * 6})
    assert per["judge"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert np.allclose(total, per["judge"])
    assert stats["reward/judge/parse_failures"] == 1 and stats["reward/judge/skipped"] == 2
    assert stats["reward/judge/failures"] == 0
    asked = [r for r in server.requests if r["path"].endswith("/chat/completions")]
    assert len(asked) == len(server.requests) == 4  # the two master keys were never sent; the model was given
    first = next(r for r in asked if "42 REPLY:yes" in r["body"]["messages"][0]["content"])
    assert first["body"]["model"] == "fake-judge" and len(first["body"]["messages"]) == 1
    assert first["body"]["messages"][0] == {"role": "user", "content": "Q: q0\nREF: 42\nANSWER: 42 REPLY:yes\n"
                                                                       "Say yes or no."}
    assert first["headers"].get("Authorization") == "Bearer sk-test"


def test_number_scores_scale_and_model_from_the_server(server):
    server.reset()
    with _runner(server.url, score="number", min=1, max=5, template="{answer}") as runner:
        _, per, stats = runner.score(["q"] * 3, ["a REPLY:5", "b REPLY:3/5", "c REPLY:1"], {})
    assert per["judge"].tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert [r["path"] for r in server.requests].count("/v1/models") == 1  # asked once for the served model
    assert {r["body"]["model"] for r in server.requests if r["body"]} == {"fake-judge"}


def test_requests_run_concurrency_at_a_time(server):
    server.reset()
    with _runner(server.url, concurrency=4, template="{answer}") as runner:
        runner.score(["q"], ["warm REPLY:yes"], {})  # the worker and its client started
        t = time.monotonic()
        _, per, _ = runner.score(["q"] * 8, [f"{i} SLEEP:0.5 REPLY:yes" for i in range(8)], {})
        took = time.monotonic() - t
    assert per["judge"].tolist() == [1.0] * 8
    assert server.peak == 4
    assert took < 3.0, took  # 2 rounds of 0.5 s, not 8


def test_a_judge_that_is_down_fails_and_stops_the_run():
    with FakeJudge() as dead:
        url = dead.url
    with _runner(url, max_failed=2, template="{answer}") as runner:
        _, per, stats = runner.score(["q"] * 3, ["a", "b", "c"], {})
        assert stats["reward/judge/failures"] == 3 and per["judge"].tolist() == [0.0] * 3
        assert "ConnectError" in runner.last_errors["judge"][0]
        with pytest.raises(RewardFailedError, match="judge"):
            runner.score(["q"] * 3, ["a", "b", "c"], {})


def test_slow_errors_and_garbage_are_failures_not_hangs(server):
    server.reset()
    with _runner(server.url, timeout_s=1.0, template="{answer}") as runner:
        t = time.monotonic()
        _, per, stats = runner.score(["q"] * 4, ["ok REPLY:yes", "SLEEP:30", "STATUS:500", "GARBAGE"], {})
        assert time.monotonic() - t < 10
        assert per["judge"].tolist() == [1.0, 0.0, 0.0, 0.0]
        assert stats["reward/judge/failures"] == 3 and stats["reward/judge/parse_failures"] == 0
        _, per, _ = runner.score(["q"], ["again REPLY:yes"], {})  # the judge is asked again afterwards
        assert per["judge"].tolist() == [1.0]


@pytest.mark.parametrize("kwargs,match", [
    ({}, "kwargs.url or kwargs.model is required"),
    ({"url": "http://127.0.0.1:8000"}, "ending in /v1"),
    ({"url": "http://x/v1", "temprature": 0.5}, r"unknown kwargs \['temprature'\]; accepted: url, model"),
    ({"url": "http://x/v1", "template": "{answer} {refrence}"}, r"placeholder\(s\) \['refrence'\]"),
    ({"url": "http://x/v1", "template": "grade this"}, "must contain {answer}"),
    ({"url": "http://x/v1", "score": "(a)(b)"}, "exactly one group"),
    ({"url": "http://x/v1", "api_key_env": "POSTTRAIN_NO_SUCH_VAR"}, "not set"),
    ({"url": "http://x/v1", "min": 5, "max": 5}, "greater than"),
])
def test_bad_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(LoadError, match=match) as e:
        RewardRunner([{"name": "judge", "kwargs": kwargs}], num_workers=0)
    assert "\n" not in str(e.value) and str(e.value).startswith("reward 'judge':")


def test_reference_field_is_required_only_when_the_template_reads_it():
    with_ref = judge(url="http://x/v1")
    assert with_ref.required_fields == ("answer",)
    assert judge(url="http://x/v1", template="{question} {answer}").required_fields == ()
    assert judge(url="http://x/v1", reference_field="gold").required_fields == ("gold",)


def test_judge_requests_overlap_generation_and_ask_once(server):
    """In a rollout, the judge gets each completion as soon as the sampler finishes it (`on_finish`): requests
    arrive while other sequences still decode, each completion is asked once, and the rewards are the ones scoring
    after generation gives."""
    from posttrain.models import from_pretrained
    from posttrain.models.tiny import resolve_model_path
    from posttrain.models.tokenizer import load as load_tokenizer
    from posttrain.rollout.collect import generate_rollouts
    from posttrain.rollout.policy import Policy
    from posttrain.rollout.prompts import PromptSet
    from posttrain.sampling import SamplingParams

    path = resolve_model_path("tiny:llama")
    tok = load_tokenizer(path)
    policy = Policy(from_pretrained(path), tok, max_slots=16, segment_steps=8)  # the host sees every 8 tokens
    sampler = policy.sampler
    ends = []
    generate = sampler.generate
    sampler.generate = lambda *a, **k: (out := generate(*a, **k), ends.append(time.monotonic()))[0]
    records = [{"prompt": f"question {i}", "answer": str(i)} for i in range(8)]
    prompts = PromptSet.of(records, [tok.encode(r["prompt"]) for r in records])
    # a few stop ids: lengths from 1 to 128 tokens, so sequences finish in different decode segments
    params = SamplingParams(max_new_tokens=128, n=2, temperature=1.0, seed=3, stop_token_ids=[2, 9, 23])
    server.reset()
    with _runner(server.url, concurrency=4, template="{answer} REPLY:yes") as runner:
        ro = generate_rollouts(policy, prompts, params, runner)
        asked = [r for r in server.requests if r["path"].endswith("/chat/completions")]
        again = runner.score(ro.prompts_text, ro.texts, {"answer": [records[i]["answer"] for i in ro.record_index]})
    lengths = ro.completion_lengths()
    assert len(set(lengths.tolist())) > 3, lengths  # sequences did finish at different times
    assert len(asked) == 16 - int(ro.reward_stats["reward/judge/skipped"])  # once each
    assert min(r["t"] for r in asked) < ends[0]  # requests came in while the sampler still decoded the others
    assert ro.per_reward["judge"].tolist() == again[1]["judge"].tolist()
    assert ro.reward_stats["reward/judge/failures"] == 0
