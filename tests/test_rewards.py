"""Reward functions: math answer extraction/verification (incl. all GSM8K test golds),
format regex reward, and DAPO's soft overlong punishment."""

import json

import pytest

from posttrain.rewards import format_reward, math_answer, overlong_penalty
from posttrain.rewards.length import soft_overlong_punishment
from posttrain.rewards.math_answer import extract_answer, extract_gold, score_answer, to_number



@pytest.mark.parametrize(
    "text, expected",
    [
        (r"first \boxed{3} then \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),  # last boxed, nested braces
        (r"\boxed{x^{2}+\sqrt{y_{1}}}", r"x^{2}+\sqrt{y_{1}}"),
        ("work... #### 1,234", "1,234"),
        ("The answer is $1,234.00.", "1,234.00"),
        ("So the final answer is 18 dollars. Thanks!", "18 dollars"),
        ("we have 3 apples and then 5.", "5"),  # last number
        ("the difference 10-3 equals 7, and 2-5", "5"),  # binary minus is not a sign
        ("the temperature drops to -5", "-5"),
        (r"<think>maybe 3</think> <answer>42</answer>", "42"),
        (r"#### 7 but \boxed{8}", "8"),  # boxed beats ####
        ("no numbers here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s, value",
    [("1,234", 1234), ("1234.00", 1234), ("$1,234.00.", 1234), ("72.0", 72), ("-3", -3), ("50%", 50),
     (r"\frac{3}{4}", 0.75), ("3/4", 0.75), ("18 dollars", 18), (r"\$5", 5), ("1,2", None), ("x+1", None)],
)
def test_to_number(s, value):
    got = to_number(s)
    assert (got is None) if value is None else (got == value)


def test_extract_gold():
    assert extract_gold("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == "18"
    assert extract_gold("#### 1,450,000") == "1,450,000"
    assert extract_gold(r"\frac{1}{2}") == r"\frac{1}{2}"
    assert extract_gold(72) == "72"


@pytest.mark.parametrize(
    "completion, gold, reward",
    [
        ("The answer is $1,234.00.", "1234", 1.0),
        ("The answer is $1,234.00.", "#### 1,234", 1.0),
        ("Thus \\boxed{72.0}", "72", 1.0),
        ("so we get 72.", "72", 1.0),
        ("so we get 73.", "72", 0.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0),  # needs math-verify
        (r"\boxed{x^2 + 2x + 1}", r"(x+1)^2", 1.0),  # needs math-verify
        (r"\boxed{x^2 + 1}", r"(x+1)^2", 0.0),
        ("I don't know", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_score_answer(completion, gold, reward):
    assert score_answer(completion, gold) == reward


def test_math_answer_reward_interface():
    out = math_answer(["p1", "p2"], [r"\boxed{4}", "it is 5"], answer=["#### 4", "4"], question=["q1", "q2"])
    assert out == [1.0, 0.0]
    assert math_answer.required_fields == ("answer",)


def test_math_answer_all_gsm8k_test_golds(gsm8k):
    rows = [json.loads(line) for line in (gsm8k / "test.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    golds = [r["answer"] for r in rows]
    finals = [g.rsplit("####", 1)[1].strip() for g in golds]
    wrong = [str(int(n.replace(",", "")) + 1) for n in finals]  # every GSM8K test answer is an integer
    right_hash = golds  # the full reference solution ending in "#### n"
    right_boxed = [f"Adding it all up, the result is \\boxed{{{n}}}." for n in finals]
    wrong_hash = [g.rsplit("####", 1)[0] + "#### " + w for g, w in zip(golds, wrong)]
    wrong_boxed = [f"Adding it all up, the result is \\boxed{{{w}}}." for w in wrong]
    for completions, expected in ((right_hash, 1.0), (right_boxed, 1.0), (wrong_hash, 0.0), (wrong_boxed, 0.0)):
        scores = math_answer([r["question"] for r in rows], completions, answer=golds)
        bad = [i for i, s in enumerate(scores) if s != expected]
        assert not bad, f"{len(bad)} mismatches, e.g. row {bad[0]}: {completions[bad[0]]!r} vs {finals[bad[0]]!r}"


def test_format_reward_default_and_custom():
    good = "<think>reasoning\nmore</think>\n<answer>42</answer>"
    out = format_reward(
        ["p"] * 4,
        [good, "<answer>42</answer>", good + " trailing", "  " + good + "\n"],
    )
    # missing <think>; text after </answer>; surrounding whitespace is stripped
    assert out == [1.0, 0.0, 0.0, 1.0]
    custom = format_reward(["p", "p"], ["Final: 3", "3"], pattern=r"^.*Final: \d+$")
    assert custom == [1.0, 0.0]


def test_soft_overlong_punishment_formula():
    # L_max = 20, L_cache = 5 -> free up to 15 tokens, linear to -1 at 20, -1 beyond
    assert soft_overlong_punishment(10, 20, 5) == 0.0
    assert soft_overlong_punishment(15, 20, 5) == 0.0
    assert soft_overlong_punishment(16, 20, 5) == pytest.approx(-0.2)  # (15-16)/5
    assert soft_overlong_punishment(18, 20, 5) == pytest.approx(-0.6)  # (15-18)/5
    assert soft_overlong_punishment(20, 20, 5) == pytest.approx(-1.0)  # (15-20)/5
    assert soft_overlong_punishment(21, 20, 5) == -1.0
    with pytest.raises(ValueError):
        soft_overlong_punishment(1, 10, 20)


def test_overlong_penalty_factory():
    fn = overlong_penalty(max_length=20, cache_length=5)
    assert fn(["p"] * 3, ["a", "b", "c"], completion_lengths=[3, 17, 40]) == pytest.approx([0.0, -0.4, -1.0])
    assert fn.required_fields == ("completion_lengths",)
