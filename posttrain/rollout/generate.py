"""Generation as a run: `run_generate(GenerateConfig) -> GenerateResult`, what `posttrain generate` and
`posttrain.generate` call: completions of a JSONL file of prompts (`prompt` text or chat `messages`) to a JSONL file.

With tools or an environment (`AgentOptions`) each sample is a multi-turn conversation (`posttrain.agent`): its
output line then holds the whole trajectory (messages, tool calls and results, turns, the token ids after the
prompt with their `loss_mask`: 1 where sampled, 0 where appended) and `text` is the last assistant message. The
model is sharded over every device (of every process: on several hosts every process runs the same sampler on the
global mesh and gets every completion, and process 0 writes the file, or standard output for `-`). Text prompts
are rendered as the model was trained to be prompted (the prompt format its export records:
`posttrain.models.prompt_format`; raw text for a checkpoint that records none) unless `chat` / `system_prompt` say
otherwise; a message list always goes through the chat template. A prompts file or option that cannot be used is
an `InputError` naming the file (`<stdin>` for `-`) and line.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

from posttrain import distributed
from posttrain.data.errors import DataError
from posttrain.data.sources import json_error_column
from posttrain.rollout.config import AgentOptions
from posttrain.rollout.policy import Policy, Samples
from posttrain.sampling import SamplingParams

__all__ = ["GenerateConfig", "GenerateResult", "InputError", "fitted_budget", "read_prompt_lines", "run_generate"]


class InputError(DataError):
    """Input that cannot be used as given: a prompts file (the message names the file and line) or a sampling option."""


@dataclasses.dataclass
class GenerateConfig(AgentOptions):
    """A generation (the options of `posttrain generate`, by their flags' names; the multi-turn ones are
    `AgentOptions`').

    model: a model spec (`Policy.open`). prompts: the JSONL prompts file (`-`: standard input). output: the JSONL
    output file, one line per completion (`-`: standard output).

    max_new_tokens (cut to the room a small model's context leaves), temperature (0 = greedy), top_p, top_k, min_p,
    n (samples per prompt), seed: the sampling.

    chat: also wrap plain `prompt` text as one user message (False: raw text; None: as the model was trained).
    system_prompt: a system turn for chat prompts (None: the one the model was trained with; "": none).

    dtype: the parameters' dtype. max_slots: sequences decoded at once at most. max_len: the KV cache's length
    (None: fitted to the prompts). no_progress: no progress bar.
    """

    model: str = ""
    prompts: str = ""
    output: str = "-"
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int = 0
    chat: bool | None = None
    system_prompt: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_slots: int = 32
    max_len: int | None = None
    no_progress: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.model, self.prompts, self.output = str(self.model), str(self.prompts), str(self.output)

    def sampling(self) -> SamplingParams:
        """The sampling parameters (an option out of range is an `InputError`)."""
        try:
            return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, min_p=self.min_p, n=self.n, seed=self.seed)
        except ValueError as e:
            raise InputError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What a generation wrote: `output` (None: standard output), one JSON line per completion (`prompt_index`,
    `sample_index`, `text`, `token_ids`, `logprobs`, `finish_reason`; multi-turn samples their trajectory), those
    lines as `completions`, and the sampler's figures of the call (`stats`: generated tokens, seconds, ...)."""

    output: Path | None
    completions: list[dict] = dataclasses.field(repr=False)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)


def read_prompt_lines(path: str | Path) -> list[dict]:
    """Parsed lines of a prompts file, or of standard input for `-` (blank lines skipped), each with its `_line`;
    errors name the file (`<stdin>`) and line number."""
    if str(path) == "-":
        return _parse_lines(sys.stdin, "<stdin>")
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {path} does not exist")
    with path.open(encoding="utf-8") as f:
        return _parse_lines(f, path)


def _parse_lines(lines, path) -> list[dict]:
    """The records of JSONL `lines` from `path` (named in errors), each with its `_line`."""
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {json_error_column(line, e)})"
                             ) from None
        if not isinstance(rec, dict):
            raise InputError(f"{path}, line {lineno}: expected a JSON object, got {type(rec).__name__}")
        if "messages" in rec:
            msgs = rec["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in msgs):
                raise InputError(f"{path}, line {lineno}: `messages` must be a list of {{role, content}} objects")
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str):
                raise InputError(f"{path}, line {lineno}: `prompt` must be a string")
        else:
            raise InputError(f"{path}, line {lineno}: has neither a `prompt` (text) nor a `messages` (chat) field")
        rec["_line"] = lineno
        records.append(rec)
    if not records:
        raise InputError(f"prompts file {path} has no prompts")
    return records


def run_generate(cfg: GenerateConfig) -> GenerateResult:
    """Samples `cfg.n` completions of every prompt of `cfg.prompts` and writes them to `cfg.output` (module
    docstring)."""
    source = "<stdin>" if cfg.prompts == "-" else cfg.prompts
    params = cfg.sampling()
    lines = read_prompt_lines(cfg.prompts)
    checked = cfg.check_agent()  # a bad tool or environment reference fails before the model loads
    # the prompt under "prompt": text, or chat messages
    records = [{**{k: v for k, v in r.items() if k != "messages"}, "prompt": r.get("messages", r.get("prompt"))}
               for r in lines]
    policy = Policy.open(cfg.model, dtype=cfg.dtype, max_slots=cfg.max_slots, sequences=len(records) * params.n,
                         max_len=cfg.max_len, chat=cfg.chat, system_prompt=cfg.system_prompt)
    agent = cfg.make_agent(checked, policy.tokenizer, system_prompt=policy.style.system_prompt)
    try:
        prompts = policy.encode(records, agent=agent, where=lambda i: f"{source}, line {records[i]['_line']}")
        params = dataclasses.replace(params, max_new_tokens=fitted_budget(policy, prompts.ids, params.max_new_tokens,
                                                                          "generate"))
        samples = policy.sample(prompts, params, agent=agent, progress=not cfg.no_progress and distributed.is_primary())
    except DataError:
        raise
    except ValueError as e:  # the sampler names prompts by index: name the line too
        m = re.match(r"prompt (\d+) ", str(e))
        raise InputError((f"{source}, line {records[int(m.group(1))]['_line']}: " if m else "") + str(e)) from None
    finally:
        if agent is not None:
            agent.close()
    distributed.finish()  # multi-host: every process has every completion; process 0 writes them
    lines = [json.dumps(_row(c, samples, i), ensure_ascii=False) + "\n" for i, c in enumerate(samples)]
    samples.close()
    out = None if cfg.output == "-" else Path(cfg.output)
    if distributed.is_primary():
        _write(lines, out)
    return GenerateResult(output=out, completions=[json.loads(x) for x in lines],
                          stats=dict(getattr(policy.sampler, "last_stats", {})))


def _write(lines: list[str], out: Path | None) -> None:
    """The output lines to the file `out`, or to standard output (None)."""
    if out is None:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines), encoding="utf-8")


def fitted_budget(policy: Policy, prompt_ids, max_new_tokens: int, command: str) -> int:
    """`max_new_tokens`, cut to the room the model's context leaves after the longest prompt (`Policy.budget_for`),
    saying so on stderr: a default budget larger than a small model's context (the demo's 256) is no error."""
    budget = policy.budget_for(prompt_ids, max_new_tokens)
    if budget < max_new_tokens:
        longest = max(len(p) for p in prompt_ids)
        print(f"{command}: --max-new-tokens {max_new_tokens} cut to {budget}: the model's context holds "
              f"{longest + budget} tokens and the longest prompt has {longest}", file=sys.stderr, flush=True)
    return budget


def _row(c, samples: Samples, i: int) -> dict:
    """One completion's output line (with its trajectory when an agent drove it)."""
    row = {"prompt_index": c.prompt_index, "sample_index": c.sample_index, "text": c.text,
           "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
    if samples.trajectories is not None:
        traj = samples.trajectories[i]
        row |= traj.summary() | {"text": traj.final_text, "loss_mask": c.mask}
    return row
