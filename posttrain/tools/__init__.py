"""Tools a model can call during a rollout: loading them by reference (with their JSON schemas), the built-in
`calculator` and `python` tools, and running calls in worker processes with time and output limits."""

from posttrain.tools.calculator import calculator
from posttrain.tools.execution import ERROR_KINDS, ToolCall, ToolPool, ToolRecord, run_tool_call, tool_message
from posttrain.tools.loading import BUILTIN_TOOLS, Tool, load_tool, load_tools, tool_from_callable
from posttrain.tools.python_sandbox import python

__all__ = ["BUILTIN_TOOLS", "ERROR_KINDS", "Tool", "ToolCall", "ToolPool", "ToolRecord", "calculator",
           "load_tool", "load_tools", "python", "run_tool_call", "tool_from_callable", "tool_message"]
