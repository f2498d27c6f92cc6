"""OpenAI ``response_format`` and ``tools`` / ``tool_choice`` mapped onto structured outputs.

Both live in ``asyncengine.integrations.tool_calls``, shared with the framework adapters (the tools'
system prompt, the call grammar, parsing the calls); their errors name the request field (a 400).
"""
from __future__ import annotations

from ..tool_calls import ToolPlan, response_format_params

__all__ = ["ToolPlan", "response_format_params"]
