"""Logit distillation end to end: a small student distilled from a larger teacher (both tiny, same tokenizer)
lowers the held-out student-teacher KL and agrees with the teacher's greedy output more often; the top-k
teacher store; resume is exact; bad data names its file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """The 64 additions of tests/data/sft_tiny.jsonl: 48 to train on, 16 held out."""
    rows = (REPO / "tests/data/sft_tiny.jsonl").read_text().splitlines()
    folder = tmp_path_factory.mktemp("distill-data")
    (folder / "train.jsonl").write_text("\n".join(rows[:48]) + "\n")
    (folder / "heldout.jsonl").write_text("\n".join(rows[48:]) + "\n")
    return folder


def _cfg(out, splits, *overrides):
    from posttrain.distill.run import load_distill_config

    return load_distill_config(REPO / "configs/distill_smoke.yaml", [
        f"output_dir={out}", f"data.train={splits / 'train.jsonl'}", f"data.eval={splits / 'heldout.jsonl'}",
        "trainer.progress=false", "trainer.eval_batches=4", *overrides])


def greedy_agreement(student_dir, teacher_dir, prompts, max_new_tokens=8) -> float:
    """The fraction of the teacher's greedy tokens (max_new_tokens after each held-out prompt) that the student,
    fed the same prefix, also ranks first."""
    from posttrain.models import tokenizer as tok_lib
    from posttrain.models.hf_io import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    tok = tok_lib.load(teacher_dir)
    ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    greedy = [c.token_ids for c in Sampler(from_pretrained(teacher_dir), tok, max_slots=len(ids)).generate(ids, params)]
    student = from_pretrained(student_dir)
    hits = []
    for p, y in zip(ids, greedy):
        logits = np.asarray(student(np.asarray([p + y], np.int32)))[0]
        hits += [int(np.argmax(logits[len(p) - 1 + j]) == t) for j, t in enumerate(y)]
    return float(np.mean(hits))


@pytest.mark.slow
def test_logit_distillation_moves_the_student_to_the_teacher(splits, tmp_path):
    """tiny:llama (64 wide, 2 layers) from tiny:llama-small (128 wide, 4 layers), forward KL, 60 steps: the
    held-out KL falls and both the teacher-forced top-1 agreement and the greedy agreement on held-out
    prompts rise."""
    from posttrain.distill.run import run_distill
    from posttrain.models.tiny import resolve_model_path

    from posttrain.distill.logit import run_logit

    res = run_logit(_cfg(tmp_path / "fkl", splits, "trainer.eval_every=30"))
    before, after = res.evals[0], res.evals[-1]
    assert before["step"] == 0 and after["step"] == 60
    assert after["eval/divergence"] < 0.5 * before["eval/divergence"], res.evals
    assert after["eval/top1_agreement"] > before["eval/top1_agreement"] + 0.2, res.evals
    heldout = [json.loads(x)["messages"][:1] for x in (splits / "heldout.jsonl").read_text().splitlines()]
    teacher = resolve_model_path("tiny:llama-small")
    g0 = greedy_agreement(resolve_model_path("tiny:llama"), teacher, heldout)
    g1 = greedy_agreement(res.hf_dir, teacher, heldout)
    print(f"held-out forward KL {before['eval/divergence']:.4f} -> {after['eval/divergence']:.4f}; top-1 agreement "
          f"{before['eval/top1_agreement']:.3f} -> {after['eval/top1_agreement']:.3f}; "
          f"greedy agreement {g0:.3f} -> {g1:.3f}")
    assert g1 > g0 + 0.05
    assert run_distill  # the command's entry point is this run


@pytest.mark.slow
def test_topk_teacher_is_stored_and_resume_is_exact(splits, tmp_path):
    """teacher.top_k=16: the top-k of the run's batches is stored once; the run stopped after step 4 and
    resumed (the store reused) has the uninterrupted run's losses; full-logit distillation resumes exactly
    too (its teacher is reloaded, not checkpointed)."""
    from posttrain.distill.logit import run_logit

    for extra in (["teacher.top_k=16"], []):
        common = ["trainer.max_steps=8", "trainer.save_every=4", "trainer.log_every=1", "trainer.eval_every=0",
                  "export_hf=false", "data.eval=null", "loss.kind=jsd", "loss.temperature=2.0", "loss.alpha=0.5",
                  *extra]
        full = run_logit(_cfg(tmp_path / f"full{len(extra)}", splits, *common))
        part = run_logit(_cfg(tmp_path / f"part{len(extra)}", splits, *common), stop_after=4)
        assert part.final_step == 4
        resumed = run_logit(_cfg(tmp_path / f"part{len(extra)}", splits, *common))
        assert resumed.start_step == 4
        np.testing.assert_allclose([x for _, x in resumed.losses], [x for s, x in full.losses if s > 4], atol=1e-6)
        assert full.losses[-1][1] < full.losses[0][1]
    store = tmp_path / "part1" / "teacher_topk"
    assert json.loads((store / "meta.json").read_text())["k"] == 16
    assert np.load(store / "ids.npy").shape[0] == 8 and np.load(store / "logp.npy").shape[-1] == 16


def test_bad_sft_data_names_file_and_line(splits, tmp_path, capsys):
    from posttrain.cli.main import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text((splits / "train.jsonl").read_text().splitlines()[0] + "\n" + json.dumps({"messages": "hi"}) + "\n")
    code = main(["--no-compile-cache", "distill", "configs/distill_smoke.yaml", f"data.train={bad}",
                 f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 1 and "bad.jsonl" in err and "line 2" in err and "messages" in err, err
