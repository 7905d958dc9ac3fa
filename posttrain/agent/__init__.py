"""Building blocks of multi-turn (agentic) rollouts: tool-call parsers per chat format, the token buffer of a
trajectory, the chat-template appender (token-in/token-out), and environments loaded by reference.
The rollout loop that drives them (sampler slots, RL integration) is not wired in yet."""

from posttrain.agent.buffer import TokenBuffer
from posttrain.agent.environments import EnvironmentSpec, EnvSession, StepResult, load_environment, trajectory_reward
from posttrain.agent.parsers import FORMATS, ParsedCalls, parse_error_messages, parse_tool_calls
from posttrain.agent.templates import ChatTemplateAppender, TemplateError, tool_response_text, tools_system_section

__all__ = ["FORMATS", "ChatTemplateAppender", "EnvSession", "EnvironmentSpec", "ParsedCalls", "StepResult",
           "TemplateError", "TokenBuffer", "load_environment", "parse_error_messages", "parse_tool_calls", "tool_response_text",
           "tools_system_section", "trajectory_reward"]
