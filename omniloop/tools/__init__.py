"""Tools the model can call: `@tool`, the `Toolset` that runs them, the Hermes/Qwen parser,
and the built-in sandbox tools."""

from omniloop.tools.base import (
    DEFAULT_MAX_OUTPUT_CHARS,
    DEFAULT_TOOL_TIMEOUT,
    FunctionTool,
    SanitizedOutput,
    Tool,
    ToolArgumentError,
    ToolContext,
    ToolErrorCode,
    ToolResult,
    Toolset,
    render_result,
    sanitize_output,
    tool,
    tool_call_metrics,
)
from omniloop.tools.builtin import BUILTIN_TOOLS, bash, python, read_file, write_file
from omniloop.tools.parser import (
    ParsedCall,
    ParseResult,
    format_tool_call,
    format_tool_schemas,
    parse_tool_calls,
)

__all__ = [
    "BUILTIN_TOOLS",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "DEFAULT_TOOL_TIMEOUT",
    "FunctionTool",
    "ParseResult",
    "ParsedCall",
    "SanitizedOutput",
    "Tool",
    "ToolArgumentError",
    "ToolContext",
    "ToolErrorCode",
    "ToolResult",
    "Toolset",
    "bash",
    "format_tool_call",
    "format_tool_schemas",
    "parse_tool_calls",
    "python",
    "read_file",
    "render_result",
    "sanitize_output",
    "tool",
    "tool_call_metrics",
    "write_file",
]
