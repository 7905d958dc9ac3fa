"""RewardRunner / load_reward: failures become failure_value with counts (never a crash),
missing data set fields fail fast, and math_answer works inside the process pool."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
import time

import numpy as np
import pytest

from posttrain.rewards import RewardRunner, RewardSpec, load_reward, math_answer


FAULTY = textwrap.dedent(
    """
    import os, signal, time

    def const(prompts, completions, **fields):
        return [1.0] * len(completions)

    def raises(prompts, completions, **fields):
        if any("boom" in c for c in completions):
            raise RuntimeError("boom")
        return [1.0] * len(completions)

    def sleepy(prompts, completions, **fields):
        if any("slow" in c for c in completions):
            time.sleep(60)
        return [1.0] * len(completions)

    def stubborn(prompts, completions, **fields):
        # ignores SIGALRM, so only the parent's hard deadline (kill + new pool) can stop it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        if any("slow" in c for c in completions):
            time.sleep(60)
        return [1.0] * len(completions)

    def wrong_length(prompts, completions, **fields):
        return [1.0]

    def bad_values(prompts, completions, **fields):
        return [float("nan") if "nan" in c else ("x" if "str" in c else 2.0) for c in completions]

    def crashes(prompts, completions, **fields):
        if any("die" in c for c in completions):
            os._exit(3)
        return [1.0] * len(completions)

    def needs_answer(prompts, completions, answer, **fields):
        return [float(a == c) for a, c in zip(answer, completions)]

    def scaled(prompts, completions, factor=1.0):
        return [factor * len(c) for c in completions]

    not_callable = 3
    """
)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "faulty_rewards.py"
    path.write_text(FAULTY)
    return str(path)


def test_load_reward_references(faulty):
    assert load_reward("math_answer") is math_answer
    assert load_reward("posttrain.rewards.math_answer:math_answer") is math_answer
    assert load_reward(f"{faulty}:const")(["p"], ["c"]) == [1.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'.*math_answer"):
        load_reward("nope")
    with pytest.raises(ValueError, match="not found"):
        load_reward("/does/not/exist.py:fn")
    with pytest.raises(ValueError, match="'missing' not found"):
        load_reward(f"{faulty}:missing")
    with pytest.raises(ValueError, match="non-callable"):
        load_reward(f"{faulty}:not_callable")
    with pytest.raises(ValueError, match="cannot import reward module"):
        load_reward("no_such_pkg_xyz.mod:fn")


def test_missing_field_fails_fast(faulty):
    with RewardRunner(["math_answer", RewardSpec("fmt", "format")], num_workers=1) as runner:
        with pytest.raises(ValueError, match="'answer'"):
            runner.score(["p"], ["\\boxed{1}"], {"question": ["q"]})
        assert runner._pool is None  # failed before any worker started
    with RewardRunner([RewardSpec("mine", f"{faulty}:needs_answer")], num_workers=0) as runner:
        with pytest.raises(ValueError, match="'answer'"):
            runner.check_fields(["question"])
    with RewardRunner([RewardSpec("len", "overlong_penalty", kwargs={"max_length": 10, "cache_length": 2})], num_workers=0) as r:
        with pytest.raises(ValueError, match="completion_lengths"):
            r.score(["p"], ["c"], {})


def test_failures_become_failure_value_in_pool(faulty):
    specs = [
        RewardSpec("ok", f"{faulty}:const", weight=2.0),
        RewardSpec("raises", f"{faulty}:raises"),
        RewardSpec("sleepy", f"{faulty}:sleepy"),
        RewardSpec("wrong_length", f"{faulty}:wrong_length"),
        RewardSpec("bad_values", f"{faulty}:bad_values", weight=0.5),
    ]
    completions = ["a", "boom", "slow", "nan", "str", "f"]
    t0 = time.perf_counter()
    with RewardRunner(specs, timeout_s=1.0, failure_value=-1.0, num_workers=2, chunk_size=2) as runner:
        total, per, stats = runner.score(["p"] * 6, completions, {"answer": list("123456")})
        # chunks: [a, boom] [slow, nan] [str, f]
        np.testing.assert_array_equal(per["ok"], [1, 1, 1, 1, 1, 1])
        np.testing.assert_array_equal(per["raises"], [-1, -1, 1, 1, 1, 1])  # the chunk holding "boom"
        np.testing.assert_array_equal(per["sleepy"], [1, 1, -1, -1, 1, 1])  # the chunk holding "slow"
        np.testing.assert_array_equal(per["wrong_length"], [-1] * 6)
        np.testing.assert_array_equal(per["bad_values"], [2, 2, 2, -1, -1, 2])  # NaN and "x" only
        assert all(v.dtype == np.float32 and v.shape == (6,) for v in per.values()) and total.dtype == np.float32
        # total = 2*ok + raises + sleepy + wrong_length + 0.5*bad_values:
        #   a:    2 - 1 + 1 - 1 + 0.5*2    = 2      boom: same = 2
        #   slow: 2 + 1 - 1 - 1 + 0.5*2    = 2
        #   nan:  2 + 1 - 1 - 1 + 0.5*(-1) = 0.5    str: 2 + 1 + 1 - 1 - 0.5 = 2.5
        #   f:    2 + 1 + 1 - 1 + 1        = 4
        np.testing.assert_allclose(total, [2.0, 2.0, 2.0, 0.5, 2.5, 4.0])
        assert stats["reward/raises/failures"] == 2 and stats["reward/raises/timeouts"] == 0
        assert stats["reward/sleepy/failures"] == 2 and stats["reward/sleepy/timeouts"] == 2
        assert stats["reward/wrong_length/failures"] == 6
        assert stats["reward/bad_values/failures"] == 2
        assert stats["reward/ok/failures"] == 0
        # per-reward means are unweighted and include failure values: (-1 - 1 + 1 + 1 + 1 + 1) / 6
        assert stats["reward/ok"] == 1.0 and stats["reward/raises"] == pytest.approx(2 / 6)
        assert stats["reward/total"] == pytest.approx(float(np.mean(total)))
        assert any("boom" in e for e in runner.last_errors["raises"])
        # the pool survives and is reused
        pool = runner._pool
        total2, _, _ = runner.score(["p"], ["a"], {"answer": ["1"]})
        # (with a single completion, wrong_length's [1.0] happens to have the right length)
        assert runner._pool is pool and total2[0] == pytest.approx(2 + 1 + 1 + 1 + 0.5 * 2)
    assert time.perf_counter() - t0 < 20


def test_hard_timeout_and_worker_crash_do_not_crash(faulty):
    specs = [RewardSpec("stubborn", f"{faulty}:stubborn"), RewardSpec("crashes", f"{faulty}:crashes")]
    completions = ["a", "slow", "die", "b"]
    with RewardRunner(specs, timeout_s=0.5, hard_timeout_grace_s=1.0, num_workers=2, chunk_size=1) as runner:
        total, per, stats = runner.score(["p"] * 4, completions, {})
        np.testing.assert_array_equal(per["stubborn"], [1, 0, 1, 1])
        np.testing.assert_array_equal(per["crashes"], [1, 1, 0, 1])
        assert stats["reward/stubborn/timeouts"] == 1 and stats["reward/crashes/failures"] == 1
        assert stats["reward/crashes/timeouts"] == 0
        np.testing.assert_allclose(total, [2, 1, 1, 2])
        # still usable afterwards (a fresh pool)
        assert runner.score(["p"], ["fine"], {})[0][0] == 2.0


def test_in_process_mode_handles_failures(faulty):
    specs = [RewardSpec("sleepy", f"{faulty}:sleepy"), RewardSpec("bad", f"{faulty}:bad_values"), RewardSpec("raises", f"{faulty}:raises")]
    with RewardRunner(specs, timeout_s=0.3, num_workers=0, chunk_size=1) as runner:
        _, per, stats = runner.score(["p"] * 3, ["slow", "nan", "boom"], {})
    np.testing.assert_array_equal(per["sleepy"], [0, 1, 1])
    np.testing.assert_array_equal(per["bad"], [2, 0, 2])
    np.testing.assert_array_equal(per["raises"], [1, 1, 0])
    assert stats["reward/sleepy/timeouts"] == 1


def test_kwargs_factories_and_field_filtering(faulty):
    specs = [
        RewardSpec("scaled", f"{faulty}:scaled", kwargs={"factor": 0.5}),  # takes no **fields
        RewardSpec("overlong", "overlong_penalty", kwargs={"max_length": 20, "cache_length": 5}),
        RewardSpec("fmt", "format", weight=0.0, kwargs={"pattern": r"^x+$"}),
    ]
    with RewardRunner(specs, num_workers=0) as runner:
        total, per, stats = runner.score(["p", "p"], ["xxxx", "yy"], {"completion_lengths": [16, 30], "answer": ["1", "2"]})
    np.testing.assert_allclose(per["scaled"], [2.0, 1.0])  # 0.5 * len
    np.testing.assert_allclose(per["overlong"], [-0.2, -1.0])  # (15-16)/5, beyond L_max
    np.testing.assert_array_equal(per["fmt"], [1.0, 0.0])
    np.testing.assert_allclose(total, [1.8, 0.0])  # fmt has weight 0
    with pytest.raises(ValueError, match="duplicate"):
        RewardRunner(["format", "format"])
    with pytest.raises(ValueError, match="not picklable|cannot be sent"):
        RewardRunner([RewardSpec("lam", lambda p, c: [0.0] * len(c))], num_workers=1)


def test_math_answer_in_process_pool():
    # symbolic cases need math-verify; run in worker processes they would raise if math-verify
    # used signal.alarm outside the main thread / were called with its timeouts on in threads
    completions = [r"\boxed{\frac{1}{\sqrt{2}}}", r"\boxed{x^2+2x+1}", "The answer is $1,234.00.", r"\boxed{3}"]
    answers = [r"\frac{\sqrt{2}}{2}", "(x+1)^2", "#### 1,234", "4"]
    with RewardRunner(["math_answer"], num_workers=2, chunk_size=1, timeout_s=30) as runner:
        total, per, stats = runner.score(["q"] * 4, completions, {"answer": answers})
    np.testing.assert_array_equal(per["math_answer"], [1.0, 1.0, 1.0, 0.0])
    assert stats["reward/math_answer/failures"] == 0
    assert stats["reward/math_answer"] == 0.75


def test_math_answer_symbolic_in_a_thread():
    # math-verify with its default (signal.alarm) timeouts raises outside the main thread;
    # math_answer must call it with timeouts disabled, so these still score 1.0 in a thread.
    completions = [r"\boxed{\frac{1}{\sqrt{2}}}", r"\boxed{x^2+2x+1}"]
    answers = [r"\frac{\sqrt{2}}{2}", "(x+1)^2"]
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(math_answer, ["q", "q"], completions, answers).result() == [1.0, 1.0]


def test_gsm8k_golds_through_pool(gsm8k):
    rows = [json.loads(line) for line in (gsm8k / "test.jsonl").read_text().splitlines() if line.strip()]
    golds = [r["answer"] for r in rows]
    finals = [g.rsplit("####", 1)[1].strip() for g in golds]
    completions = [f"\\boxed{{{n}}}" for n in finals] + [f"\\boxed{{{int(n.replace(',', '')) + 1}}}" for n in finals]
    with RewardRunner(["math_answer"], num_workers=2, chunk_size=64) as runner:
        _, per, stats = runner.score([""] * len(completions), completions, {"answer": golds * 2})
    assert per["math_answer"][: len(rows)].sum() == len(rows)
    assert per["math_answer"][len(rows):].sum() == 0
    assert stats["reward/math_answer/failures"] == 0


OWNER = textwrap.dedent(
    """
    import json, sys, threading, time
    import psutil
    from posttrain.rewards import RewardRunner, RewardSpec

    if __name__ == "__main__":
        runner = RewardRunner([RewardSpec("sleepy", sys.argv[1] + ":sleepy")], timeout_s=None, num_workers=1)
        threading.Thread(target=runner.score, args=(["p"], ["slow"], {}), daemon=True).start()
        time.sleep(3)  # the call is running (and sleeps 60 s) in the worker
        print(json.dumps([c.pid for c in psutil.Process().children(recursive=True)]), flush=True)
        time.sleep(600)
    """
)


def test_a_busy_worker_ends_when_its_owner_is_killed(faulty, tmp_path):
    """SIGKILL of the process that owns the pool while a reward call hangs: the worker (a child of the fork
    server, which nothing else tells) ends within seconds, not when the call would have returned."""
    import psutil

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    p = subprocess.Popen([sys.executable, str(script), faulty], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        pids = json.loads(p.stdout.readline())
        procs = [psutil.Process(pid) for pid in pids]
        assert len(procs) >= 2, pids  # the fork server and the worker (and a resource tracker)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        end = time.monotonic() + 10
        alive = procs
        while alive and time.monotonic() < end:
            alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        assert not alive, [(c.pid, c.cmdline()) for c in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
