"""Reliability (issue 12): failed saves end the run, no leaked processes, fallback to a restorable checkpoint,
per-record reward checks, one-line errors, one run per output folder, no duplicated rows after a resume."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from posttrain.cli.main import main
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.training.sft import load_sft_config, run_sft

ROOT = Path(__file__).resolve().parents[1]
SFT_SMOKE = ROOT / "configs" / "sft_smoke.yaml"
RL_SMOKE = ROOT / "configs" / "rl_smoke.yaml"
SFT_DATA = ROOT / "tests" / "data" / "sft_tiny.jsonl"
RL_DATA = ROOT / "tests" / "data" / "rl_prompts_tiny.jsonl"


@pytest.fixture(scope="module")
def tiny():
    from posttrain.models.tiny import resolve_model_path

    return resolve_model_path("tiny:llama")  # the cache the CLI runs below use too


def _sft(tiny, out, *overrides):
    return load_sft_config(SFT_SMOKE, [f"model.path={tiny}", f"data.train={SFT_DATA}", f"output_dir={out}",
                                       "trainer.progress=false", "trainer.eval_every=0", "export_hf=false",
                                       *overrides])


def _cli(*args, preexec_fn=None, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn, **kw)


# ---------------------------------------------------------------------- 1. a failed save ends the run
@pytest.mark.slow
def test_failed_checkpoint_save_exits_nonzero_quickly_in_one_line(tiny, tmp_path):
    """Checkpoint files cannot be written (a file size limit: what a full disk looks like to the writer; the
    tests run as root, for whom no folder is unwritable): the run stops with one error line, non-zero."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    t0 = time.monotonic()
    p = _cli("sft", str(SFT_SMOKE), f"model.path={tiny}", f"output_dir={tmp_path / 'run'}", "trainer.max_steps=6",
             "trainer.save_every=2", "trainer.eval_every=0", "trainer.progress=false", preexec_fn=limit_file_size)
    try:
        _, err = p.communicate(timeout=90)
    finally:
        p.kill()
    assert time.monotonic() - t0 < 90
    assert p.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "cannot write checkpoints to" in lines[0], err[-3000:]


# ---------------------------------------------------------------------- 2. no leaked processes
def _descendants(pid):
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_rl_run_leaves_no_process(tmp_path, sig):
    import psutil

    p = _cli("rl", str(RL_SMOKE), f"output_dir={tmp_path / 'run'}", "trainer.max_steps=50", "trainer.progress=false",
             "rewards.num_workers=1", start_new_session=True)
    tree: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and len(tree) < 3:  # resource tracker, fork server, reward worker
            assert p.poll() is None, p.communicate()[1][-3000:]
            tree.update({c.pid: c for c in _descendants(p.pid)})
            time.sleep(0.3)
        assert len(tree) >= 3, [c.cmdline() for c in tree.values()]
        time.sleep(1.0)
        tree.update({c.pid: c for c in _descendants(p.pid)})
        os.kill(p.pid, sig)  # the main process only, as a scheduler's preemption does
        p.wait(timeout=30)
        if sig == signal.SIGTERM:
            err = p.stderr.read()
            assert p.returncode == 143 and "Traceback" not in err, err[-3000:]
        end = time.monotonic() + 10
        alive = list(tree.values())
        while alive and time.monotonic() < end:
            alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        assert not alive, [(c.pid, c.cmdline()) for c in alive]
    finally:  # whatever the outcome, nothing of this test stays behind
        for c in list(tree.values()):
            try:
                c.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: the group holds the whole tree
        except ProcessLookupError:
            pass
        p.communicate()  # reaps it and closes the pipes


# ---------------------------------------------------------------------- 3. damaged latest checkpoint
def test_damaged_latest_checkpoint_resumes_from_previous_with_same_losses(tiny, tmp_path):
    common = ("trainer.max_steps=8", "trainer.save_every=2", "trainer.keep_checkpoints=3",
              "trainer.async_checkpointing=false")
    out = tmp_path / "run"
    first = run_sft(_sft(tiny, out, *common), stop_after=6)
    assert first.final_step == 6
    ckpts = out / "checkpoints"
    # Damage step 6 (a file cut in half), and leave an unfinished save behind as a killed run would.
    victim = max((f for f in (ckpts / "6").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    damaged = victim.read_bytes()
    (ckpts / "7.orbax-checkpoint-tmp").mkdir()
    said: list[str] = []
    second = run_sft(_sft(tiny, out, *common), log=said.append)
    assert second.start_step == 4
    assert any("skipped step 6" in s for s in said), said
    # moved aside as docs/howto/checkpoints.md says (the damaged files kept for a look), and step 6 saved again
    aside = ckpts / "6.unrestorable" / victim.relative_to(ckpts / "6")
    assert aside.read_bytes() == damaged and (ckpts / "6").is_dir()
    assert any("6.unrestorable" in s for s in said), said
    assert not list(ckpts.glob("*.orbax-checkpoint-tmp*"))
    # Steps 5 and 6 again from checkpoint 4: exactly the losses the first run had.
    np.testing.assert_array_equal([x for s, x in second.losses if s <= 6], [x for s, x in first.losses if s > 4])
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 8


# ---------------------------------------------------------------------- 5. reward fields and failing rewards
def test_record_missing_reward_field_is_named_before_any_model_loads(tmp_path):
    rows = [json.loads(x) for x in RL_DATA.read_text().splitlines()]
    rows[6].pop("answer")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_rl_config(RL_SMOKE, [f"output_dir={tmp_path / 'run'}", f"data.train={data}",
                                    f"model.path={tmp_path / 'no-model-here'}", "trainer.progress=false"])
    from posttrain.rewards.checks import RewardDataError

    with pytest.raises(RewardDataError, match=r"prompts\.jsonl, line 7: reward 'math_answer' needs field\(s\) 'answer'"):
        run_rl(cfg)


def _always_fails(prompts, completions, **fields):
    raise RuntimeError("broken reward")


def _fails_on_x(prompts, completions, **fields):
    if any("x" in c for c in completions):
        raise RuntimeError("no x")
    return [1.0] * len(completions)


def test_reward_failing_everywhere_for_n_calls_stops_the_run():
    from posttrain.rewards.checks import RewardFailedError
    from posttrain.rewards.runner import RewardRunner

    runner = RewardRunner([_fails_on_x], num_workers=0, max_failed_calls=3)
    runner.score(["p"] * 2, ["x", "x"])
    runner.score(["p"] * 2, ["x", "x"])
    runner.score(["p"] * 2, ["a", "b"])  # a call that works resets the count
    runner.score(["p"] * 2, ["x", "y"])
    runner.score(["p"] * 2, ["x", "x"])
    with pytest.raises(RewardFailedError, match=r"'_fails_on_x' failed on every completion in 3 scoring calls"):
        runner.score(["p"] * 2, ["x", "x"])
    never = RewardRunner([_always_fails], num_workers=0, max_failed_calls=0)
    for _ in range(5):
        never.score(["p"], ["c"])


# ---------------------------------------------------------------------- 6. one line, not a traceback
def test_known_errors_are_one_line_and_bugs_keep_their_traceback(tiny, tmp_path, capsys, monkeypatch):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert main(["info", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors" in err and "damaged" in err, err
    assert main(["sft", str(SFT_SMOKE), f"model.path={bad}", f"data.train={SFT_DATA}",
                 f"output_dir={tmp_path / 'o'}", "trainer.progress=false"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "damaged" in err and "Traceback" not in err, err

    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="nonesuch")))
    assert main(["sft", str(SFT_SMOKE), f"model.path={other}", f"data.train={SFT_DATA}",
                 f"output_dir={tmp_path / 'o2'}", "trainer.progress=false"]) == 1
    err = capsys.readouterr().err
    assert "model_type 'nonesuch' is not supported" in err and "Traceback" not in err, err

    from posttrain.cli import main as cli_main
    from posttrain.training.errors import TrainingDivergedError

    assert cli_main.describe(TrainingDivergedError.at(3, float("nan"))) .startswith("non-finite loss at step 3")
    assert cli_main.describe(OSError(28, "No space left on device", "/x/y")) == "No space left on device (/x/y)"
    assert cli_main.describe(ValueError("an internal bug")) is None  # not turned into one line

    monkeypatch.setenv("POSTTRAIN_DEBUG", "1")
    from posttrain.models.hf_io import CheckpointError

    with pytest.raises(CheckpointError):
        main(["info", str(bad)])


def test_sft_save_every_zero_saves_at_the_end_and_exports_readable_weights(tiny, tmp_path):
    res = run_sft(_sft(tiny, tmp_path / "run", "trainer.max_steps=2", "trainer.save_every=0", "export_hf=true"))
    assert res.final_step == 2 and sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    assert (res.hf_dir / "model.safetensors").stat().st_mode & 0o044 == 0o044  # item 10: not 0600


# ---------------------------------------------------------------------- 7. one run per output folder
def test_second_run_on_a_folder_gets_the_lock_error_and_a_stale_lock_does_not_block(tiny, tmp_path, capsys):
    from posttrain.training.runlock import RunLock, RunLockError

    out = tmp_path / "run"
    args = ["sft", str(SFT_SMOKE), f"model.path={tiny}", f"data.train={SFT_DATA}", f"output_dir={out}",
            "trainer.max_steps=2", "trainer.progress=false", "trainer.eval_every=0", "export_hf=false"]
    with RunLock(out):
        assert main(args) == 1
        err = capsys.readouterr().err
        assert f"output folder {out} is in use by another run (process {os.getpid()}" in err, err
        with pytest.raises(RunLockError):
            RunLock(out).acquire()
    assert not (out / "metrics.jsonl").exists()
    # A lock file left by a killed run (its flock died with it) does not block.
    (out / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone", "command": "posttrain sft"}) + "\n")
    with RunLock(out):
        assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()


@pytest.mark.slow
def test_two_processes_on_one_folder(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys,time; from posttrain.training.runlock import RunLock;"
                               f"l=RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = _cli("rl", str(RL_SMOKE), f"output_dir={out}", "trainer.max_steps=1")
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and f"in use by another run (process {holder.pid}" in err, err
        assert not (out / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------- 8. RL resume rows, concat statistics
@pytest.mark.slow
def test_rl_resume_writes_each_step_once_and_non_finite_loss_is_the_shared_error(tmp_path, monkeypatch):
    from posttrain.training.errors import TrainingDivergedError
    from posttrain.training.trainer import Trainer

    overrides = [f"output_dir={tmp_path / 'run'}", "trainer.max_steps=6", "trainer.save_every=2",
                 "trainer.progress=false", "eval.at_start=false", "rewards.num_workers=0", "data.eval=null",
                 "trainer.async_checkpointing=false", "rollout.batch_prompts=2", "rollout.group_size=2"]
    cfg = load_rl_config(RL_SMOKE, overrides)
    first = run_rl(cfg, stop_after=3)  # steps 1-3 logged, the last checkpoint at step 2: as a crash would leave it
    assert first.steps == 3

    real = Trainer.step

    def poisoned(self, batch, loss_fn=None, **kw):  # step 4 diverges
        out = real(self, batch, loss_fn, **kw)
        return dict(out, loss=float("nan")) if self.step_count >= 4 else out

    monkeypatch.setattr(Trainer, "step", poisoned)
    with pytest.raises(TrainingDivergedError, match=r"non-finite loss at step 4.*last good checkpoint \(step 2\)"):
        run_rl(cfg)  # resumes from step 2, runs step 3 again, then diverges
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["loss"] == first.history[2]["loss"]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples if s["kind"] == "train"] == [1, 2, 3]


def test_rollouts_concat_keeps_every_parts_reward_statistics():
    from posttrain.rollout.rollouts import Rollouts

    def part(n, failures, mean):
        return Rollouts(group_size=2, record_index=[0] * n, prompt_ids=[[1]] * n, completion_ids=[[2]] * n,
                        logprobs=[[0.0]] * n, finish_reasons=["stop"] * n, texts=["t"] * n, prompts_text=["p"] * n,
                        rewards=np.full(n, mean, np.float32), per_reward={"r": np.full(n, mean, np.float32)},
                        reward_stats={"reward/r": mean, "reward/r/failures": failures, "reward/r/timeouts": 1.0,
                                      "reward/total": mean})

    ro = Rollouts.concat([part(4, 3.0, 0.0), part(2, 2.0, 1.0), part(2, 0.0, 1.0)])
    assert ro.reward_stats["reward/r/failures"] == 5.0 and ro.reward_stats["reward/r/timeouts"] == 3.0
    assert ro.reward_stats["reward/total"] == pytest.approx(0.5)


# ---------------------------------------------------------------------- 9. plain install, progress bar
def test_plain_install_has_jinja2_and_rl_progress_shows_reward(tmp_path):
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.lower().startswith("jinja2==") for d in deps)
    from posttrain.training.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress=True, description="rl")
    try:
        logger.log(1, {"loss": 0.0, "reward/mean": 0.625, "accuracy": 0.5})
        info = logger.progress.tasks[0].fields["info"]
    finally:
        logger.close()
    assert info == "batch reward 0.625, batch reward accuracy 0.500"  # the rollouts', not held-out accuracy


# ---------------------------------------------------------------------- 10. smaller
def test_unreachable_hub_fails_at_once_for_a_data_name(monkeypatch):
    import datasets

    from posttrain.data import sources

    def no_call(*a, **k):
        raise AssertionError("load_dataset retries for ~30 s without a network; it must not be reached")

    monkeypatch.setattr(datasets, "load_dataset", no_call)
    monkeypatch.setattr(sources, "_hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(sources.DataError, match="'mydata': no such local file or folder.*cannot be reached"):
        sources.read_records("mydata")
