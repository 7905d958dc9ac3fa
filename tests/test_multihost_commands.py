"""Every command on several hosts: `posttrain dpo`, `distill` (logit and on-policy), `eval` and `generate` as 2
processes x 4 CPU devices give the losses and outputs of 1 process x 8 devices.

To keep the suite's time small, each "host" is one process that runs the five commands in turn through the CLI
(`posttrain.cli.main._main`, as `posttrain COMMAND ...` runs them), joining the run once: the command's own
`distributed.finish` (wait for every process, leave) becomes a barrier until the last command. The 1-process
run and the 2 processes of the multi-host run start together.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from multihost_helpers import ROOT, Procs, env, hosts, procs, rows  # noqa: F401  (procs: a fixture)

DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from posttrain import distributed
    from posttrain.cli import main as cli

    leave = distributed.finish
    distributed.finish = lambda: distributed.barrier("posttrain-command-done")  # one join for every command
    for argv in json.loads(sys.argv[1]):
        t0 = time.monotonic()
        code = cli._main(argv)
        print(f"COMMAND {argv[0]} -> {code} in {time.monotonic() - t0:.1f}s", flush=True)
        if code:
            sys.exit(code)
    leave()
    """
)

STEPS = ["trainer.log_every=1", "trainer.save_every=0", "trainer.progress=false", "trainer.async_checkpointing=false",
         "export_hf=false"]


def commands(out: Path, student: str, teacher: str, data: Path) -> list[list[str]]:
    """The five command lines, reading the small files of `data`, writing under `out`."""
    dpo = ["dpo", "configs/dpo_smoke.yaml", f"model.path={student}", f"output_dir={out / 'dpo'}", *STEPS,
           f"data.train={data / 'pairs.jsonl'}", f"data.eval={data / 'pairs_eval.jsonl'}", "eval_at_start=false",
           "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=1", "algorithm.precompute_reference=true"]
    distill = ["distill", "configs/distill_smoke.yaml", f"model.path={student}", f"teacher.path={teacher}", *STEPS,
               "trainer.eval_batches=1"]
    logit = [*distill, f"output_dir={out / 'logit'}", "trainer.max_steps=3", "trainer.eval_every=3"]
    top_k = [*distill, f"output_dir={out / 'top_k'}", "trainer.max_steps=2", "data.eval=null", "teacher.top_k=8"]
    on_policy = [*distill, f"output_dir={out / 'on_policy'}", "mode=on_policy", "trainer.max_steps=2",
                 "trainer.eval_every=0", "on_policy.rollout.batch_prompts=4", "on_policy.rollout.group_size=4",
                 "on_policy.rollout.max_new_tokens=8"]  # 16 slots: the sampling programs eval and generate use
    evaluate = ["eval", "--model", student, "--data", "tests/data/rl_prompts_tiny.jsonl", "--limit", "4", "--n", "4",
                "--max-new-tokens", "8", "--temperature", "1.0", "--reward-workers", "0", "--no-progress",
                "--output", str(out / "eval.jsonl")]
    # eval's problems and shapes (4 prompts x 4 samples): generate runs the sampling programs eval compiled
    generate = ["generate", "--model", student, "--prompts", str(data / "prompts.jsonl"), "--n", "4", "--max-new-tokens",
                "8", "--no-progress", "--output", str(out / "generate.jsonl")]
    return [dpo, logit, top_k, on_policy, evaluate, generate]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The five commands run once as 1 process x 8 devices and once as 2 processes x 4: (one, two) folders."""
    from posttrain.models.tiny import resolve_model_path

    tmp = tmp_path_factory.mktemp("mhcmds")
    cache = tmp / "tiny"  # built here, once: concurrent processes do not race to build them
    student, teacher = (resolve_model_path(f"tiny:{name}", cache_dir=cache) for name in ("llama", "llama-small"))
    problems = [json.loads(x) for x in (ROOT / "tests" / "data" / "rl_prompts_tiny.jsonl").read_text().splitlines()]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"messages": r["prompt"]}) + "\n" for r in problems[:4]))
    pairs = (ROOT / "tests" / "data" / "dpo_tiny.jsonl").read_text().splitlines(keepends=True)
    (tmp / "pairs.jsonl").write_text("".join(pairs[:24]))  # 3 steps of 8 pairs: the reference scores little
    (tmp / "pairs_eval.jsonl").write_text("".join(pairs[24:32]))
    ps = Procs()
    try:
        def args(folder):
            return [sys.executable, "-c", DRIVER, json.dumps(commands(folder, student, teacher, tmp))]

        one = ps.start(args(tmp / "one"), env(8), tmp / "one.log")
        two = hosts(ps, args(tmp / "two"), 2, 4, tmp, "two")
        assert ps.wait([one, *two], 600) == [0, 0, 0], ps.logs()
    finally:
        ps.kill()
    return tmp / "one", tmp / "two"


def _close(a: dict, b: dict, what: str, tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b) and a, (what, a, b)
    assert max(abs(a[k] - b[k]) for k in a) < tol, (what, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("command,keys,steps", [
    ("dpo", ("loss", "rewards/margins", "eval/loss"), [1, 2, 3]),
    ("logit", ("loss", "eval/divergence"), [1, 2, 3]),
    ("top_k", ("loss", "grad_norm"), [1, 2]),
    ("on_policy", ("loss", "distill/reverse_kl", "completion/length_mean"), [1, 2]),
])
def test_training_commands_two_hosts_match_one_host(runs, command, keys, steps):
    """dpo (reference log-probs precomputed on the global mesh), logit distillation (the teacher in the step, or
    its top-k stored by process 0) and on-policy distillation: the per-step
    losses and metrics of 2 processes x 4 devices equal those of 1 process x 8; process 0 writes the logs."""
    one, two = (r / command for r in runs)
    assert sorted(rows(one, "loss")) == steps
    for key in keys:
        _close(rows(one, key), rows(two, key), f"{command} {key}")
    assert len((two / "metrics.jsonl").read_text().splitlines()) == len((one / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_eval_two_hosts_match_one_host(runs):
    """Greedy and sampled metrics and every per-problem row (texts, answers, rewards) are the same."""
    one, two = runs
    s1, s2 = (json.loads((r / "eval.summary.json").read_text()) for r in runs)
    _close({k: v for k, v in s1.items() if k.startswith("eval/")}, {k: v for k, v in s2.items() if k.startswith("eval/")},
           "eval summary")
    r1, r2 = ([json.loads(x) for x in open(r / "eval.jsonl")] for r in runs)
    assert len(r1) == 4 and r1 == r2
    assert all(len(r["samples"]) == 4 for r in r1)


@pytest.mark.slow
def test_generate_two_hosts_match_one_host(runs):
    """The same completions (token ids and texts; log-probs to float precision), written once."""
    runs = list(runs)
    c1, c2 = ([json.loads(x) for x in open(r / "generate.jsonl")] for r in runs)
    assert len(c1) == 16 and [(c["prompt_index"], c["sample_index"], c["token_ids"], c["text"]) for c in c1] == \
        [(c["prompt_index"], c["sample_index"], c["token_ids"], c["text"]) for c in c2]
    for a, b in zip(c1, c2):
        assert max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0) < 1e-4
    logs = [(runs[1].parent / f"two-{i}.log").read_text() for i in range(2)]
    assert "wrote 16 completions to" in logs[0] and "completions to" not in logs[1]  # process 0 reports and writes
