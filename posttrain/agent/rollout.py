"""The multi-turn rollout driver: one `Trajectory` per sampled sequence, driven by the sampler's turn ends.

`Agent` holds what a run sets up once (tools, environment class, chat-template appender, tool-call format,
limits, the tool worker pool); `AgentRollout` is the `on_turn_end` callback of one `Sampler.generate` call.
At each turn end the trajectory
1. counts the turn's sampled ids and decodes them, only to read them (model text is never encoded again); the
   tokens themselves are recorded once, by the sampler (its slot record, handed over as the `Completion`), and
   the trajectory's `TokenBuffer` is read from that record when the sequence is done (`finish`);
2. ends (returns None) when the model stopped without a tool call, ran out of tokens, the environment says
   it is done, or `max_turns` turns were sampled;
3. otherwise parses the tool calls (`tool_format`), runs them concurrently in the `ToolPool` (a slot waiting
   for them is parked by the sampler: the callback returns a Future) or asks the environment's `step`;
   malformed calls, unknown tools, calls past `max_tool_calls` and tool failures become `{"error": ...}`
   tool messages and are counted; outputs are cut to `max_tool_output_tokens` with a marker;
4. returns the ids to append: the suffix `ChatTemplateAppender` renders for the new messages and the next
   assistant header (loss mask 0). When they do not fit (the sampler's `room`, or `max_total_tokens` after
   the prompt) the trajectory ends cleanly with finish reason `truncated`.
Finish reasons: `stop` (answered, or the environment ended the game), `length` (the model's turn hit the
token budget), `truncated` (an append did not fit), `max_turns`, `env_error` (the environment's `reset`, `step` or
a tool method of it timed out, crashed, raised or returned the wrong type: `posttrain.agent.environments`; its calls
have the tool time limit; the error is in the summary's `env_error`, with the record, counted in `env_errors`).

A trajectory with an environment opens its session (a worker process holding its instance) when the sampler first
reports it, and resets it without blocking: the first turn end waits for that reset (the slot is parked). When the
trajectory ends, its final `reward(...)` is asked at once and the session closes after it (`close`), so sessions
live only as long as their trajectories; `AgentRollout.close` closes any left (a generate call that failed).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from dataclasses import dataclass, fields
from typing import Any, Sequence

from posttrain.agent.buffer import TokenBuffer
from posttrain.agent.environments import EnvironmentSpec, EnvSession, trajectory_reward
from posttrain.agent.parsers import parse_error_messages, parse_tool_calls
from posttrain.agent.templates import ChatTemplateAppender
from posttrain.config import at_least
from posttrain.tools import ToolPool, ToolRecord, tool_message
from posttrain.tools.execution import error_content
from posttrain.tools.hosting import wait_closed

__all__ = ["Agent", "AgentLimits", "AgentRollout", "Trajectory"]


@dataclass
class AgentLimits:
    """The per-trajectory limits of multi-turn rollouts: one typed section, the one source of their defaults and
    checks. The RL config's `rollout` section holds these keys (`rollout.max_turns`, ...: it extends this class)
    and `posttrain eval` / `generate` fill them from their options; the `Agent` takes them.

    max_turns: assistant turns per trajectory: when the last one calls a tool (or the environment answers it
      without ending the game), the trajectory ends as `max_turns` instead.
    max_tool_calls: tool calls per trajectory, all turns together (later ones are refused with an error message).
    max_tool_output_tokens: tokens of one tool output or environment observation (cut with a marker).
    tool_timeout_s: seconds per tool call (an environment's `reset`, `step`, `reward` and tool methods too).
    max_total_tokens: tokens after the prompt, sampled and appended together; an append past it ends the
      trajectory as `truncated` (0: `budget` resolves it to max_turns x the turn's token budget; an `Agent`
      given 0 has no budget but the sampler's context).
    """

    max_turns: int = 8
    max_tool_calls: int = 16
    max_tool_output_tokens: int = 512
    tool_timeout_s: float = 10.0
    max_total_tokens: int = 0

    def __post_init__(self):
        at_least("rollout.max_turns", self.max_turns, 1)
        at_least("rollout.max_tool_calls", self.max_tool_calls, 0)
        at_least("rollout.max_tool_output_tokens", self.max_tool_output_tokens, 1)
        at_least("rollout.max_total_tokens", self.max_total_tokens, 0, "0 = max_turns x max_new_tokens")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.tool_timeout_s must be > 0, found {self.tool_timeout_s}")

    def budget(self, turn_tokens: int) -> int:
        """Tokens after the prompt per trajectory: `max_total_tokens`, or max_turns x `turn_tokens` when it is 0."""
        return self.max_total_tokens or self.max_turns * turn_tokens

    def limits(self, turn_tokens: int) -> AgentLimits:
        """These limits alone (a section extending this class: its other keys left out), the trajectory budget
        resolved for turns of `turn_tokens` tokens: what an `Agent` takes."""
        own = {f.name: getattr(self, f.name) for f in fields(AgentLimits)}
        return AgentLimits(**{**own, "max_total_tokens": self.budget(turn_tokens)})


class Agent:
    """A run's multi-turn set-up: `tools` (name -> Tool), `environment` (or None), the appender, `fmt`, limits."""

    def __init__(self, tokenizer, *, tools: dict | None = None, environment: EnvironmentSpec | None = None,
                 fmt: str = "hermes", limits: AgentLimits | None = None, stop_ids: Sequence[int] | None = None,
                 system_prompt: str | None = None, prompt_field: str = "prompt", pool: ToolPool | None = None,
                 template_name: str | None = None):
        self.tok = tokenizer
        self.prompt_field = prompt_field
        self.tools = dict(tools or {})
        self.environment = environment
        self.fmt = fmt
        self.limits = limits if limits is not None else AgentLimits()
        self.system_prompt = system_prompt
        schemas = [t.schema for t in self.tools.values()] + list(environment.schemas if environment else ())
        self.appender = ChatTemplateAppender(tokenizer, schemas, stop_ids=stop_ids, name=template_name)
        self.stop_ids = set(tokenizer.eos_token_ids if stop_ids is None else stop_ids)
        self.pool = pool or ToolPool(num_workers=4)
        self._own_pool = pool is None
        self.lock = threading.RLock()  # the tokenizer is used from tool-callback threads too
        self._sessions: set[EnvSession] = set()  # open ones, closed by `close` at the latest
        self._scratch: EnvSession | None = None  # `first_messages` without a session: one reused

    def env_record(self, record: dict) -> dict:
        """The dataset row as the environment sees it: the prompt under its own field name again (the prompt
        reader moved it to `prompt`)."""
        if self.prompt_field == "prompt" or "prompt" not in record:
            return record
        return {**record, self.prompt_field: record["prompt"]}

    def first_messages(self, record: dict, env: EnvSession | None = None) -> list[dict]:
        """The conversation's first messages: the environment's `reset(record)` (on `env`, else on a fresh
        instance in one session kept for this), else the record's prompt (text as a user turn, or messages) with
        the system prompt added. A failing `reset` raises `EnvCallError` (one line)."""
        if self.environment is not None:
            if env is None:
                with self.lock:
                    self._scratch = self._scratch or self.make_env()
                env = self._scratch
            return env.reset(self.env_record(record))
        prompt = record["prompt"]
        msgs = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def make_env(self) -> EnvSession:
        """A fresh environment session, its calls limited to the tool time limit (closed by `close_env`, or by
        `close` at the latest)."""
        session = self.environment.make(self.limits.tool_timeout_s, self.pool)
        with self.lock:
            self._sessions.add(session)
        return session

    def close_env(self, session: EnvSession) -> None:
        with self.lock:
            self._sessions.discard(session)
        session.close()

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The rendered first prompt (tools in the template or its system-prompt section), generation prompt last."""
        with self.lock:
            return self.appender.prompt_ids(messages)

    def decode(self, ids: Sequence[int]) -> str:
        """A turn's text, for reading only (its stop token left out)."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        with self.lock:
            return self.tok.decode(ids, skip_special_tokens=False)

    def cut_output(self, content: str) -> str:
        """`content`, or its first `max_tool_output_tokens` tokens and a marker."""
        limit = self.limits.max_tool_output_tokens
        if len(content) <= limit:  # no tokenizer makes more tokens than characters
            return content
        with self.lock:
            ids = self.tok.encode(content, add_special_tokens=False)
            if len(ids) <= limit:
                return content
            return self.tok.decode(ids[:limit]) + f"\n[... output cut: {len(ids) - limit} more tokens]"

    def close(self) -> None:
        """Close every environment session still open, and the tool pool if this agent made it."""
        with self.lock:
            sessions, self._sessions, self._scratch = list(self._sessions), set(), None
        for session in sessions:
            session.close()
        wait_closed(timeout=10.0)  # their workers gone before the run's own exit joins its children
        if self._own_pool:
            self.pool.close()


def _settle(out: cf.Future, compute) -> None:
    """`out` gets `compute()`'s value, or, when that is itself a Future, that Future's outcome (the sampler takes a
    Future of ids or None, never of another Future); an exception is `out`'s, so the sampler sees it."""
    try:
        value = compute()
    except BaseException as e:  # noqa: BLE001 - surfaces in the sampler, not lost in a thread
        out.set_exception(e)
        return
    if isinstance(value, cf.Future):
        value.add_done_callback(lambda f: _settle(out, f.result))
    else:
        out.set_result(value)


def _error_text(msg: dict) -> str:
    """The text of an `{"error": ...}` tool message."""
    try:
        return str(json.loads(msg["content"])["error"])
    except (ValueError, KeyError, TypeError):
        return str(msg.get("content", ""))


def _when_all(futures: list[cf.Future], then):
    """`then([results])` at once when every future is done, else a Future of it (completed in the thread that
    finishes the last one; see `_settle`)."""
    if all(f.done() for f in futures):
        return then([f.result() for f in futures])
    out: cf.Future = cf.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            _settle(out, lambda: then([f.result() for f in futures]))

    for f in futures:
        f.add_done_callback(done)
    return out


class Trajectory:
    """One sequence's conversation, token buffer, tool calls and results, and counts (see the module docstring)."""

    def __init__(self, agent: Agent, record: dict, prompt_ids: Sequence[int], where: str | None = None):
        self.agent, self.record, self.where = agent, record, where
        self.env: EnvSession | None = None
        self._reset: cf.Future | None = None  # the environment's reset, until the first turn end has waited for it
        self._reward: cf.Future | None = None  # the environment's final reward, asked when the trajectory ends
        self.first: list[dict] = []
        self.messages: list[dict] = []
        if agent.environment is not None:  # a session of its own, reset without blocking the sampler
            self.env = agent.make_env()
            self._reset = self.env.reset_future(agent.env_record(record))
        else:
            self._start(agent.first_messages(record))
        self.prompt_ids = list(prompt_ids)
        self.length = 0  # tokens after the prompt so far, sampled and appended (the sampler records the tokens)
        self.buffer: TokenBuffer | None = None  # read from the sampler's record of the sequence (`finish`)
        self.tool_calls: list[dict] = []
        self.tool_results: list[dict] = []
        self.turns = 0
        self.num_calls = 0
        self.tool_errors = 0
        self.tool_seconds = 0.0
        self.finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def tools(self) -> dict:
        """The tools this trajectory may call: the agent's and its environment session's methods."""
        return {**self.agent.tools, **(self.env.tools if self.env is not None else {})}

    def _start(self, first: list[dict] | None) -> None:
        """The conversation's first messages (None: the environment's reset failed; it ends at its first turn)."""
        self.first = first or []
        self.messages = self.agent.appender.prompt_messages(self.first) if self.first else []

    # ------------------------------------------------------------------ one turn end
    def on_turn(self, ids: Sequence[int], logprobs: Sequence[float], finish_reason: str, room: int):
        """The sampler's turn end: None (done), the ids to append, or a Future of either."""
        if self._reset is not None:  # the first turn end: the environment's first messages (or its failure)
            reset, self._reset = self._reset, None
            return _when_all([reset], lambda r: self._start(r[0]) or self._turn(ids, finish_reason, room))
        return self._turn(ids, finish_reason, room)

    def _turn(self, ids: Sequence[int], finish_reason: str, room: int):
        self.length += len(ids)
        self.turns += 1
        text = self.agent.decode(ids)
        self.messages.append({"role": "assistant", "content": text})
        if self.env_failed:
            return self._end("env_error")
        if finish_reason != "stop":
            return self._end("length")
        if self.env is not None and self.env.spec.has_step:
            return self._step(text, ids, room)
        parsed = parse_tool_calls(text, self.agent.fmt)
        if not parsed:
            return self._end("stop")
        if self.turns >= self.agent.limits.max_turns:
            return self._end("max_turns")
        futures = self._submit(parsed)
        return _when_all(futures, lambda results: self._append(results, ids, room))

    def _submit(self, parsed) -> list[cf.Future]:
        """Futures of `(message, record)`: the calls within `max_tool_calls`, then refusals and parse errors."""
        lim = self.agent.limits
        out = []
        for call in parsed.calls:
            self.tool_calls.append({"turn": self.turns, "name": call.name, "arguments": call.arguments,
                                    **({"id": call.id} if call.id else {})})
            if self.num_calls >= lim.max_tool_calls:
                f: cf.Future = cf.Future()
                f.set_result((tool_message(call.name, error_content(
                    f"tool call limit reached ({lim.max_tool_calls} calls per conversation)"), call.id),
                    ToolRecord(call.name, 0.0, "limit")))
            else:
                f = self.agent.pool.submit(self.tools, call, timeout=lim.tool_timeout_s,
                                           max_output_chars=lim.max_tool_output_tokens * 16)
            self.num_calls += 1
            out.append(f)
        for pair in parse_error_messages(parsed):
            f = cf.Future()
            f.set_result(pair)
            out.append(f)
        return out

    @property
    def env_failed(self) -> bool:
        return self.env is not None and self.env.failure is not None

    def _append(self, results: list[tuple[dict, ToolRecord]], ids: Sequence[int], room: int):
        new = []
        for msg, rec in results:
            if rec.error in ("timeout", "crash") and self.env is not None and rec.name in self.env.tools:
                self._lost(rec.name, rec.error, msg)
            if rec.error is None:  # error messages are ours, short, and must stay JSON
                msg = dict(msg, content=self.agent.cut_output(msg["content"]))
            new.append(msg)
            self.tool_errors += rec.error is not None
            self.tool_seconds += rec.seconds
            self.tool_results.append({"turn": self.turns, "name": rec.name, "content": msg["content"],
                                      "error": rec.error, "seconds": round(rec.seconds, 4)})
        if self.env_failed:  # the instance is gone with its worker
            return self._end("env_error")
        return self._append_messages(new, ids, room)

    def _lost(self, method: str, kind: str, msg: dict) -> None:
        """A tool method of the environment timed out or crashed: its instance is gone with its worker (the
        trajectory ends)."""
        if kind == "timeout":
            self.env.failed(method, TimeoutError())
        else:
            self.env.fail(method, "crash", f"{self.env.name}.{method}: {_error_text(msg)}")

    def _step(self, text: str, ids: Sequence[int], room: int):
        """The environment's `step` runs in a thread of its own, within the tool time limit (a slow game or
        simulated user parks only this slot); then its observation is appended, or the trajectory ends."""
        return _when_all([self.env.step_future(text)], lambda results: self._after_step(results[0], ids, room))

    def _after_step(self, res, ids: Sequence[int], room: int):
        if res.error is not None:
            return self._end("env_error")
        if res.done or res.observation is None:
            return self._end("stop")
        if self.turns >= self.agent.limits.max_turns:
            return self._end("max_turns")
        return self._append_messages([{"role": "user", "content": self.agent.cut_output(res.observation)}], ids, room)

    def _append_messages(self, new: list[dict], ids: Sequence[int], room: int):
        with self.agent.lock:
            append = self.agent.appender.append_ids(new, ids[-1] if len(ids) else None)
        budget = self.agent.limits.max_total_tokens
        if budget:  # after the prompt, sampled and appended tokens together, one left for the next turn
            room = min(room, budget - self.length - 1)
        if len(append) > room:  # `room`: the most ids an append may hold (the next token's position kept)
            return self._end("truncated")  # the messages keep what the model saw: not these
        self.messages += self.agent.appender.convert(new)
        self.length += len(append)
        return append

    def _end(self, reason: str) -> None:
        """The trajectory is over: the environment's final reward is asked now (its session closes after it)."""
        self.finish_reason = reason
        if self.env is not None:
            self._ask_reward()
        return None

    def _ask_reward(self) -> cf.Future:
        if self._reward is None:
            env = self.env
            if self.env_failed or not env.spec.has_reward:  # a failed session's instance is not asked again
                self._reward = cf.Future()
                self._reward.set_result((None, None))
            else:
                self._reward = env.reward_future(self.messages, self.agent.env_record(self.record))
            self._reward.add_done_callback(lambda _: self.agent.close_env(env))
        return self._reward

    def close(self) -> None:
        """Close the environment's session (after its reward, if asked)."""
        if self.env is not None:
            self.agent.close_env(self.env)

    # ------------------------------------------------------------------ the finished trajectory
    def finish(self, completion) -> None:
        """The sequence is done: its token buffer, read from the sampler's record of it (`completion`: every id
        after the prompt with its log-prob and mask; `TokenBuffer.from_completion`). A completion of another
        length than the turns and appends this trajectory saw is refused."""
        if len(completion.token_ids) != self.length:
            raise RuntimeError(f"multi-turn rollout: the sampler's completion has {len(completion.token_ids)} tokens "
                               f"after the prompt, the trajectory's turns and appends {self.length}")
        self.buffer = TokenBuffer.from_completion(self.prompt_ids, completion)

    @property
    def final_text(self) -> str:
        """The last assistant message: what the reward functions score."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    def env_reward(self) -> float | None:
        """The environment's reward (per-turn rewards summed plus its `reward(...)`), or None without one."""
        if self.env is None or not (self.env.spec.has_step or self.env.spec.has_reward):
            return None
        final, _ = self._ask_reward().result()
        return trajectory_reward(self.env.turn_rewards, final)

    def summary(self) -> dict[str, Any]:
        """Plain data (JSON) about the trajectory: conversation, calls, results, counts, finish reason, and the
        environment's failure (`env_errors` 0 or 1; `env_error` its text, `env_error_kind` e.g. `step timeout`)."""
        failure = self.env.failure if self.env is not None else None
        where = {"env_error_record": self.where} if failure is not None and self.where else {}
        return {"messages": self.messages, "tool_calls": self.tool_calls, "tool_results": self.tool_results,
                "turns": self.turns, "num_tool_calls": self.num_calls, "tool_errors": self.tool_errors,
                "tool_seconds": self.tool_seconds, "finish_reason": self.finish_reason or "stop",
                "env_errors": int(failure is not None),
                **({"env_error": failure.text, "env_error_kind": failure.label, **where} if failure is not None
                   else {})}


class AgentRollout:
    """The `on_turn_end` callback of one `generate` call: a `Trajectory` per (prompt index, sample index).
    `wheres`: what names each record in errors (its file and line), when known."""

    def __init__(self, agent: Agent, records: Sequence[dict], prompt_ids: Sequence[Sequence[int]],
                 wheres: Sequence[str] | None = None):
        self.agent, self.records, self.prompt_ids = agent, list(records), list(prompt_ids)
        self.wheres = list(wheres) if wheres is not None else [None] * len(self.records)
        self.trajectories: dict[tuple[int, int], Trajectory] = {}

    def trajectory(self, prompt_index: int, sample_index: int) -> Trajectory:
        key = (int(prompt_index), int(sample_index))
        if key not in self.trajectories:
            self.trajectories[key] = Trajectory(self.agent, self.records[key[0]], self.prompt_ids[key[0]],
                                                self.wheres[key[0]])
        return self.trajectories[key]

    def close(self) -> None:
        """Close every trajectory's environment session (those that ended close themselves after their reward)."""
        for traj in self.trajectories.values():
            traj.close()

    def __call__(self, end) -> Any:
        """`Sampler.generate`'s `on_turn_end` (a `posttrain.sampling.TurnEnd` in)."""
        traj = self.trajectory(end.prompt_index, end.sample_index)
        return traj.on_turn(end.token_ids, end.logprobs, end.finish_reason, end.room)

    def finished(self, completion) -> Trajectory:
        """The trajectory of a finished `Completion`, its token buffer read from it (`Trajectory.finish`)."""
        traj = self.trajectory(completion.prompt_index, completion.sample_index)
        traj.finish(completion)
        return traj
