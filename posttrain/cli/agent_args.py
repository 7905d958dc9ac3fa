"""The multi-turn options `posttrain eval` and `posttrain generate` share (`--tools`, `--environment`, limits):
they fill the same rollout section `posttrain rl` reads (`rollout.tools`, `rollout.environment`, ...), so the
three commands run the same multi-turn rollout (`posttrain.agent`). A limit left unset keeps the section's
default (`posttrain.agent.rollout.AgentLimits`: the one place the defaults are)."""

from __future__ import annotations

import argparse

from posttrain.config import ConfigError

# the agent's limits: option, its `AgentLimits` key, type, help
LIMIT_OPTIONS = (("--max-turns", "max_turns", int, "assistant turns per conversation at most"),
                 ("--max-tool-calls", "max_tool_calls", int, "tool calls per conversation at most"),
                 ("--max-tool-output-tokens", "max_tool_output_tokens", int, "a tool result is cut after this many tokens"),
                 ("--tool-timeout", "tool_timeout_s", float, "seconds per tool call"))


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn rollouts (tools or an environment)")
    g.add_argument("--tools", default=None,
                   help="comma-separated tools: calculator, python, module:function or file.py:function")
    g.add_argument("--environment", default=None,
                   help="environment: a class (module:Class or file.py:Class) or an OpenEnv server (openenv:URL)")
    g.add_argument("--openenv-action-field", default=None,
                   help="an OpenEnv environment's action field that holds the model's turn (default: message)")
    g.add_argument("--openenv-observation-field", default=None,
                   help="an OpenEnv observation's field that is the next user turn (default: its text field)")
    g.add_argument("--tool-format", default="hermes", choices=["hermes", "llama3", "mistral"],
                   help="how the model writes tool calls (default: hermes <tool_call>)")
    for flag, key, kind, text in LIMIT_OPTIONS:
        g.add_argument(flag, dest=key, type=kind, default=None, help=f"{text} (default: the rollout section's)")
    g.add_argument("--sandbox", default="namespaces", choices=["namespaces", "remote", "process"],
                   help="where the python tool runs model-written code: this kernel's namespaces (default), a "
                        "SandboxFusion service (--sandbox-url), or an unsafe plain process")
    g.add_argument("--sandbox-url", default=None, help="the SandboxFusion service's address, with --sandbox remote")


def rollout_section(args):
    """The rollout config section of the options (validated as `posttrain rl` validates it)."""
    from posttrain.agent.env_openenv import OpenEnvConfig
    from posttrain.rl.config import RolloutConfig
    from posttrain.tools.python_sandbox import SandboxConfig

    tools = [t.strip() for t in args.tools.split(",") if t.strip()] if args.tools else []
    openenv = {k: v for k, v in (("action_field", args.openenv_action_field),
                                 ("observation_field", args.openenv_observation_field)) if v is not None}
    try:
        return RolloutConfig(tools=tools, environment=args.environment, tool_format=args.tool_format,
                             sandbox=SandboxConfig(backend=args.sandbox, url=args.sandbox_url),
                             openenv=OpenEnvConfig(**openenv),
                             **{key: getattr(args, key) for _, key, _, _ in LIMIT_OPTIONS
                                if getattr(args, key) is not None})
    except ValueError as e:
        msg = (str(e).replace("rollout.sandbox.backend", "--sandbox").replace("rollout.sandbox.url", "--sandbox-url")
               .replace("rollout.tool_timeout_s", "--tool-timeout").replace("rollout.openenv.", "--openenv-"))
        raise ConfigError(msg.replace("rollout.", "--").replace("_", "-")) from None


def check_agent(args):
    """`(rollout section, loaded tools and environment)`, or None without --tools/--environment; runs before
    any model loads, so a bad reference fails at once."""
    from posttrain.agent.setup import agent_enabled, load_agent_parts

    section = rollout_section(args)
    if not agent_enabled(section):
        return None
    try:
        return section, load_agent_parts(section)
    except ConfigError as e:
        msg = (str(e).replace("rollout.tools", "--tools").replace("rollout.environment", "--environment")
               .replace("rollout.sandbox.backend", "--sandbox").replace("rollout.sandbox.url", "--sandbox-url"))
        raise ConfigError(msg) from None


def make_agent(checked, tokenizer, *, system_prompt=None, prompt_field="prompt"):
    """The `Agent` of `check_agent`'s result for the loaded tokenizer (None: single-turn)."""
    if checked is None:
        return None
    from posttrain.agent.setup import build_agent

    section, parts = checked
    return build_agent(section, tokenizer, system_prompt=system_prompt, prompt_field=prompt_field, parts=parts)
