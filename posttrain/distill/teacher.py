"""The teacher of a distillation run: its checkpoint, loaded frozen, and the check that it shares the student's
vocabulary (same token ids for the same strings, same output size), so per-token distributions compare."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.config import ConfigError
from posttrain.distill.config import TeacherSection
from posttrain.models import tokenizer as tok_lib
from posttrain.models.spec import resolve_checkpoint
from posttrain.training.config import ModelSection
from posttrain.training.run import frozen_copy

__all__ = ["teacher_folder", "check_same_vocabulary", "load_teacher"]


def teacher_folder(teacher: TeacherSection) -> Path:
    if not teacher.path:
        raise ConfigError("teacher.path: no teacher given (set teacher.path=DIR: a checkpoint with the student's "
                          "tokenizer)")
    return resolve_checkpoint(teacher.path)


def check_same_vocabulary(student_tok, teacher_tok, *, student: str, teacher: str,
                          student_vocab: int | None = None, teacher_vocab: int | None = None) -> None:
    """A ConfigError naming both checkpoints unless their tokenizers map the same strings to the same ids and
    (when given) their output layers have the same size."""
    problem = None
    sv, tv = student_tok.hf.get_vocab(), teacher_tok.hf.get_vocab()
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()), key=lambda x: x[1])[:3]
        problem = (f"their tokenizers differ ({len(sv)} vs {len(tv)} tokens; e.g. "
                   + ", ".join(f"{t!r}->{i}" for t, i in diff) + ")")
    elif student_vocab is not None and teacher_vocab is not None and student_vocab != teacher_vocab:
        problem = f"their output vocabulary sizes differ (student {student_vocab}, teacher {teacher_vocab})"
    if problem:
        raise ConfigError(f"teacher {teacher} and student {student} have different vocabularies: {problem}; "
                          "distillation needs a teacher with the student's tokenizer")


def load_teacher(teacher: TeacherSection, student: ModelSection, student_tok, student_vocab: int, mesh=None):
    """The frozen teacher model (no LoRA, no optimizer state; the run skeleton's `frozen_copy` with the
    teacher's checkpoint and dtypes, the student's other numerics), after the vocabulary checks (the
    tokenizers before any weight is read)."""
    t = teacher
    names = dict(student=student.path, teacher=t.path)
    check_same_vocabulary(student_tok, tok_lib.load(teacher_folder(t)), **names)
    numerics = dataclasses.replace(student, path=t.path, param_dtype=t.param_dtype,
                                   compute_dtype=t.compute_dtype or t.param_dtype)
    model = frozen_copy(numerics, mesh)[0]
    check_same_vocabulary(student_tok, student_tok, student_vocab=student_vocab, teacher_vocab=model.cfg.vocab_size,
                          **names)
    return model
