"""Scoring a given completion: the logprob of each of its tokens after the prompt and the tokens
before it, read from the prompt logprobs of one request over prompt + completion (no token is
sampled for real: one is generated and dropped).

Why: an RL trainer needs the sampler's logprobs of a rollout and a reference to check them
against; in batch-invariant mode (layers/batch_invariant.py) the forward's bits do not depend on
the batch, the chunking or prefix hits, and the sampled token's raw logprob and this one are the
same ``log_softmax`` of the same logits row, so they are equal bitwise (docs/training.md has the
default mode's measured difference).
"""
from __future__ import annotations

from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams


def token_ids(tokenizer, x, what: str, special: bool) -> list[int]:
    """Token ids of ``x`` (a list of ints, or text through the tokenizer)."""
    if isinstance(x, str):
        if tokenizer is None:
            raise InvalidRequestError(f"a text {what} needs a tokenizer; pass token ids")
        return list(tokenizer.encode(x, add_special_tokens=special))
    if isinstance(x, dict) and "prompt_token_ids" in x:
        x = x["prompt_token_ids"]
    if not isinstance(x, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        raise InvalidRequestError(f"the {what} must be text or a list of token ids")
    return list(x)


def score_request(tokenizer, prompt, completion) -> tuple[dict, SamplingParams, int, int]:
    """(prompt for generate, params, prompt length, completion length) of the scoring request."""
    p = token_ids(tokenizer, prompt, "prompt", special=True)
    c = token_ids(tokenizer, completion, "completion", special=False)
    if not p or not c:
        raise InvalidRequestError("score needs a non-empty prompt and completion")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True,
                            output_kind=OutputKind.FINAL_ONLY)
    return {"prompt_token_ids": p + c}, params, len(p), len(c)


def completion_logprobs(out: RequestOutput, num_prompt: int, num_completion: int) -> list[float]:
    """The completion's tokens' logprobs, from the scoring request's prompt logprobs."""
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs
    return [lps[i][ids[i]].logprob for i in range(num_prompt, num_prompt + num_completion)]
