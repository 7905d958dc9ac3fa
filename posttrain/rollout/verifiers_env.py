"""A verifiers environment as a rollout source's environment: `rollout.environment=verifiers:NAME_OR_FILE`.

`VerifiersEnvironment.open(ref, args)` loads the environment (`load_environment(**args)` of an installed module or a
`.py` file) in a worker process of its own (`posttrain.rollout.verifiers_host.VerifiersHost` in an `ObjectHost`:
its code, its tools and its rubric never run in the caller's process, and a call that hangs or crashes fails at its
time limit). `records(split)` are its dataset's rows as prompt records (the prompt messages, the answer, the info).
`rollouts(...)` runs G rollouts of each leased row through the environment, its OpenAI client pointed at an
OpenAI-compatible endpoint that samples with the policy (the caller's in-process `posttrain serve`, which answers
with the prompt's and the sampled token ids and the log-probs), and turns them into `Rollouts`:

- each trajectory's turns are stitched into exactly the ids the server sampled (`posttrain.rollout.stitching`:
  appended ids mask 0; a turn whose prompt re-tokenized what was sampled before it is refused with the turns after
  it, counted in `verifiers/refused_turns` and said in the trajectory's summary, not trained on);
- the reward is the rubric's (`rubric`), and each of the rubric's metrics is a reward column (`rubric/NAME`);
- a group whose environment code raised, or a rollout without token ids, is an environment error of the trajectory
  (`env_errors`, one line naming the class and the row), trained on with nothing (mask 0).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence

import numpy as np

from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.rollouts import Rollouts
from posttrain.rollout.stitching import Stitched, TurnTokens, stitch
from posttrain.sampling import SamplingParams
from posttrain.tools.execution import ToolPool

__all__ = ["PREFIX", "VerifiersEnvironment", "is_verifiers", "sampling_args"]

PREFIX = "verifiers:"
HOST_REF = "posttrain.rollout.verifiers_host:VerifiersHost"


def is_verifiers(environment: str | None) -> bool:
    """Whether `rollout.environment` names a verifiers environment (`verifiers:NAME_OR_FILE`)."""
    return bool(environment) and environment.startswith(PREFIX)


def sampling_args(params: SamplingParams) -> dict:
    """The OpenAI request options of one rollout turn: the run's sampling, one choice, and the token ids and
    log-probs our server returns on request (`return_token_ids`, vLLM's extension)."""
    out = {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_new_tokens,
           "logprobs": True, "extra_body": {"return_token_ids": True}}
    if params.top_k:
        out["extra_body"]["top_k"] = params.top_k
    return out


class VerifiersEnvironment:
    """A verifiers environment held in its worker process (module docstring). `timeout_s` bounds each call."""

    def __init__(self, ref: str, host, info: dict, timeout_s: float):
        self.ref, self.host, self.info, self.timeout_s = ref, host, info, timeout_s
        self.name = f"verifiers[{info['class']}]"

    @classmethod
    def open(cls, environment: str, args: dict | None = None, *, timeout_s: float = 600.0,
             key: str = "rollout.environment") -> VerifiersEnvironment:
        """The environment `verifiers:NAME_OR_FILE` names, loaded with `args`; a failure is a `ValueError` naming
        `key` and what went wrong (one line)."""
        ref = environment[len(PREFIX):] if is_verifiers(environment) else environment
        if not ref:
            raise ValueError(f"{key}: {environment!r} must be verifiers:NAME_OR_FILE (an installed environment "
                             "package or a .py file with load_environment)")
        host = ToolPool(num_workers=1).host(HOST_REF)
        try:
            info = host.call("load", (ref, dict(args or {})), timeout=timeout_s, fresh=True).result()
        except Exception as e:  # noqa: BLE001 - the environment's own code: one line naming it
            host.close()
            raise ValueError(f"{key}: cannot load the verifiers environment {ref!r}: {_line(e)}") from None
        return cls(ref, host, info, timeout_s)

    def records(self, split: str = "train") -> list[dict]:
        """The split's rows as prompt records (`prompt`: the messages; `answer`, `info`, `task`, `example_id`)."""
        size = self.info["eval" if split == "eval" and self.info["eval"] else "train"]
        rows = self.host.call("rows", (split, list(range(size))), timeout=self.timeout_s).result()
        return [{k: v for k, v in row.items() if v is not None} for row in rows]

    def rollouts(self, prompts: PromptSet, indices: Sequence[int], params: SamplingParams, base_url: str,
                 model: str, *, uids: Sequence[int] | None = None, version: int = 0,
                 split: str = "train") -> tuple[Rollouts, dict[str, float]]:
        """`params.n` rollouts of each row `indices` names (`prompts`: the encoded records, for a failed
        trajectory's prompt), scored by the rubric, as `Rollouts`, and the call's counts (refused turns, errors)."""
        n = params.n
        try:
            results = self.host.call("rollouts", (split, [int(i) for i in indices], n, base_url, model,
                                                  sampling_args(params)), timeout=self.timeout_s).result()
        except (cf.TimeoutError, TimeoutError):
            results = [_failed(f"{self.name}: the rollouts did not end within {self.timeout_s:g} s")] * (
                n * len(indices))
        except Exception as e:  # noqa: BLE001 - the worker died or the call failed: every trajectory says so
            results = [_failed(f"{self.name}: {_line(e)}")] * (n * len(indices))
        rows = [(k, int(i)) for k, i in enumerate(indices) for _ in range(n)]
        samples = [_sample(r, list(prompts[i].ids)) for r, (_, i) in zip(results, rows)]
        ro = _as_rollouts(samples, results, n, [int(i) for _, i in rows],
                          [uids[k] for k, _ in rows] if uids is not None else [], version)
        counts = {"verifiers/refused_turns": float(sum(s.refused for s in samples)),
                  "verifiers/refused_trajectories": float(sum(s.refused > 0 for s in samples)),
                  "verifiers/env_errors": float(sum(bool(r.get("error")) for r in results))}
        return ro, counts

    def close(self) -> None:
        self.host.close()


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _failed(error: str) -> dict:
    return {"turns": None, "reward": 0.0, "metrics": {}, "messages": [], "stop": None, "truncated": False,
            "error": error}


def _sample(result: dict, prompt: list[int]) -> Stitched:
    """A rollout's training sequence: its stitched turns, or (no turns, or turns without ids) nothing to train: the
    encoded `prompt` and its last id again with mask 0 (a filler: never trained on)."""
    turns = result.get("turns")
    if turns:
        return stitch([TurnTokens(t["prompt_ids"], t["completion_ids"], t["logprobs"]) for t in turns])
    error = result.get("error")
    reason = None if error else "the server's answer carried no token ids"
    return Stitched(prompt, prompt[-1:] or [0], [0], [0.0], 0, 0 if error else 1, reason)


def _last_assistant(messages: list) -> str:
    for m in reversed(messages or []):
        if isinstance(m, dict) and m.get("role") == "assistant":
            return str(m.get("content") or "")
    return ""


def _summary(result: dict, s: Stitched) -> dict:
    """The trajectory's plain-data summary (as an agent trajectory's: messages, turns, finish reason, failures),
    with the turns kept and refused."""
    error, messages = result.get("error"), result.get("messages") or []
    calls = sum(len(m.get("tool_calls") or []) for m in messages
                if isinstance(m, dict) and m.get("role") == "assistant")
    out = {"messages": messages, "turns": s.turns, "refused_turns": s.refused, "num_tool_calls": calls,
           "tool_errors": 0, "tool_seconds": 0.0,
           "finish_reason": "env_error" if error else ("length" if result.get("truncated") else "stop"),
           "stop_condition": result.get("stop"), "env_errors": int(bool(error))}
    if s.reason:
        out["refused_reason"] = s.reason
    if error:
        out |= {"env_error": error, "env_error_kind": "error"}
    return out


def _as_rollouts(samples: list[Stitched], results: list[dict], n: int, record_index: list[int], uids: list[int],
                 version: int) -> Rollouts:
    """The `Rollouts` of stitched, rubric-scored trajectories (module docstring)."""
    names = sorted({k for r in results for k in r.get("metrics", {})})
    rewards = np.asarray([float(r.get("reward") or 0.0) for r in results], np.float32)
    per_reward = {"rubric": rewards} | {f"rubric/{k}": np.asarray([float(r.get("metrics", {}).get(k, 0.0))
                                                                   for r in results], np.float32) for k in names}
    summaries = [_summary(r, s) for r, s in zip(results, samples)]
    texts = [_last_assistant(r.get("messages")) for r in results]
    firsts = [next((str(m.get("content") or "") for m in r.get("messages") or []
                    if isinstance(m, dict) and m.get("role") == "user"), "") for r in results]
    return Rollouts(
        group_size=n, record_index=record_index, prompt_ids=[s.prompt_ids for s in samples],
        completion_ids=[s.completion_ids for s in samples], logprobs=[s.logprobs for s in samples],
        finish_reasons=[t["finish_reason"] for t in summaries], texts=texts, prompts_text=firsts, rewards=rewards,
        per_reward=per_reward, reward_stats={}, uid=list(uids), version_first=[version] * len(samples),
        version_last=[version] * len(samples), token_versions=[[version] * len(s.completion_ids) for s in samples],
        completion_mask=[s.mask for s in samples], trajectories=summaries)
