"""vLLM's /tokenize and /detokenize: the token ids a text or a conversation becomes here (the
conversation through the same template, tools and ``chat_template_kwargs`` as a chat request), and
the text token ids decode to. Bounded as prompts are (characters, max_model_len)."""
from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from asyncengine.errors import InvalidRequestError

from .chat import ChatPlan
from .errors import APIError
from .protocol import DetokenizeRequest, TokenizeRequest
from .state import json_response as _json, server_state as _state


def _tokenizer(st):
    tok = st.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    return tok


async def tokenize(request: Request) -> Response:
    st = _state(request)
    req: TokenizeRequest = await st.read_json(request, TokenizeRequest)
    st.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    tok = _tokenizer(st)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if req.prompt is not None:
        cap = st.limits.prompt_chars(st.max_model_len)
        if len(req.prompt) > cap:
            raise APIError(400, f"the prompt's length (characters) is over the limit max_prompt_chars={cap}",
                           param="prompt", code="limit_exceeded")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        try:
            ids = await asyncio.to_thread(lambda: tok(req.prompt, add_special_tokens=special)["input_ids"])
        except Exception as e:  # e.g. a lone surrogate: not text the tokenizer can encode
            raise APIError(400, f"the prompt cannot be tokenized: {type(e).__name__}", param="prompt") from None
    else:
        if not req.add_generation_prompt or req.add_special_tokens:
            raise APIError(400, "messages are rendered as a chat request is: with the generation prompt, "
                                "the template's own special tokens", param="add_generation_prompt")
        plan = ChatPlan(st, req)
        ids = await plan.prompt(st, req.messages)
    out = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": list(ids), "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(list(ids))
    return _json(out)


async def detokenize(request: Request) -> Response:
    st = _state(request)
    req: DetokenizeRequest = await st.read_json(request, DetokenizeRequest)
    st.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    tok = _tokenizer(st)
    if len(req.tokens) > st.max_model_len:
        raise APIError(400, f"at most max_model_len={st.max_model_len} tokens", param="tokens",
                       code="limit_exceeded")
    try:
        ids = st.engine.check_token_ids(req.tokens, "tokens")
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="tokens") from None
    return _json({"prompt": await asyncio.to_thread(tok.decode, ids)})
