"""Building a run's `Agent` from its rollout config section (`rollout.tools`, `rollout.environment`,
`rollout.tool_format`, the agent's limits `rollout.max_turns` ... (`AgentLimits`), `rollout.tool_workers`,
`rollout.sandbox`, `rollout.openenv`), shared by `posttrain rl`, `eval` and `generate`. The environment is a class
(`file.py:Class`, `module:Class`) or an OpenEnv server (`openenv:URL`, `posttrain.agent.env_openenv`). Every problem
is a one-line `ConfigError` naming the key (or the file) at fault."""

from __future__ import annotations

from posttrain.agent.env_classes import load_environment
from posttrain.agent.env_openenv import PREFIX as OPENENV, OpenEnvConfig, load_openenv
from posttrain.agent.environments import EnvironmentSpec
from posttrain.agent.rollout import Agent
from posttrain.agent.templates import TemplateError
from posttrain.config import ConfigError
from posttrain.tools import ToolPool, load_tools
from posttrain.tools.python_sandbox import SandboxUnavailable, check_sandbox

__all__ = ["agent_enabled", "build_agent", "load_agent_parts"]


def agent_enabled(rollout) -> bool:
    """Whether the rollout section asks for our agent's multi-turn rollouts (tools or an environment; a verifiers
    environment, `verifiers:...`, runs its own rollouts: `posttrain.rollout.verifiers_env`)."""
    env = (rollout.environment or "").strip()
    return bool(rollout.tools) or (bool(env) and not env.startswith("verifiers:"))


def load_agent_parts(rollout) -> tuple[dict, EnvironmentSpec | None]:
    """The configured tools and environment class, loaded and checked (before any model loads)."""
    tools = load_tools(list(rollout.tools or []), key="rollout.tools")
    env = _load_env(rollout) if rollout.environment else None
    if env is not None:
        clash = sorted(set(tools) & set(env.tool_names))
        if clash:
            raise ConfigError(f"rollout.tools: {clash} also named as methods of the environment {env.ref!r}")
    if "python" in set(tools) | set(env.tool_names if env is not None else ()):
        try:  # model-written code runs only where the chosen sandbox can: never a silent downgrade
            check_sandbox(rollout.sandbox)
        except SandboxUnavailable as e:
            raise ConfigError(f"rollout.sandbox.backend: {e}") from None
    return tools, env


def _load_env(rollout) -> EnvironmentSpec:
    """The environment `rollout.environment` names: an OpenEnv server (`openenv:URL`) or a class."""
    ref = rollout.environment.strip()
    if ref.startswith(OPENENV):
        try:
            return load_openenv(ref, getattr(rollout, "openenv", None) or OpenEnvConfig())
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return load_environment(ref, key="rollout.environment")


def build_agent(rollout, tokenizer, *, system_prompt: str | None = None, prompt_field: str = "prompt",
                parts: tuple[dict, EnvironmentSpec | None] | None = None) -> Agent:
    """The `Agent` of a rollout section for `tokenizer` (its chat template checked for tools and appends), with the
    section's limits (the trajectory budget resolved for its `max_new_tokens` turns)."""
    tools, env = parts if parts is not None else load_agent_parts(rollout)
    key = "rollout.environment" if env is not None and not tools else "rollout.tools"
    try:
        return Agent(tokenizer, tools=tools, environment=env, fmt=rollout.tool_format,
                     limits=rollout.limits(rollout.max_new_tokens),
                     stop_ids=rollout.stop_token_ids, system_prompt=system_prompt, prompt_field=prompt_field,
                     pool=ToolPool(num_workers=rollout.tool_workers, sandbox=rollout.sandbox))
    except TemplateError as e:
        raise ConfigError(f"{key}: {' '.join(str(e).split())}") from None
