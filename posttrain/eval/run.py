"""Evaluation as a run: `run_eval(EvalConfig) -> EvalResult`, what `posttrain eval` and `posttrain.evaluate` call.

Greedy pass@1, sampled pass@k and maj@k of a model on a problem set with a correctness reward, by RL's held-out
evaluator (`posttrain.eval.evaluate`: the same sampling, rewards and estimators) through a `Policy`. The model is
sharded over every device (of every process: on several hosts every process runs the same sampler on the global
mesh, process 0 scores the rewards and writes the outputs). Writes one JSONL row per problem to `output` (the
greedy completion, the n samples with their answers and correctness, the problem's pass@k / maj@k) and the
summary beside it (`.summary.json`). Text prompts are rendered as the model was trained to be prompted (the prompt
format its export records: `posttrain.models.prompt_format`; raw text for a checkpoint that records none) unless
`chat` / `system_prompt` say otherwise. Bad input is a typed error naming the file, line or option (`ConfigError`,
`DataError`, `CheckpointError`, ...).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from posttrain import distributed
from posttrain.config import ConfigError
from posttrain.data.sources import PROMPT_FIELDS, DataError, read_prompts
from posttrain.eval.evaluate import evaluate, per_problem
from posttrain.eval.verifiers_eval import evaluate_verifiers
from posttrain.rewards.runner import RewardRunner, RewardSpec
from posttrain.rollout.config import AgentOptions, json_object
from posttrain.rollout.generate import fitted_budget
from posttrain.rollout.policy import Policy
from posttrain.rollout.verifiers_env import is_verifiers
from posttrain.serve.local import serve_judges

__all__ = ["EvalConfig", "EvalResult", "default_ks", "run_eval"]


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return sorted(set(ks + [n])) if n > 0 else []


@dataclasses.dataclass
class EvalConfig(AgentOptions):
    """An evaluation (the options of `posttrain eval`, by their flags' names; the multi-turn ones are
    `AgentOptions`').

    model: a model spec (`Policy.open`: checkpoint folder, run folder, .gguf, pypi:, tiny:, hub id, adapter folder).
    data: the problems (JSONL/JSON/Parquet, or `reasoning_gym:TASK?size=N`); none with a verifiers environment
    (`environment=verifiers:...`), whose eval split, rollouts and rubric are used.

    reward: the correctness reward: a built-in name, `module:function` or `file.py:function` (1.0 = correct), or
    `environment` (with an environment: its reward). reward_kwargs: its settings (a dict, or JSON text; e.g. the
    `judge`'s: `{"model": "tiny:llama"}` for a local judge, or `{"url": ".../v1"}`).

    n: samples per problem for pass@k / maj@k (0 = greedy only). k: the k of pass@k and maj@k (a list, or
    comma-separated text; None = 1, 2, 4, ... up to n, and n).

    temperature, top_p: how the n samples are drawn. max_new_tokens: tokens per completion (a turn) at most (cut
    to the room a small model's context leaves).

    chat: render text prompts with the chat template (False: as raw text; None: as the model was trained).
    system_prompt: a system turn for chat prompts (None: the one the model was trained with; "": none).
    prompt_field: the record field holding the prompt (None: the first of prompt, question, problem, messages).

    limit: evaluate the first N problems only (0 = all). output: the per-problem JSONL file. seed: the samples'
    seed. dtype: the parameters' dtype. max_slots: sequences decoded at once at most. reward_workers: reward
    processes (0 = in this process). no_progress: no progress bars.
    """

    model: str = ""
    data: str = ""
    reward: str = "math_answer"
    reward_kwargs: dict[str, Any] | str | None = None
    n: int = 8
    k: list[int] | str | None = None
    temperature: float = 0.6
    top_p: float = 1.0
    max_new_tokens: int = 512
    chat: bool | None = None
    system_prompt: str | None = None
    prompt_field: str | None = None
    limit: int = 0
    output: str = "eval_samples.jsonl"
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_slots: int = 64
    reward_workers: int = 2
    no_progress: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.reward_kwargs = json_object(self.reward_kwargs, "--reward-kwargs")
        if self.n < 0 or self.limit < 0:
            raise ConfigError("--n and --limit must be >= 0")
        self.model, self.data, self.output = str(self.model), str(self.data), str(self.output)
        self.k = self._ks(self.k)

    def _ks(self, k) -> list[int]:
        if k is None or k == "" or k == []:
            return default_ks(self.n)
        try:
            ks = sorted({int(x) for x in (k.split(",") if isinstance(k, str) else k) if str(x).strip()})
        except ValueError:
            raise ConfigError(f"--k: expected comma-separated integers, found {k!r}") from None
        bad = [x for x in ks if not 1 <= x <= self.n]
        if bad:
            raise ConfigError(f"--k: every k must be in [1, --n={self.n}], found {bad}")
        return ks


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What an evaluation wrote: one JSONL row per problem in `output`, the summary beside it (`summary_path`).

    metrics: the summary (`eval/accuracy` = greedy pass@1, `eval/pass@k`, `eval/maj@k`, ... and the settings).

    k: the k of pass@k and maj@k.
    """

    output: Path
    summary_path: Path
    metrics: dict[str, Any]
    k: list[int] = dataclasses.field(default_factory=list)

    def problems(self) -> list[dict]:
        """The per-problem rows (greedy completion, samples, their answers and correctness, pass@k / maj@k)."""
        return [json.loads(x) for x in self.output.read_text(encoding="utf-8").splitlines() if x.strip()]


def run_eval(cfg: EvalConfig) -> EvalResult:
    """Evaluates `cfg.model` on `cfg.data` (module docstring), or on a verifiers environment
    (`--environment verifiers:...`: `posttrain.eval.verifiers_eval`), and returns what it wrote."""
    if is_verifiers(cfg.environment):
        return _verifiers_eval(cfg)
    if not cfg.data:
        raise ConfigError("--data: no problems given (a file, or --environment verifiers:NAME with its own)")
    records = _records(cfg)
    checked = cfg.check_agent()  # a bad tool or environment reference fails before the model loads
    by_env = checked is not None and cfg.reward == "environment"
    spec = None if by_env else RewardSpec(name=RewardSpec.coerce(cfg.reward).name, fn=cfg.reward,
                                          kwargs=dict(cfg.reward_kwargs))
    correctness = "environment" if by_env else spec.name
    primary = distributed.is_primary()  # multi-host: process 0 scores (`score_once`) and writes
    with RewardRunner([spec] if spec else [], num_workers=cfg.reward_workers if primary else 0) as runner:
        runner.check_records(records)  # a missing field fails before the model loads
        serve_judges(runner)  # a judge given as a local checkpoint: opened as a Policy, served in-process
        policy = Policy.open(cfg.model, dtype=cfg.dtype, max_slots=cfg.max_slots,
                             sequences=len(records) * max(cfg.n, 1), chat=cfg.chat, system_prompt=cfg.system_prompt)
        style = policy.style  # the flags, else the export's
        agent = cfg.make_agent(checked, policy.tokenizer, system_prompt=style.system_prompt,
                               prompt_field=records.prompt_field or "prompt")
        try:  # each prompt carries its ids, images (handed to its prefill) and record
            prompts = policy.encode(records, agent=agent)
            e = evaluate(policy, prompts, runner, correctness=correctness, k=cfg.k, n_samples=cfg.n,
                         max_new_tokens=fitted_budget(policy, prompts.ids, cfg.max_new_tokens, "eval"),
                         temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                         progress=not cfg.no_progress and primary, agent=agent)
        finally:
            if agent is not None:
                agent.close()
    distributed.finish()
    summary = {k: v for k, v in e.items() if not k.startswith("_")}
    summary.update({"model": cfg.model, "data": cfg.data, "reward": correctness, "n": cfg.n,
                    "temperature": cfg.temperature, "chat": style.chat, "system_prompt": style.system_prompt})
    out = Path(cfg.output)
    if primary:
        _write(out, per_problem(e, records, correctness=correctness, k=cfg.k), summary)
    return EvalResult(output=out, summary_path=out.with_suffix(".summary.json"), metrics=summary, k=cfg.k)


def _verifiers_eval(cfg: EvalConfig) -> EvalResult:
    """A verifiers environment's own evaluation: its rows, rollouts and rubric (`posttrain.eval.verifiers_eval`)."""
    if cfg.data:
        raise ConfigError("--data: a verifiers environment's dataset gives the problems; leave --data out")
    summary, rows = evaluate_verifiers(cfg)
    summary.update({"model": cfg.model, "environment": cfg.environment, "reward": "rubric", "n": cfg.n,
                    "temperature": cfg.temperature})
    out = Path(cfg.output)
    _write(out, rows, summary)
    return EvalResult(output=out, summary_path=out.with_suffix(".summary.json"), metrics=summary, k=cfg.k)


def _records(cfg: EvalConfig):
    """The problems, their prompt under `prompt`: `cfg.prompt_field`, else the first of `PROMPT_FIELDS` the first
    record has; none with an environment, whose `reset` makes the conversation."""
    environment = bool(cfg.environment)
    records = read_prompts(cfg.data, prompt_field=cfg.prompt_field, fallback=cfg.prompt_field is None,
                           optional=cfg.prompt_field is None)
    if records.prompt_field is None and not environment:
        raise DataError(f"{cfg.data}: the first record has none of the prompt fields {list(PROMPT_FIELDS)} "
                        f"(fields present: {sorted(records[0])}); name one with --prompt-field")
    return records[: cfg.limit] if cfg.limit else records


def _as_text(obj) -> str:
    """What a per-problem row shows of a value JSON cannot hold (an image in a prompt: `<image RGB 32x32>`)."""
    size = getattr(obj, "size", None)
    if isinstance(size, tuple) and hasattr(obj, "mode"):
        return f"<image {obj.mode} {size[0]}x{size[1]}>"
    return repr(obj)


def _write(out: Path, rows: list[dict], summary: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=_as_text) + "\n")
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
