"""reasoning-gym tasks as prompt sets: `reasoning_gym:TASK?size=N&seed=S[&option=value...]`.

reasoning-gym generates verifiable problems offline (arithmetic, countdown, GSM-style word problems...),
each with its own answer checker. A source string names the task, the number of problems, the seed and
any of the task's config options; held-out sets are the same task with another seed. Each record is
`{"prompt": question, "answer": gold, "rg_source": the source string, "rg_index": i}`: the last two let
the `reasoning_gym` reward rebuild the exact entry and score with the task's own `score_answer`.
"""

from __future__ import annotations

import functools
from urllib.parse import parse_qsl

from posttrain.data.errors import DataError

PREFIX = "reasoning_gym:"


def is_reasoning_gym_source(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_source(spec: str) -> tuple[str, dict]:
    """(task, create_dataset keyword arguments) of a `reasoning_gym:TASK?size=N&seed=S&...` string."""
    task, _, query = spec.removeprefix(PREFIX).partition("?")
    if not task:
        raise DataError(f"{spec!r}: no task named; expected reasoning_gym:TASK?size=N&seed=S")
    kwargs = {k: _value(v) for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))}
    kwargs.setdefault("size", 500)
    kwargs.setdefault("seed", 0)
    return task, kwargs


@functools.lru_cache(maxsize=32)
def dataset(spec: str):
    """The reasoning-gym dataset of a source string (cached: entries are generated lazily by index)."""
    import reasoning_gym

    task, kwargs = parse_source(spec)
    try:
        return reasoning_gym.create_dataset(task, **kwargs)
    except Exception as e:  # unknown task, bad option: the library raises ValueError/TypeError/KeyError
        raise DataError(f"{spec!r}: reasoning-gym cannot create task {task!r} with {kwargs}: "
                        f"{type(e).__name__}: {e}") from None


def records(spec: str) -> list[dict]:
    ds = dataset(spec)
    out = []
    for i in range(len(ds)):
        entry = ds[i]
        out.append({"prompt": entry["question"], "answer": str(entry["answer"]), "rg_source": spec, "rg_index": i})
    return out
