"""The structured-output fields clients send, mapped onto one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (chat, completions and websocket chat frames), and vLLM's: the
``structured_outputs`` object ({json, regex, choice, grammar, json_object}) and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` / ``guided_json_object``
fields (clients send them with ``extra_body``). A request gives at most one of them. What we do
not implement (``structural_tag``, ``guided_whitespace_pattern``, a backend other than xgrammar,
...) is a 400 naming the field: a client that asked for a constraint never gets unconstrained
output in silence.
"""
from __future__ import annotations

from typing import Any

from asyncengine.config.request_limits import RequestLimitError
from asyncengine.errors import InvalidRequestError
from asyncengine.structured import StructuredOutputsParams

from ..tool_calls import response_format_params
from .errors import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_json_object": "json_object"}
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options we accept at these values (their defaults, or what we do anyway)
_SO_OPTIONS = {"disable_fallback": (None, False, True), "disable_additional_properties": (None, False),
               "whitespace_pattern": (None,), "structural_tag": (None,)}
_BACKENDS = (None, "", "auto", "xgrammar")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _from_structured_outputs(so: Any) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise _bad("structured_outputs must be an object with one of json, regex, choice, grammar, json_object",
                   "structured_outputs")
    kw: dict = {}
    for k, v in so.items():
        if k in _SO_KINDS:
            if v is not None and v is not False:
                kw[k] = v
        elif k == "disable_any_whitespace":
            if v is not None:
                kw["any_whitespace"] = not v
        elif k in _SO_OPTIONS:
            if v not in _SO_OPTIONS[k]:
                raise _bad(f"structured_outputs.{k} is not supported (got {v!r})", f"structured_outputs.{k}")
        else:
            raise _bad(f"structured_outputs.{k} is not a field we know (json, regex, choice, grammar, "
                       "json_object, disable_any_whitespace)", f"structured_outputs.{k}")
    return _params(kw, "structured_outputs")


def _params(kw: dict, param: str) -> StructuredOutputsParams:
    if "json" in kw and not isinstance(kw["json"], (str, dict)):
        raise _bad(f"{param}: json must be a JSON schema (an object or its text)", param)
    for k in ("regex", "grammar"):
        if k in kw and not isinstance(kw[k], str):
            raise _bad(f"{param}: {k} must be a string", param)
    if "choice" in kw and not isinstance(kw["choice"], list):
        raise _bad(f"{param}: choice must be a list of strings", param)
    if "json_object" in kw and kw["json_object"] is not True:
        raise _bad(f"{param}: json_object must be true", param)
    if "any_whitespace" in kw and not isinstance(kw["any_whitespace"], bool):
        raise _bad(f"{param}: disable_any_whitespace must be a boolean", param)
    try:
        return StructuredOutputsParams(**kw)
    except InvalidRequestError as e:
        raise _bad(str(e), param) from None


def requested(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's structured output or None, the field it came from). 400 for two at once, a
    malformed one, or an option we do not implement."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        try:
            so = response_format_params(fmt)
        except RequestLimitError as e:
            raise APIError(400, str(e), param=e.param) from None
        if so is not None:
            found.append((so, "response_format"))
    if req.structured_outputs is not None:
        found.append((_from_structured_outputs(req.structured_outputs), "structured_outputs"))
    guided = {f: getattr(req, f) for f in _GUIDED if getattr(req, f) not in (None, False)}
    if guided:
        kw = {_GUIDED[f]: v for f, v in guided.items()}
        name = next(iter(guided))
        if len(guided) > 1:
            raise _bad(f"give one of {', '.join(guided)}, not several", name)
        if req.guided_whitespace_pattern is None and "json" in kw:
            kw["any_whitespace"] = False
        found.append((_params(kw, name), name))
    if req.guided_decoding_backend not in _BACKENDS:
        raise _bad(f"guided_decoding_backend {req.guided_decoding_backend!r} is not supported: structured "
                   "outputs run on xgrammar here", "guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise _bad("guided_whitespace_pattern is not supported (JSON is compact: no free whitespace)",
                   "guided_whitespace_pattern")
    if req.structural_tag is not None:
        raise _bad("structural_tag is not supported", "structural_tag")
    if len(found) > 1:
        raise _bad(f"give one of {', '.join(n for _, n in found)}, not several", found[1][1])
    return found[0] if found else (None, None)
