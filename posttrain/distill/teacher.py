"""The teacher of a distillation run: its checkpoint, loaded frozen, and the check that it shares the student's
vocabulary (same token ids for the same strings, same output size), so per-token distributions compare."""

from __future__ import annotations

from pathlib import Path

__all__ = ["teacher_folder", "check_same_vocabulary", "load_teacher"]


def teacher_folder(cfg) -> Path:
    from posttrain.config import ConfigError
    from posttrain.models.hf_io import resolve_path
    from posttrain.models.tiny import resolve_model_path

    if not cfg.teacher.path:
        raise ConfigError("teacher.path: no teacher given (set teacher.path=DIR: a checkpoint with the student's "
                          "tokenizer)")
    return resolve_path(resolve_model_path(cfg.teacher.path))


def check_same_vocabulary(student_tok, teacher_tok, *, student: str, teacher: str,
                          student_vocab: int | None = None, teacher_vocab: int | None = None) -> None:
    """A ConfigError naming both checkpoints unless their tokenizers map the same strings to the same ids and
    (when given) their output layers have the same size."""
    from posttrain.config import ConfigError

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


def load_teacher(cfg, student_tok, student_vocab: int, mesh=None):
    """The frozen teacher model (no LoRA, no optimizer state), after the vocabulary checks (the tokenizers
    before any weight is read)."""
    from posttrain import tokenizer as tok_lib
    from posttrain.models.hf_io import from_pretrained

    folder = teacher_folder(cfg)
    t_tok = tok_lib.load(folder)
    names = dict(student=cfg.model.path, teacher=cfg.teacher.path)
    check_same_vocabulary(student_tok, t_tok, **names)
    t = cfg.teacher
    model = from_pretrained(folder, dtype=t.param_dtype, compute_dtype=t.compute_dtype or t.param_dtype, mesh=mesh,
                            scan_layers=cfg.model.scan_layers, kernels=cfg.model.kernels)
    check_same_vocabulary(student_tok, t_tok, student_vocab=student_vocab, teacher_vocab=model.cfg.vocab_size, **names)
    return model
