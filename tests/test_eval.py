"""The evaluator (`posttrain.eval.evaluate`, shared by RL and `posttrain eval`): maj@k against enumeration of all
k-subsets, answer keys, evaluate's maj@k on scripted samples, and `posttrain eval` end to end on GSM8K."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from test_rl_options import ScriptedSampler as RLScriptedSampler

from posttrain.eval.evaluate import answer_key, evaluate, maj_at_k, pass_at_k, per_problem
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptSet


def enumerated_maj_at_k(answers, correct, k):
    """Mean over every k-subset of the samples: 1/t if the correct answer is one of the t most frequent answers
    (samples without an answer do not vote; a subset with no answer scores 0)."""
    right = {a for a, ok in zip(answers, correct) if ok and a is not None}
    scores = []
    for subset in itertools.combinations(range(len(answers)), k):
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            scores.append(0.0)
            continue
        top = max(votes.values())
        tied = [a for a, c in votes.items() if c == top]
        scores.append(sum(a in right for a in tied) / len(tied))
    return float(np.mean(scores))


def test_maj_at_k_equals_enumeration_of_subsets():
    rng = random.Random(0)
    cases = 0
    for n in range(1, 9):
        for _ in range(12):
            pool = ["a", "b", "c", "d", None][: rng.randint(1, 5)]
            answers = [rng.choice(pool) for _ in range(n)]
            correct = [a == "a" for a in answers]
            for k in range(1, n + 1):
                assert maj_at_k(answers, correct, k) == pytest.approx(enumerated_maj_at_k(answers, correct, k),
                                                                      abs=1e-12), (answers, k)
                cases += 1
    assert cases > 300


def test_maj_at_k_hand_values():
    # 3 samples "1", 2 of "2" (wrong), 1 without an answer: majority of all 6 is "1"
    answers, correct = ["1", "1", "1", "2", "2", None], [True, True, True, False, False, False]
    assert maj_at_k(answers, correct, 6) == 1.0
    # k = 1: the sample's own correctness, averaged (a no-answer sample scores 0)
    assert maj_at_k(answers, correct, 1) == pytest.approx(3 / 6)
    # a 1-1 tie between the right and a wrong answer counts 1/2
    assert maj_at_k(["1", "2"], [True, False], 2) == 0.5
    # nothing right: 0; everything right: 1
    assert maj_at_k(["2", "3", "3"], [False] * 3, 2) == 0.0 and maj_at_k(["1"] * 4, [True] * 4, 3) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        maj_at_k(["1"], [True], 2)


def test_answer_keys_group_equal_numbers():
    assert answer_key("so the answer is \\boxed{1,000}", "math_answer") == answer_key("#### 1000.0", "math_answer")
    assert answer_key("#### 1000.0", "math_answer") == str(Fraction(1000))
    assert answer_key("no digits here", "math_answer") is None
    assert answer_key("  yes \n", "my_reward") == "yes" and answer_key("   ", "my_reward") is None


class ScriptedSampler(RLScriptedSampler):
    """test_rl_options' stand-in `Sampler` with samples that make pass@k and maj@k differ."""

    GREEDY = ["so \\boxed{1}", "so \\boxed{5}", "so \\boxed{5}"]
    SAMPLED = [["\\boxed{1}", "\\boxed{7}", "\\boxed{7}", "\\boxed{9}"],  # answer 1: 1 of 4 right, majority 7
               ["\\boxed{0}", "\\boxed{2}", "\\boxed{2}", "no answer"],  # answer 2: 2 right, majority 2
               ["\\boxed{3}", "\\boxed{3}", "\\boxed{4}", "\\boxed{3}"]]  # answer 3: 3 right, majority 3


def test_evaluate_reports_pass_and_maj_at_k_and_rows():
    from posttrain.rewards.runner import RewardRunner, RewardSpec

    records = [{"prompt": f"q{i}", "answer": str(i + 1)} for i in range(3)]
    with RewardRunner([RewardSpec("math_answer")], num_workers=0) as runner:
        e = evaluate(Policy(None, None, sampler=ScriptedSampler()), PromptSet.of(records, [[5, 6]] * 3), runner,
                     correctness="math_answer", max_new_tokens=8, k=[1, 2, 4], n_samples=4, temperature=0.7)
    samples = ScriptedSampler.SAMPLED
    ok = [[answer_key(t, "math_answer") == str(i + 1) for t in s] for i, s in enumerate(samples)]
    keys = [[answer_key(t, "math_answer") for t in s] for s in samples]
    assert e["eval/accuracy"] == pytest.approx(1 / 3)
    assert e["eval/pass@1_sampled"] == pytest.approx(np.mean([sum(o) / 4 for o in ok]))
    for k in (2, 4):
        assert e[f"eval/pass@{k}"] == pytest.approx(np.mean([pass_at_k(4, sum(o), k) for o in ok]))
        assert e[f"eval/maj@{k}"] == pytest.approx(np.mean([enumerated_maj_at_k(a, o, k) for a, o in zip(keys, ok)]))
    # maj@4 by hand: problem 1 loses to "7", problem 2: "2" wins 2-1, problem 3: "3" wins
    assert e["eval/maj@4"] == pytest.approx(2 / 3)
    rows = per_problem(e, records, correctness="math_answer", k=[1, 2, 4])
    assert [r["num_correct"] for r in rows] == [1, 2, 3]
    assert rows[1]["samples"][3] == {"text": "no answer", "answer": None, "correct": False, "reward": 0.0,
                                     "finish_reason": "stop"}
    assert rows[0]["greedy"]["correct"] and not rows[1]["greedy"]["correct"] and rows[2]["maj@4"] == 1.0


@pytest.mark.slow
def test_eval_cli_on_gsm8k(gsm8k, tmp_path, capsys):
    """`posttrain eval` on the GSM8K test file (read in place) with a tiny model: every problem and sample
    lands in the JSONL, the summary's figures are the rows' means."""
    from posttrain.cli.main import main

    out = tmp_path / "eval.jsonl"
    code = main(["--no-compile-cache", "eval", "--model", "tiny:llama", "--data", str(gsm8k / "test.jsonl"),
                 "--reward", "math_answer", "--n", "4", "--temperature", "0.6", "--limit", "6",
                 "--max-new-tokens", "8", "--output", str(out), "--reward-workers", "0", "--no-progress"])
    assert code == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["samples"]) == 4 for r in rows)
    assert rows[0]["prompt"].startswith("Janet") and rows[0]["answer"].endswith("#### 18")
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["eval/num_prompts"] == 6
    for k in (2, 4):
        assert summary[f"eval/pass@{k}"] == pytest.approx(np.mean([r[f"pass@{k}"] for r in rows]))
        assert summary[f"eval/maj@{k}"] == pytest.approx(np.mean([r[f"maj@{k}"] for r in rows]))
    assert summary["eval/accuracy"] == pytest.approx(np.mean([r["greedy"]["correct"] for r in rows]))
    assert "greedy pass@1" in capsys.readouterr().out


def test_eval_cli_errors(tmp_path, capsys):
    from posttrain.cli.main import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    assert main(["--no-compile-cache", "eval", "--model", "tiny:llama", "--data", str(bad), "--n", "2",
                 "--reward-workers", "0", "--output", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl, line 2" in err and "answer" in err
    assert main(["eval", "--model", "tiny:llama", "--data", str(bad), "--n", "2", "--k", "3"]) == 2
    assert "--k" in capsys.readouterr().err


def test_model_paths(tmp_path):
    """--model takes what the training commands take (tiny:, folders, .gguf via resolve_path) and a run's output
    folder, which stands for its hf/ export; a missing folder is a CheckpointError."""
    import shutil

    from posttrain.eval.run import default_ks
    from posttrain.models.hf_io import CheckpointError
    from posttrain.models.spec import resolve_checkpoint as model_folder
    from posttrain.models.tiny import resolve_model_path

    tiny = resolve_model_path("tiny:llama")
    assert model_folder("tiny:llama") == model_folder(tiny) and (model_folder(tiny) / "config.json").exists()
    run = tmp_path / "run"
    shutil.copytree(tiny, run / "hf")
    assert model_folder(str(run)) == run / "hf"
    with pytest.raises(CheckpointError, match="does not exist"):
        model_folder(str(tmp_path / "nothing"))
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6] and default_ks(0) == []
