"""Tool calling and response formats over structured outputs, shared by every front end (the
OpenAI server, the LangChain and LlamaIndex adapters).

There is no model-specific tool-call format here: the model is told about the tools in a system
message (:func:`tools_prompt`) and answers a call as the JSON array
``[{"name": <a tool>, "arguments": {...}}]``. ``tool_choice``:

* "required" (LangChain: "any"): the output is constrained to that array (one call unless
  parallel calls are allowed), so even a model that ignores the prompt produces valid calls;
* a named tool: the output is constrained to that tool's parameters;
* "auto": unconstrained; an output that happens to be such an array of valid calls is a call;
* "none": no tools.

Answers are read by ``chat_parsers`` (:meth:`ToolPlan.output_parser`), as the servers read them.
Errors are :class:`RequestLimitError` naming the field (a 400 at the server, a ValueError elsewhere).
"""
from __future__ import annotations

import json

from asyncengine.config.request_limits import RequestLimitError
from asyncengine.structured import StructuredOutputsParams

from .chat_parsers import OutputParser, tool_format


def response_format_params(fmt: dict | None) -> StructuredOutputsParams | None:
    """OpenAI ``response_format``: ``{"type": "json_object"}`` -> any JSON object; ``{"type":
    "json_schema", "json_schema": {"name", "schema"}}`` -> that schema; ``{"type": "text"}`` -> none."""
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
            raise RequestLimitError("response_format.json_schema must be an object with a 'schema' object",
                                    param="response_format.json_schema")
        return StructuredOutputsParams(json=js.get("schema") or {"type": "object"})
    raise RequestLimitError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                            param="response_format.type")


def tools_by_name(tools: list[dict]) -> dict[str, dict]:
    """OpenAI-format tools -> {name: parameters schema}."""
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise RequestLimitError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                    "'parameters': {...}}}}", param=f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise RequestLimitError(f"tools[{i}].function.parameters must be a JSON schema object",
                                    param=f"tools[{i}].function.parameters")
        out[fn["name"]] = params
    return out


class ToolPlan:
    """How one chat request's tools shape its prompt, its sampling and its response."""

    def __init__(self, tools: list[dict] | None, tool_choice, parallel: bool | None = None) -> None:
        self.specs = list(tools or [])
        self.tools = tools_by_name(self.specs) if self.specs else {}
        self.mode = "none"
        self.named: str | None = None
        self.parallel = bool(parallel) if parallel is not None else False
        if not self.tools:
            if tool_choice not in (None, "none", "auto"):
                raise RequestLimitError("tool_choice needs tools", param="tool_choice")
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
                raise RequestLimitError(f"tool_choice names {name!r}, which is not among the tools",
                                        param="tool_choice")
            self.mode, self.named = "named", name
        else:
            raise RequestLimitError("tool_choice must be 'none', 'auto', 'required' or "
                                    "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")

    @property
    def forced(self) -> bool:
        """The output is a call by construction (the grammar allows nothing else)."""
        return self.mode in ("required", "named")

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

    def prompt(self) -> str | None:
        """The system text that tells the model about the tools (None: no tools in play)."""
        if self.mode == "none":
            return None
        return tools_prompt(self.specs, self.named)

    def output_parser(self, tool_parser: str = "json_array", reasoning=None) -> OutputParser:
        """A parser of one answer (``chat_parsers``, the one every front end reads with): a named
        tool's output is its arguments, "required" is the call array the grammar forces, "auto"
        is read in ``tool_parser``'s format (calls only of known tools in the JSON array)."""
        if self.mode == "named":
            return OutputParser(None, reasoning, named=self.named)
        if self.mode == "required":
            return OutputParser(tool_format("json_array", set(self.tools)), reasoning)
        if self.mode == "auto":
            return OutputParser(tool_format(tool_parser, set(self.tools)), reasoning)
        return OutputParser(None, reasoning)


def tools_prompt(tools: list[dict], named: str | None = None) -> str:
    """How the model learns the tools and the call format (a system message)."""
    lines = ["You can call these tools (JSON schema of each tool's arguments):"]
    for t in tools:
        fn = t["function"]
        desc = f": {fn['description']}" if fn.get("description") else ""
        lines.append(f"- {fn['name']}{desc} {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}")
    if named:
        lines.append(f"Call the tool {named}: answer with its arguments as one JSON object.")
    else:
        lines.append('To call tools, answer with only a JSON array: [{"name": "<tool>", "arguments": {...}}]. '
                     "Otherwise answer in plain text.")
    return "\n".join(lines)


def with_tools_prompt(messages: list[dict], text: str | None) -> list[dict]:
    """``messages`` with the tools' system text added to the first system message (or as one)."""
    if not text:
        return messages
    if messages and messages[0].get("role") in ("system", "developer") and isinstance(messages[0].get("content"), str):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def calls_text(calls: list[dict]) -> str:
    """Earlier calls (``{"name", "arguments": dict}``) as the assistant wrote them: the prompt's format."""
    return json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls], ensure_ascii=False)


def openai_history(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages with earlier tool use -> the engine's: an assistant turn's
    ``tool_calls`` (arguments as JSON strings) are appended to its text in the format the model is
    asked to call in (:func:`calls_text`), so the model sees what it called; ``tool_calls`` and
    ``tool_call_id`` are dropped (``tool`` turns keep their content). Malformed calls are a
    :class:`RequestLimitError` naming the field."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not calls:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
                       if isinstance(m, dict) else m)
            continue
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise RequestLimitError(f"messages[{i}].tool_calls is only allowed on assistant messages, as a list",
                                    param=f"messages[{i}].tool_calls")
        parsed = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestLimitError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                                        "'arguments': '<JSON>'}}}}", param=where)
            args = fn.get("arguments") or "{}"
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise RequestLimitError(f"{where}.function.arguments is not valid JSON",
                                        param=f"{where}.function.arguments") from None
            parsed.append({"name": fn["name"], "arguments": args})
        out.append(assistant_turn(m.get("content") if isinstance(m.get("content"), str) else "", parsed))
    return out


def assistant_turn(text: str, calls: list[dict]) -> dict:
    """An earlier assistant turn for the prompt: its text, then its calls (``{"name", "arguments":
    dict}``) as :func:`calls_text` writes them; every front end renders history this one way."""
    if not calls:
        return {"role": "assistant", "content": text}
    written = calls_text(calls)
    return {"role": "assistant", "content": f"{text}\n{written}" if text else written}

