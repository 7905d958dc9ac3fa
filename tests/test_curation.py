"""Curation in the dispatcher: judged on the whole window of changing histories, and a run whose every record
is curated keeps leasing (counted, said once) instead of waiting forever; also through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_toy_task

from posttrain.rl.dispatcher import Dispatcher
from posttrain.rollout.rollouts import Rollouts

ROOT = Path(__file__).resolve().parents[1]


def group(uid: int, record: int, version: int) -> Rollouts:
    return Rollouts(group_size=1, record_index=[record], prompt_ids=[[1]], completion_ids=[[2]], logprobs=[[-0.5]],
                    finish_reasons=["stop"], texts=["a"], prompts_text=["p"], rewards=[0.0], per_reward={},
                    reward_stats={}, uid=[uid], version_first=[version], version_last=[version])


def train(d: Dispatcher, step: int, rates) -> int:
    """One trainer step of one group: lease, complete, take, commit with its record's pass rate
    (`rates[record]`, a number or a list consumed in order); returns the record."""
    lease = d.lease("w", 1)
    record = lease.records[0]
    d.complete(lease.id, [group(lease.uids[0], record, step - 1)])
    assert d.take(step, 1) is not None
    rate = rates[record].pop(0) if isinstance(rates[record], list) else rates[record]
    d.commit({lease.uids[0]: rate})
    return record


def test_always_and_never_solved_are_judged_on_the_whole_window():
    d = Dispatcher(3, shuffle=False, batch_groups=1, curation_window=3)
    rates = {0: [0.5, 1.0, 1.0, 1.0], 1: [0.25, 0.0, 0.0, 0.0], 2: 0.5}  # 2 is never curated
    assert [train(d, s, rates) for s in range(1, 10)] == [0, 1, 2] * 3
    assert d.pass_history[0] == [0.5, 1.0, 1.0] and d.pass_history[1] == [0.25, 0.0, 0.0]
    # a full window, each with one mixed entry (its oldest): neither always nor never solved
    assert [train(d, s, rates) for s in range(10, 13)] == [0, 1, 2]
    assert not any(k.startswith("dropped/") for k in d.counts)
    # the mixed entries have left the window of three: both are curated now
    assert d.pass_history[0] == [1.0] * 3 and d.pass_history[1] == [0.0] * 3
    assert d.lease("w", 1).records == [2]
    assert d.counts["dropped/curated_always_solved"] == 1 and d.counts["dropped/curated_never_solved"] == 1


def test_curation_follows_changing_histories_through_commits():
    d = Dispatcher(3, shuffle=False, batch_groups=1, curation_window=2)
    rates = {0: 1.0, 1: 0.0, 2: 0.5}
    seen = [train(d, s, rates) for s in range(1, 7)]  # each record trained twice: 0 and 1 now curated
    assert seen == [0, 1, 2, 0, 1, 2] and d.pass_history == {0: [1.0, 1.0], 1: [0.0, 0.0], 2: [0.5, 0.5]}
    rates[2] = 1.0  # record 2 becomes easy: one solved entry is not a window of them
    assert train(d, 7, rates) == 2 and d.pass_history[2] == [0.5, 1.0]
    assert d.counts["dropped/curated_always_solved"] == 1 and d.counts["dropped/curated_never_solved"] == 1
    assert train(d, 8, rates) == 2  # the whole window is now solved: record 2 curated after this step
    assert d.pass_history[2] == [1.0, 1.0] and d._curated(2) == "curated_always_solved"
    assert not d.counts["curation/exhausted_passes"]


@pytest.mark.timeout(300)  # a hang guard only (it was an endless loop): the test takes milliseconds
def test_every_record_curated_leases_again_counts_and_says_so_once():
    said = []
    d = Dispatcher(4, seed=5, batch_groups=2, curation_window=1, say=said.append)
    rates = {0: 0.0, 1: 1.0, 2: 0.0, 3: 0.0}  # never/always solved: all curated after one group each
    got = [train(d, s, rates) for s in range(1, 5)]
    assert sorted(got) == [0, 1, 2, 3] and not d.curation_exhausted
    lease = d.lease("w", 3)  # a whole pass finds every record curated: leased anyway, not waited for
    assert len(lease.uids) == 3 and d.curation_exhausted
    assert d.counts["curation/exhausted_passes"] == 1 and d.counts["curation/leased_curated"] == 3
    assert d.counts["dropped/curated_never_solved"] + d.counts["dropped/curated_always_solved"] == 4  # one pass
    assert len(said) == 1 and "\n" not in said[0] and "curation.window" in said[0]
    d.fail(lease.id, "worker_died")
    state = json.loads(json.dumps(d.state_dict()))
    r = Dispatcher(4, seed=5, batch_groups=2, curation_window=1, say=said.append)
    r.load_state_dict(state)
    assert r.curation_exhausted and r.lease("w", 4).uids == lease.uids + [r.next_uid - 1]
    # a record solved now and then is out of curation again: the others are skipped again
    rates = {0: 0.5, 1: 1.0, 2: 0.0, 3: 0.0}
    for s in range(5, 9):
        train(d, s, rates)  # the three re-queued uids, then one fresh: record 0 is among them (shuffle fixed)
    assert d._curated(0) is None and not d.curation_exhausted
    assert all(d.lease("w", 1).records == [0] for _ in range(3))
    assert len(said) == 1  # said once per run, whatever happens after


NEVER_SOLVED = '''
def zero(prompts, completions, **fields):
    return [0.0 for _ in completions]
'''


@pytest.mark.slow
def test_cli_run_whose_every_record_gets_curated_finishes(tmp_path, compile_cache):
    """Issue 26: with every record curated the run waited forever for one that is not. It finishes now, says
    so in one line, and counts it. The timeout only turns a hang into a failure: the run takes far less."""
    write_toy_task(tmp_path, NEVER_SOLVED)  # 16 prompts, none ever solved: all curated after 4 steps of 4
    out = tmp_path / "run"
    env = {**os.environ, **compile_cache, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "rl", f"output_dir={out}", "model.path=tiny:llama",
         f"data.train={tmp_path / 'prompts.jsonl'}", "rollout.batch_prompts=4", "rollout.group_size=2",
         "rollout.max_new_tokens=2", f"rewards.functions=[{{name: '{tmp_path / 'reward.py'}:zero'}}]",
         "rewards.correctness=null", "rewards.num_workers=0", "curation.window=1", "trainer.max_steps=6",
         "trainer.log_every=1", "trainer.save_every=0", "trainer.progress=false", "eval.at_start=false",
         "export_hf=false"], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [x for x in proc.stderr.splitlines() if x.startswith("curation:")]
    assert len(notes) == 1 and "all 16 training records are curated" in notes[0], proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    assert last["step"] == 6 and last["curation/exhausted_passes"] >= 1 and last["curation/leased_curated"] >= 8
    assert last["fleet/dropped/curated_never_solved"] >= 16


def test_pass_rates_are_each_groups_fraction_of_correct_samples():
    """What curation is fed: per uid, the fraction of its G samples that the correctness reward calls right
    (>= 1), or with no such reward, that score above 0."""
    from types import SimpleNamespace

    from posttrain.config import load_config
    from posttrain.rl.config import RLConfig
    from posttrain.rl.loop import group_intake
    from posttrain.rl.metrics import pass_rates

    acc = np.array([1.0, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], np.float32)
    total = np.array([0.2, 0.0, 0.0, 0.0, 0.3, 0.1, 0.0, -1.0], np.float32)
    ro = Rollouts(group_size=4, record_index=[3] * 4 + [1] * 4, prompt_ids=[[1]] * 8, completion_ids=[[2]] * 8,
                  logprobs=[[-0.5]] * 8, finish_reasons=["stop"] * 8, texts=["a"] * 8, prompts_text=["p"] * 8,
                  rewards=total, per_reward={"acc": acc}, reward_stats={}, uid=[7] * 4 + [9] * 4,
                  version_first=[0] * 8, version_last=[0] * 8)
    for correctness, expected in (("acc", {7: 0.75, 9: 0.25}), (None, {7: 0.25, 9: 0.5})):
        assert pass_rates(ro, correctness) == expected
        cfg = load_config(RLConfig, None, [f"rewards.correctness={correctness or 'null'}"])
        intake = group_intake(SimpleNamespace(cfg=cfg, preset=cfg.algorithm, dispatcher=None))
        assert intake.pass_rates(ro) == expected  # what the sources feed the dispatcher
