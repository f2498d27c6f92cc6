"""OpenAI ``response_format`` and ``tools`` / ``tool_choice`` mapped onto structured outputs.

* ``response_format``: ``{"type": "json_object"}`` -> any JSON object; ``{"type": "json_schema",
  "json_schema": {"name", "schema"}}`` -> that schema; ``{"type": "text"}`` -> no constraint.
* ``tool_choice`` "required": the output is constrained to a JSON array of calls
  ``[{"name": <a tool>, "arguments": {...its parameters schema...}}]`` (one call unless
  ``parallel_tool_calls`` is true); a named tool: the output is constrained to that tool's
  parameters; "auto": unconstrained, and an output that happens to be such an array of valid calls
  becomes ``tool_calls`` (there is no model-specific tool-call parser here); "none": no tools.
"""
from __future__ import annotations

import json
import uuid

from asyncengine.structured import StructuredOutputsParams

from .errors import APIError


def response_format_params(fmt: dict | None) -> StructuredOutputsParams | None:
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                           param="response_format.json_schema")
        return StructuredOutputsParams(json=js.get("schema") or {"type": "object"})
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   param="response_format.type")


def _tools_by_name(tools: list[dict]) -> dict[str, dict]:
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                "'parameters': {...}}}}", param=f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        out[fn["name"]] = params
    return out


class ToolPlan:
    """How one chat request's tools shape its sampling and its response."""

    def __init__(self, tools: list[dict] | None, tool_choice, parallel: bool | None) -> None:
        self.tools = _tools_by_name(tools) if tools else {}
        self.mode = "none"
        self.named: str | None = None
        self.parallel = bool(parallel) if parallel is not None else False
        if not self.tools:
            if tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return
        if tool_choice is None or tool_choice == "auto":
            self.mode = "auto"
        elif tool_choice == "none":
            self.mode = "none"
        elif tool_choice == "required":
            self.mode = "required"
        elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
            name = tool_choice["function"].get("name")
            if name not in self.tools:
                raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
            self.mode, self.named = "named", name
        else:
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")

    def calls_schema(self) -> dict:
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for n, p in self.tools.items()]}
        arr = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            arr["maxItems"] = 1
        return arr

    def structured(self) -> StructuredOutputsParams | None:
        if self.mode == "required":
            return StructuredOutputsParams(json=self.calls_schema())
        if self.mode == "named":
            return StructuredOutputsParams(json=self.tools[self.named])
        return None

    def tool_calls(self, text: str) -> list[dict] | None:
        """The output as OpenAI tool_calls, or None (plain content)."""
        if self.mode == "none":
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            calls = [{"name": self.named, "arguments": data}]
        else:
            if isinstance(data, dict):
                data = [data]
            if not isinstance(data, list) or not data or not all(
                    isinstance(c, dict) and c.get("name") in self.tools and "arguments" in c for c in data):
                return None
            calls = data
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in calls]
