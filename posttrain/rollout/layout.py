"""The teacher-forced layout of (prompt, completion) pairs: the one array layout that scores completions, shared by
the RL batch (`posttrain.rl.batch.build_rl_batch`) and `Policy.score`, so both compute the same numbers.

Prompts are left-padded into the first P columns and completions right-padded into the last C columns, so every
completion starts at column P; P and C are rounded up to multiples of `multiple` (a few static shapes, each
compiled once). Entry j of a per-token array [N, C] is about completion token j, predicted from column P-1+j;
`positions` count the real tokens of a row from 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["TeacherForced", "bucket_length", "stack_images", "teacher_forced"]


def bucket_length(n: int, multiple: int = 16) -> int:
    """n rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class TeacherForced:
    """The model inputs of N (prompt, completion) pairs: `input_ids`, `attention_mask`, `positions` [N, P+C]
    (module docstring), and C, the completion columns."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    completion_len: int


def teacher_forced(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *, pad_id: int = 0,
                   multiple: int = 16, at_least: tuple[int, int] = (0, 0), rows: int | None = None) -> TeacherForced:
    """The layout of the module docstring for these pairs; `at_least`: lower bounds of (P, C); `rows`: the row count
    (at least the pairs'; the rows after them are all padding)."""
    n = len(prompt_ids)
    p = max(bucket_length(max((len(x) for x in prompt_ids), default=1), multiple), at_least[0])
    c = max(bucket_length(max((len(x) for x in completion_ids), default=1), multiple), at_least[1])
    input_ids = np.full((max(n, rows or 0), p + c), pad_id, np.int32)
    attention_mask = np.zeros_like(input_ids)
    for i, (prompt, comp) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, p - len(prompt): p] = prompt
        input_ids[i, p: p + len(comp)] = comp
        attention_mask[i, p - len(prompt): p + len(comp)] = 1
    positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)
    return TeacherForced(input_ids, attention_mask, positions, c)


def stack_images(rows) -> np.ndarray:
    """Rows of pixel arrays [3, H, W] (row r's images in prompt order) -> float32 [N, M, 3, H, W], M the most
    images of a row (at least 1), blank images after each row's own."""
    shape = next((np.shape(x) for r in rows for x in r), None)
    if shape is None:
        raise ValueError("an image batch without any image")
    m = max(1, max(len(r) for r in rows))
    out = np.zeros((len(rows), m, *shape), np.float32)
    for i, r in enumerate(rows):
        for k, x in enumerate(r):
            out[i, k] = x
    return out
