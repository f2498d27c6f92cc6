"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex, a
choice among strings or an EBNF grammar, by xgrammar token bitmasks (docs/structured_outputs.md
says why xgrammar). ``StructuredOutputsParams`` is vLLM's shape; :mod:`.backend` compiles (cached by
text) and runs the per-request matchers in the model runner."""
from asyncengine.structured_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
