"""The multi-turn flags `posttrain eval`, `generate` and `chat` share (`--tools`, `--environment`, limits): they
set the runs' `AgentOptions` (`posttrain.rollout.config`), which fill the rollout section `posttrain rl` reads, so
the commands run the same multi-turn rollout (`posttrain.agent`)."""

from __future__ import annotations

import argparse
import dataclasses

# the agent's limits: flag, its `AgentLimits` key (an `AgentOptions` field), type, help
LIMIT_OPTIONS = (("--max-turns", "max_turns", int, "assistant turns per conversation at most"),
                 ("--max-tool-calls", "max_tool_calls", int, "tool calls per conversation at most"),
                 ("--max-tool-output-tokens", "max_tool_output_tokens", int,
                  "a tool result is cut after this many tokens"),
                 ("--tool-timeout", "tool_timeout_s", float, "seconds per tool call"))


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn rollouts (tools or an environment)")
    g.add_argument("--tools", default=None,
                   help="comma-separated tools: calculator, python, module:function or file.py:function")
    g.add_argument("--environment", default=None,
                   help="environment: a class (module:Class or file.py:Class), an OpenEnv server (openenv:URL) or a "
                        "verifiers environment (verifiers:NAME_OR_FILE)")
    g.add_argument("--environment-args", default=None,
                   help="a verifiers environment's load_environment arguments, a JSON object")
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


def options(cls, args: argparse.Namespace):
    """The run config `cls` (a dataclass whose fields are named as the command's flags) of parsed flags."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
