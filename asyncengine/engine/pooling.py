"""Embedding requests as the front end builds them: each input runs as an ordinary request whose
SamplingParams carry a PoolingSpec and ``max_tokens=1``, so it shares the scheduler and the
batches with generation, takes no decode step (it finishes with the token sampled at the end of
its prompt, which is dropped) and frees its KV like any finished request. Its embedding arrives
in ``RequestOutput.embedding`` (worker/pooling.py computes it)."""
from __future__ import annotations

from asyncengine.engine.scoring import token_ids
from asyncengine.errors import InvalidRequestError
from asyncengine.pooling_params import PoolingSpec
from asyncengine.sampling_params import OutputKind, SamplingParams

DEFAULT_POOLING = "last"  # decoder embedding models (Qwen3-Embedding, e5-mistral): the last token


def embed_inputs(inputs) -> list:
    """The inputs as a list: one text or one list of token ids is a batch of one."""
    if isinstance(inputs, str) or (isinstance(inputs, dict) and "prompt_token_ids" in inputs):
        return [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(t, int) for t in inputs):
        return [list(inputs)]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidRequestError("embed needs a text, a list of token ids, or a non-empty list of them")
    return list(inputs)


def embed_params(pooling: str | None = None, normalize: bool = True, dimensions: int | None = None) -> SamplingParams:
    """The params of one embedding request (validated: a bad pooling or dimensions is a 400)."""
    spec = PoolingSpec(pooling or DEFAULT_POOLING, bool(normalize), dimensions).validated()
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                          output_kind=OutputKind.FINAL_ONLY, pooling=spec)


def embed_requests(tokenizer, inputs, pooling=None, normalize=True, dimensions=None) -> list[tuple[dict, SamplingParams]]:
    """(prompt for generate, params) per input; text goes through the tokenizer with its special tokens."""
    params = embed_params(pooling, normalize, dimensions)
    out = []
    for x in embed_inputs(inputs):
        ids = token_ids(tokenizer, x, "input", special=True)
        if not ids:
            raise InvalidRequestError("embed needs a non-empty input")
        out.append(({"prompt_token_ids": ids}, params))
    return out
