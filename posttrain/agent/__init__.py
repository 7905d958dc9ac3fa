"""Multi-turn (agentic) rollouts: tool-call parsers per chat format, the token buffer of a trajectory, the
chat-template appender (token-in/token-out), environments behind one protocol (classes loaded by reference, their
instances in worker processes), and the driver the sampler calls at every turn end (`posttrain.agent.rollout`),
built from a run's rollout section by `posttrain.agent.setup`."""

from posttrain.agent.buffer import TokenBuffer
from posttrain.agent.env_classes import load_environment
from posttrain.agent.environments import (EnvCallError, EnvFailure, EnvironmentSpec, EnvSession, StepResult,
                                          trajectory_reward)
from posttrain.agent.rollout import Agent, AgentLimits, AgentRollout, Trajectory
from posttrain.agent.parsers import FORMATS, ParsedCalls, parse_error_messages, parse_tool_calls
from posttrain.agent.templates import ChatTemplateAppender, TemplateError, tool_response_text, tools_system_section

__all__ = ["FORMATS", "Agent", "AgentLimits", "AgentRollout", "ChatTemplateAppender", "Trajectory", "EnvCallError",
           "EnvFailure", "EnvSession", "EnvironmentSpec", "ParsedCalls", "StepResult",
           "TemplateError", "TokenBuffer", "load_environment", "parse_error_messages", "parse_tool_calls", "tool_response_text",
           "tools_system_section", "trajectory_reward"]
