"""EngineClient: what a caller of an engine may use, and nothing else (as vLLM's EngineClient).

The OpenAI server, the LangChain and LlamaIndex adapters, the anyio bridge and the CLI talk to this
interface; ``AsyncLLMEngine`` (one core: in this process, in its own, data-parallel cores, Ray
actors) and ``PDEngine`` (prefill and decode cores) implement it, and
``AsyncLLMEngine.from_config`` returns the one a config asks for. What is the same for all of them
is written here once (``complete``, ``async with``); tests/package/test_engine_client.py checks that
every front end implements the rest with the same parameters."""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.config.request_limits import RequestLimits
from asyncengine.engine import validation
from asyncengine.engine.pooling import embed_requests, relevance, rerank_requests
from asyncengine.engine.prompt_intake import check_params
from asyncengine.errors import InvalidRequestError
from asyncengine.lora_request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

# what generate() returns: the request's outputs as they come (closing it early aborts the request)
OutputStream = AsyncIterator[RequestOutput]


class EngineClient(ABC):
    # plain attributes or properties, as each front end prefers
    config: EngineConfig
    tokenizer: Any  # the model's tokenizer (a tokenizers.Tokenizer or a transformers one)
    limits: RequestLimits  # what one request may cost (the server checks bodies against it)
    default_sampling_params: SamplingParams  # the checkpoint's generation config, else ours

    # ------------------------------------------------------------------ the model's facts

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> str: ...

    @property
    @abstractmethod
    def kernels(self) -> str:
        """What runs the model, for the ready line."""

    @property
    @abstractmethod
    def supported_tasks(self) -> tuple[str, ...]:
        """What the model serves: "generate", "embed", "classify" (models/pooling_models.py)."""

    @property
    @abstractmethod
    def default_pooling(self) -> str:
        """How ``embed`` pools when the caller names no pooling (the checkpoint's, else by kind)."""

    # ------------------------------------------------------------------ health

    @property
    @abstractmethod
    def errored(self) -> bool: ...

    @property
    @abstractmethod
    def is_closing(self) -> bool: ...

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine runs on (other threads reach it through this loop)."""

    @abstractmethod
    def cores_alive(self) -> tuple[int, int]:
        """(engine cores alive, engine cores)."""

    @abstractmethod
    def stats(self) -> dict: ...

    # ------------------------------------------------------------------ lifecycle

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self, drain: bool = True) -> None: ...

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown(drain=False)

    # ------------------------------------------------------------------ requests

    def check_messages(self, messages: list[dict]) -> list[dict]:
        """A chat's messages by the engine's rules (roles, contents, sizes: engine/validation.py),
        so that a server checks them as an in-process caller is checked. Raises RequestLimitError."""
        return validation.check_messages(messages, self.limits, self.max_model_len)

    def check_token_ids(self, ids, what: str = "prompt token ids") -> list[int]:
        """Token ids as ints inside the vocabulary. Raises InvalidRequestError naming ``what``."""
        return validation.check_token_ids(ids, self.vocab_size, what)

    @abstractmethod
    def check_sampling_params(self, params: SamplingParams) -> SamplingParams: ...

    @abstractmethod
    async def check_structured_outputs(self, params: SamplingParams) -> SamplingParams: ...

    @abstractmethod
    async def encode(self, prompt) -> tuple[str | None, list[int]]: ...

    @abstractmethod
    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> OutputStream: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    # ------------------------------------------------------------------ named LoRA adapters
    # (docs/lora.md; written once in engine/lora_registry.py: the server's ``model`` names)

    @abstractmethod
    async def add_lora(self, name: str, path: str) -> LoRARequest: ...

    @abstractmethod
    async def remove_lora(self, name: str) -> bool: ...

    @abstractmethod
    def list_loras(self) -> list[LoRARequest]: ...

    @abstractmethod
    def get_lora(self, name: str) -> LoRARequest | None: ...

    # ------------------------------------------------------------------ a trainer's controls
    # (docs/training.md; AsyncLLMEngine's in engine/trainer_api.py, PDEngine's over both sides)

    @property
    @abstractmethod
    def weights_version(self) -> int:
        """0 as loaded, +1 per update_weights (every RequestOutput carries its tokens' versions)."""

    @property
    @abstractmethod
    def is_paused(self) -> bool: ...

    @property
    @abstractmethod
    def is_sleeping(self) -> bool: ...

    @abstractmethod
    async def update_weights(self, weights, *, partial: bool = False) -> int: ...

    @abstractmethod
    async def reset_prefix_cache(self) -> None: ...

    @abstractmethod
    async def pause_generation(self, mode: str = "abort") -> None: ...

    @abstractmethod
    async def resume_generation(self) -> None: ...

    @abstractmethod
    async def sleep(self, level: int = 1) -> None: ...

    @abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def score(self, prompt, completion) -> list[float]:
        """The logprob of each completion token after ``prompt`` (engine/scoring.py; token ids
        or text): in batch-invariant mode, bitwise the sampler's logprobs of the same tokens."""
        from asyncengine.engine.scoring import completion_logprobs, score_request  # lazy: loaded on first use of this rarely used call

        req, params, n_prompt, n_completion = score_request(self.tokenizer, prompt, completion)
        return completion_logprobs(await self.complete(req, params), n_prompt, n_completion)

    async def embed(self, inputs, pooling: str | None = None, normalize: bool = True,
                    dimensions: int | None = None) -> list[list[float]]:
        """One embedding per input (a text or token ids, or a list of them; engine/pooling.py):
        each a request through the same scheduler and batches as generation."""
        reqs = embed_requests(self.tokenizer, inputs, pooling, normalize, dimensions, self.default_pooling)
        outs = await asyncio.gather(*(self.complete(p, params) for p, params in reqs))
        vectors = [o.embedding for o in outs]
        if dimensions is not None and vectors and len(vectors[0]) < dimensions:
            raise InvalidRequestError(f"dimensions={dimensions} exceeds the model's embedding size {len(vectors[0])}")
        return vectors

    async def rerank(self, query, documents) -> list[float]:
        """Relevance in (0, 1) of each document to ``query`` (or of each query to its document,
        pairwise, when ``query`` is a list), by a cross-encoder (engine/pooling.py): each pair a
        request through the scheduler; in the documents' order. Not ``score``: that name is the
        trainer API's logprob scoring."""
        reqs = rerank_requests(self.tokenizer, query, documents, self.max_model_len, self.default_pooling)
        outs = await asyncio.gather(*(self.complete(p, params) for p, params in reqs))
        return [relevance(o.embedding) for o in outs]

    async def complete(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, **kw) -> RequestOutput:
        """Run one request to the end and return its final output."""
        params = msgspec.structs.replace(check_params(sampling_params), output_kind=OutputKind.FINAL_ONLY)
        final = None
        async for out in self.generate(prompt, params, request_id, **kw):
            final = out
        return final
