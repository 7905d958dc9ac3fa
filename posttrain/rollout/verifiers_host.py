"""A verifiers environment inside a worker process: what `rollout.environment=verifiers:NAME_OR_FILE` runs there.

`VerifiersHost` is the object an `ObjectHost` (`posttrain.tools.hosting`) keeps in its worker, so the
environment's own code (its `load_environment`, dataset mapping, `env_response`, tools and rubric) never runs in
the trainer's process: a hang, a crash or `os._exit` in it is killed or noticed at the call's time limit like any
environment's. Its methods take and return plain data:

- `load(ref, args)`: `load_environment(**args)` of the module or file `ref` names; the environment's class, kind
  and the sizes of its train and eval splits.
- `rows(split, indices)`: those rows of a split (prompt messages, answer, info, task, example id) as JSON.
- `rollouts(split, indices, n, base_url, model, sampling)`: `n` rollouts of each row through the environment
  (`run_group`: its rollout loop, then its rubric scores the group), the environment's OpenAI client pointed at
  `base_url` (our in-process endpoint, which answers with the sampled token ids and log-probs); each one as its
  turns' token ids (`prompt_ids`, `completion_ids`, `logprobs`), its messages, the rubric's reward and metrics, and
  its error (a group whose code raised: every rollout of it carries the one-line error, naming the class and the
  row).

Releases: the classic environments of verifiers 0.1.9 (`SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, their rubrics:
the line tinker-cookbook pins); the 0.3 releases keep them under `verifiers.legacy`, which is used when present;
0.4 is a rewrite this host does not speak.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["VerifiersHost", "environment_kind", "load_verifiers_environment"]


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _verifiers():
    """The verifiers package (0.3's classic classes live under `verifiers.legacy`)."""
    try:
        import verifiers as vf
    except ImportError:
        raise RuntimeError("verifiers environments need the verifiers package: pip install 'posttrain[verifiers]' "
                           "(verifiers 0.1.9)") from None
    try:  # the environment's dataset mapping and the library's start-up messages are not the run's output
        import datasets

        datasets.disable_progress_bar()
    except ImportError:
        pass
    logging.getLogger("verifiers").setLevel(logging.WARNING)
    return getattr(vf, "legacy", vf)


def _module(ref: str):
    """The module `ref` names: a `.py` file (its folder importable too, for its siblings) or an installed module
    (a Hub environment's package: `-` read as `_`, an `owner/` prefix dropped, as verifiers does)."""
    if ref.endswith(".py") or "/" in ref and Path(ref).exists():
        path = Path(ref).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {ref!r}")
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"posttrain_verifiers_env_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(ref.replace("-", "_").split("/")[-1])


def load_verifiers_environment(ref: str, args: dict | None = None):
    """`load_environment(**args)` of the module or file `ref`, checked to be a verifiers `Environment` (the process's
    SIGINT and SIGTERM handlers, which a verifiers environment replaces, are put back)."""
    vf = _verifiers()
    module = _module(ref)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise AttributeError(f"{ref!r} has no load_environment(**kwargs) function")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = load(**dict(args or {}))
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    if not isinstance(env, vf.Environment):
        raise TypeError(f"load_environment returned {type(env).__name__}, not a verifiers Environment")
    return env


def environment_kind(env) -> str:
    """`single_turn`, `tool`, `multi_turn` (what rollouts of it look like), from its verifiers class."""
    vf = _verifiers()
    if isinstance(env, vf.SingleTurnEnv):
        return "single_turn"
    if isinstance(env, vf.ToolEnv):
        return "tool"
    return "multi_turn"


def _jsonable(value: Any) -> Any:
    """`value` as JSON can carry it (anything else as its text)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        if hasattr(value, "model_dump"):
            return _jsonable(value.model_dump())
        return str(value)


def _turns(state) -> list[dict] | None:
    """A rollout's turns as the server gave their ids (None when a turn came without them)."""
    out = []
    for step in state.get("trajectory", []):
        tokens = step.get("tokens")
        if tokens is None:
            return None
        out.append({"prompt_ids": list(tokens["prompt_ids"]), "completion_ids": list(tokens["completion_ids"]),
                    "logprobs": [float(x) for x in tokens["completion_logprobs"]]})
    return out


def _result(state) -> dict:
    """One finished rollout as plain data."""
    error = state.get("error")
    prompt, completion = state.get("prompt") or [], state.get("completion") or []
    return {"turns": _turns(state), "reward": float(state.get("reward") or 0.0),
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
            "messages": _jsonable(list(prompt) + list(completion)) if isinstance(prompt, list) else
            _jsonable([prompt, completion]),
            "stop": state.get("stop_condition"), "truncated": bool(state.get("is_truncated")),
            "error": None if error is None else _one_line(f"{type(error).__name__}: {error}")}


class VerifiersHost:
    """A verifiers environment held in a worker process (module docstring)."""

    def __init__(self):
        self.env = None
        self.name = ""

    def load(self, ref: str, args: dict | None = None) -> dict:
        self.env = load_verifiers_environment(ref, args)
        self.name = type(self.env).__name__
        return {"class": self.name, "kind": environment_kind(self.env),
                "train": len(self.env.dataset) if self.env.dataset is not None else 0,
                "eval": len(self.env.eval_dataset) if self.env.eval_dataset is not None else 0}

    def _split(self, split: str):
        data = self.env.eval_dataset if split == "eval" and self.env.eval_dataset is not None else self.env.dataset
        if data is None:
            raise ValueError(f"{self.name} has no {split} dataset")
        return data

    def rows(self, split: str, indices: list[int]) -> list[dict]:
        data = self._split(split)
        return [_jsonable(data[int(i)]) for i in indices]

    def rollouts(self, split: str, indices: list[int], n: int, base_url: str, model: str, sampling: dict) -> list[dict]:
        """`n` scored rollouts of each row, in row order (a row's `n` in a row)."""
        from openai import AsyncOpenAI

        data = self._split(split)
        rows = [data[int(i)] for i in indices]
        return asyncio.run(self._groups(rows, n, AsyncOpenAI(base_url=base_url, api_key="posttrain"), model,
                                        sampling))

    async def _groups(self, rows: list[dict], n: int, client, model: str, sampling: dict) -> list[dict]:
        from verifiers.utils.async_utils import maybe_semaphore

        gen_sem, score_sem = await maybe_semaphore(-1), await maybe_semaphore(-1)

        async def group(k: int, row: dict) -> list[dict]:
            try:
                states = await self.env.run_group([dict(row) for _ in range(n)], client, model, dict(sampling),
                                                  gen_sem, score_sem)
                return [_result(s) for s in states]
            except Exception as e:  # noqa: BLE001 - the environment's code failed this group: its rollouts say so
                where = f"{self.name} on row {row.get('example_id', k)}"
                return [{"turns": None, "reward": 0.0, "metrics": {}, "messages": [], "stop": None,
                         "truncated": False, "error": _one_line(f"{where}: {type(e).__name__}: {e}")}] * n

        try:
            groups = await asyncio.gather(*(group(k, row) for k, row in enumerate(rows)))
        finally:
            await client.close()
        return [r for g in groups for r in g]
