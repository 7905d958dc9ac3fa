"""The rollout section and the multi-turn options: `RolloutConfig` (RL's `rollout` section: the G samples per prompt,
the agent's tools, environment and limits) and `AgentOptions`, the multi-turn options of the eval and generate runs
(`posttrain eval` / `generate` flags `--tools`, `--environment`, `--max-turns`, ...), which fill the same section,
so every command runs the same multi-turn rollout (`posttrain.agent`). An option left unset keeps the section's
default (`posttrain.agent.rollout.AgentLimits`: the one place the defaults are)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from posttrain.agent.env_openenv import OpenEnvConfig
from posttrain.agent.rollout import Agent, AgentLimits
from posttrain.agent.setup import agent_enabled, build_agent, load_agent_parts
from posttrain.config import ConfigError, at_least
from posttrain.tools.python_sandbox import SandboxConfig

__all__ = ["LIMIT_KEYS", "AgentOptions", "RolloutConfig", "json_object"]


@dataclasses.dataclass
class RolloutConfig(AgentLimits):
    """Sampling of the G completions per prompt (G = group_size).

    Multi-turn rollouts (`posttrain.agent`) are on when `tools` or `environment` is set. The limits per
    trajectory (`max_turns`, `max_tool_calls`, `max_tool_output_tokens`, `tool_timeout_s`, `max_total_tokens`)
    are `AgentLimits`' keys, with its defaults; `max_new_tokens` is then each turn's budget, and
    `max_total_tokens` (0: max_turns x max_new_tokens) the trajectory's after the prompt: an append past it ends
    the trajectory as `truncated`.

    batch_prompts: prompts (groups) per trainer step (B): a step trains on B x group_size completions.
    group_size: completions sampled per prompt (G); their rewards give the group-relative advantages (rloo
      needs at least 2).
    max_new_tokens: tokens sampled per completion at most (a multi-turn trajectory's: per assistant turn); the
      held-out evaluation's budget too.
    temperature: sampling temperature of the training rollouts (0 = greedy; the held-out pass@k draws have
      `eval.temperature`).
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p (1 = off).
    top_k: keep the k most likely tokens (0 = off).
    max_slots: sequences the sampler decodes at once (its KV cache's batch; every decode step computes all of
      them, and more sequences wait for a free slot); 0 = batch_prompts x group_size. On the fleet: per worker.
    stop_token_ids: token ids that end a completion (kept in it); None = the model's end-of-sequence ids; []
      = always sample max_new_tokens.
    tools: tool references, like reward functions (`calculator`, `posttrain.tools:calculator`,
      `my_tools.py:search`); the built-in `python` runs in `sandbox`.
    environment: an environment class (`my_env.py:Wordle`) whose `reset` makes each conversation and whose
      public typed methods are tools too, or an OpenEnv server (`openenv:http://HOST:PORT`: one WebSocket session
      per trajectory, see `openenv`), or a verifiers environment (`verifiers:NAME_OR_FILE`: an installed
      environment package or a .py file exporting `load_environment`; its dataset, rollouts and rubric are used,
      `posttrain.rollout.verifiers_env`); None = none.
    environment_args: keyword arguments of a verifiers environment's `load_environment`.
    tool_format: how the model writes calls: hermes `<tool_call>`, llama3 JSON, mistral `[TOOL_CALLS]`.
    tool_workers: processes that run the tool calls (an environment's methods run in threads of the run).
    max_env_error_fraction: an environment method that times out, raises or returns the wrong type ends its
      trajectory (`agent/env_errors`); when more than this fraction of one step's trajectories end so, the run
      stops with an error (1: never).
    sandbox: where the built-in `python` tool runs model-written code (`posttrain.tools.python_sandbox.SandboxConfig`:
      the kernel's namespaces by default, a SandboxFusion service, or an explicitly unsafe plain process).
    openenv: how an OpenEnv environment's actions and observations map to text
      (`posttrain.agent.env_openenv.OpenEnvConfig`: `action_field`, `observation_field`).
    compute_dtype: the sampler's activation and matmul dtype, independent of the trainer's (the weights stay in
      model.param_dtype, cast at each use), in-process, in the held-out evaluation and on the fleet's workers;
      None = the model's (model.compute_dtype). The sampler's log-probs then differ from the trainer's: what the
      learner's rollout correction (learner.is_level, learner.rejection) is for, and what `mismatch_kl` shows.
    """

    batch_prompts: int = 8
    group_size: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_slots: int = 0
    stop_token_ids: list[int] | None = None
    tools: list[str] = dataclasses.field(default_factory=list)
    environment: str | None = None
    environment_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool_format: Literal["hermes", "llama3", "mistral"] = "hermes"
    tool_workers: int = 4
    max_env_error_fraction: float = 0.5
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    openenv: OpenEnvConfig = dataclasses.field(default_factory=OpenEnvConfig)
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = None

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or bool(self.environment)

    @property
    def completion_budget(self) -> int:
        """Tokens after the prompt at most: max_new_tokens, or a multi-turn trajectory's total."""
        return self.budget(self.max_new_tokens) if self.multi_turn else self.max_new_tokens

    @property
    def slots(self) -> int:
        """The sampler's slots (a `Policy`'s `max_slots`): `max_slots`, else one per sample of a step's prompts."""
        return self.max_slots or self.batch_prompts * self.group_size

    def __post_init__(self):
        super().__post_init__()
        at_least("rollout.tool_workers", self.tool_workers, 1)
        if not 0 <= self.max_env_error_fraction <= 1:
            raise ValueError("rollout.max_env_error_fraction must be between 0 and 1 (1: never stop), found "
                             f"{self.max_env_error_fraction}")


#: the options that are the agent's limits (`AgentLimits` keys)
LIMIT_KEYS = ("max_turns", "max_tool_calls", "max_tool_output_tokens", "tool_timeout_s")
#: a rollout-section key in an error message -> the option that sets it
_FLAG_NAMES = (("rollout.sandbox.backend", "--sandbox"), ("rollout.sandbox.url", "--sandbox-url"),
               ("rollout.tool_timeout_s", "--tool-timeout"), ("rollout.openenv.", "--openenv-"),
               ("rollout.tools", "--tools"), ("rollout.environment", "--environment"))


@dataclasses.dataclass
class AgentOptions:
    """The multi-turn options of `posttrain eval` and `generate` (their runs' configs extend this class): none of
    `tools` and `environment` set = single-turn.

    tools: tool references (`calculator`, `python`, `module:function`, `file.py:function`): a list, or one
    comma-separated string.

    environment: an environment class (`module:Class` or `file.py:Class`). tool_format: how the model writes tool
    calls: hermes, llama3 or mistral.

    max_turns, max_tool_calls, max_tool_output_tokens, tool_timeout_s: the agent's limits (None: the rollout
    section's defaults). sandbox, sandbox_url: where the python tool runs model-written code
    (`rollout.sandbox.backend` / `url`).

    openenv_action_field, openenv_observation_field: an OpenEnv environment's action field that holds the model's
    turn and observation field that is the next user turn (`rollout.openenv.*`; None: its defaults).

    environment_args: a verifiers environment's `load_environment` keyword arguments (a dict, or JSON text).
    """

    tools: list[str] | str | None = None
    environment: str | None = None
    tool_format: Literal["hermes", "llama3", "mistral"] = "hermes"
    max_turns: int | None = None
    max_tool_calls: int | None = None
    max_tool_output_tokens: int | None = None
    tool_timeout_s: float | None = None
    sandbox: Literal["namespaces", "remote", "process"] = "namespaces"
    sandbox_url: str | None = None
    openenv_action_field: str | None = None
    openenv_observation_field: str | None = None
    environment_args: dict[str, Any] | str | None = None

    def __post_init__(self):
        self.environment_args = json_object(self.environment_args, "--environment-args")

    def rollout_section(self) -> RolloutConfig:
        """The rollout section these options fill (validated as `posttrain rl` validates it; errors name the option)."""
        tools = self.tools.split(",") if isinstance(self.tools, str) else list(self.tools or [])
        openenv = {k: v for k, v in (("action_field", self.openenv_action_field),
                                     ("observation_field", self.openenv_observation_field)) if v is not None}
        try:
            return RolloutConfig(tools=[t.strip() for t in tools if t.strip()], environment=self.environment,
                                 tool_format=self.tool_format, sandbox=SandboxConfig(backend=self.sandbox,
                                                                                     url=self.sandbox_url),
                                 openenv=OpenEnvConfig(**openenv),
                                 **{key: getattr(self, key) for key in LIMIT_KEYS if getattr(self, key) is not None})
        except ValueError as e:
            raise ConfigError(_option_names(str(e)).replace("rollout.", "--").replace("_", "-")) from None

    def check_agent(self):
        """`(rollout section, loaded tools and environment)`, or None without tools or an environment; run before
        any model loads, so a bad reference fails at once (a `ConfigError` naming the option)."""
        section = self.rollout_section()
        if (section.environment or "").strip().startswith("verifiers:"):
            raise ConfigError(f"--environment: {section.environment!r}: verifiers environments run in posttrain rl "
                              "and posttrain eval (their own rollouts), not here")
        if not agent_enabled(section):
            return None
        try:
            return section, load_agent_parts(section)
        except ConfigError as e:
            raise ConfigError(_option_names(str(e))) from None

    @staticmethod
    def make_agent(checked, tokenizer, *, system_prompt: str | None = None,
                   prompt_field: str = "prompt") -> Agent | None:
        """The `Agent` of `check_agent`'s result for the loaded tokenizer (None: single-turn)."""
        if checked is None:
            return None
        section, parts = checked
        return build_agent(section, tokenizer, system_prompt=system_prompt, prompt_field=prompt_field, parts=parts)


def json_object(value, flag: str) -> dict:
    """An option holding a JSON object (a dict, JSON text, or None: `{}`); anything else is a `ConfigError`
    naming `flag`."""
    if isinstance(value, str):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: not a JSON object ({e.msg}): {value!r}") from None
    if not isinstance(value or {}, dict):
        raise ConfigError(f"{flag}: expected a JSON object, found {value!r}")
    return dict(value or {})


def _option_names(message: str) -> str:
    for key, flag in _FLAG_NAMES:
        message = message.replace(key, flag)
    return message
