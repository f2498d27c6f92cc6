"""LLM: the synchronous offline API, shaped like vLLM's so user code ports unchanged.

    from asyncengine import LLM, SamplingParams
    llm = LLM(model="path/or/name", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3], {"prompt_token_ids": [4, 5]}], SamplingParams(max_tokens=32))
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import msgspec
from tqdm.auto import tqdm

from typing import TYPE_CHECKING

from asyncengine.config import EngineConfig
from asyncengine.engine_core import gc_policy
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.engine.pooling import embed_requests, relevance, rerank_requests
from asyncengine.multimodal.processor import MultiModalProcessor
from asyncengine.engine.processor import InputProcessor, PromptType, check_lora_request
from asyncengine.errors import ConfigError, InvalidRequestError
from asyncengine.lora_request import LoRARequest
from asyncengine.models.pooling_models import check_request, default_pooling, supported_tasks
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from asyncengine.engine_core.core import EngineCore


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_options) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, **engine_options)
        if self.config.data_parallel_size > 1 or self.config.engine_core_process:
            raise ConfigError("data_parallel_size > 1 and engine_core_process run engine cores in their own "
                              "processes behind AsyncLLMEngine (or asyncengine serve); LLM drives one core "
                              "in this process")
        from asyncengine.engine_core.core import EngineCore  # lazy: the front end imports no torch until a core is built

        with gc_policy.paused(self.config.freeze_gc_after_load):  # engine_core/gc_policy.py
            self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._lora_folders: dict[int, str] = {}  # LoRA id -> its folder: one id never names two adapters
        self.processor = InputProcessor(self.tokenizer, self.engine.vocab_size, self.engine.max_model_len,
                                        self.engine.eos_token_ids, self.config.limits,
                                        self.engine.model_info.generation_config,
                                        mm=MultiModalProcessor.of(self.config.multimodal_config, self.engine.model_info,
                                                                  self.config.model_impl))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        info = self.engine.model_info  # what the model serves (an encoder: pooling only)
        self.supported_tasks = supported_tasks(info.hf_config, self.config.runner)
        self.default_pooling = default_pooling(info.hf_config, info.path)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the executor's workers (processes with ``mp``); also done at garbage collection."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        ``n > 1`` gives ``outputs[i]`` (``index`` i) per sample; the samples share the prompt's KV
        blocks (one prefill with prefix caching on). ``output_kind`` is ignored: outputs are final.

        Every prompt is validated before any runs, so a bad one raises InvalidRequestError naming
        it and nothing is left half-done in the engine. ``lora_request``: one adapter for every
        prompt, or one (or None: the base model) per prompt (needs ``enable_lora``; docs/lora.md)."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:  # e.g. a number: neither a prompt nor an iterable of prompts
            raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, "
                                      f"not {type(prompts).__name__}") from None
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [sampling_params] * len(prompts)  # None: the model's defaults (processor.resolve)
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError(f"{len(priority)} priorities for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        for lr in set(loras):
            check_lora_request(lr, self.config, self.engine.model_info.hf_config, self._lora_folders)
        if self.engine.asleep:
            raise InvalidRequestError(f"the engine is asleep ({', '.join(sorted(self.engine.asleep))}): "
                                      "wake_up() first")
        made = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if sp is None or isinstance(sp, SamplingParams):  # unset fields: the model's defaults
                sp = self.processor.resolve(sp)
            if isinstance(sp, SamplingParams):
                check_request(self.supported_tasks, sp)
            if isinstance(sp, SamplingParams) and sp.output_kind != OutputKind.FINAL_ONLY:
                # only the final outputs are returned: don't build the intermediate ones (vLLM too)
                sp = msgspec.structs.replace(sp, output_kind=OutputKind.FINAL_ONLY)
            try:
                if isinstance(sp, SamplingParams) and sp.structured_outputs is not None:
                    from asyncengine.structured.compile_service import prepare_blocking  # lazy: the front end imports no torch: core code loads only where it runs here
                    sp = prepare_blocking(self.config, self.engine, sp)
                req, text = self.processor.make_request(
                    f"llm-{next(self._ids)}", p, sp, priority=priority[i] if priority else 0, lora_request=loras[i])
            except InvalidRequestError as e:  # the same error (e.g. a RequestLimitError), naming the prompt
                e.args = (f"prompt #{i}: {e}",)
                raise e from None
            made.append((req, text))
        return self._run(made, use_tqdm)

    # ------------------------------------------------------------------ a trainer's controls

    @property
    def weights_version(self) -> int:
        """0 as loaded, +1 per update_weights; every RequestOutput carries the version of its tokens."""
        return self.engine.weights_version

    def update_weights(self, weights, *, partial: bool = False) -> int:
        """Replace the weights in place (AsyncLLMEngine.update_weights: a state_dict, (name,
        tensor) pairs or a safetensors path; all checked before anything changes; the prefix cache
        reset); returns the new weights_version."""
        return self.engine.update_weights(weights, partial)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.engine.asleep)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and packed weight copies (level 2: the weights too) until wake_up."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back ``tags`` (default both: "weights", "kv_cache"); level-2 weights are read from
        the checkpoint again (a new weights_version), unless a full update_weights filled them."""
        self.engine.wake_up(tags)

    def score(self, prompts, completions, use_tqdm: bool = False) -> list[float] | list[list[float]]:
        """The logprob of each completion token after its prompt (engine/scoring.py): one
        (prompt, completion) pair gives a list of floats, lists of them a list of lists. Token
        ids or text. In batch-invariant mode these equal, bitwise, the logprobs the sampler
        reported when it generated the same tokens."""
        from asyncengine.engine.scoring import completion_logprobs, score_request  # lazy: loaded on first use of this rarely used call

        single = _is_single_prompt(prompts)
        if not single and len(prompts) != len(completions):
            raise InvalidRequestError(f"{len(completions)} completions for {len(prompts)} prompts")
        pairs = [(prompts, completions)] if single else list(zip(prompts, completions))
        reqs = [score_request(self.tokenizer, p, c) for p, c in pairs]
        outs = self.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=use_tqdm)
        scores = [completion_logprobs(o, r[2], r[3]) for o, r in zip(outs, reqs)]
        return scores[0] if single else scores

    def embed(self, inputs, pooling: str | None = None, normalize: bool = True,
              dimensions: int | None = None, use_tqdm: bool = False) -> list[list[float]]:
        """One embedding per input (a text or token ids, or a list of them): pooled final hidden
        states (engine/pooling.py; default: the checkpoint's pooling, else the last token for a
        decoder, [CLS] for an encoder; L2-normalised)."""
        reqs = embed_requests(self.tokenizer, inputs, pooling, normalize, dimensions, self.default_pooling)
        outs = self.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=use_tqdm)
        vectors = [o.embedding for o in outs]
        if dimensions is not None and vectors and len(vectors[0]) < dimensions:
            raise InvalidRequestError(f"dimensions={dimensions} exceeds the model's embedding size {len(vectors[0])}")
        return vectors

    def rerank(self, query, documents, use_tqdm: bool = False) -> list[float]:
        """Relevance in (0, 1) of each document to ``query`` (pairwise when ``query`` is a list), by
        a cross-encoder: the documents' order (engine/pooling.py). ``score`` is logprob scoring."""
        reqs = rerank_requests(self.tokenizer, query, documents, self.engine.max_model_len,
                               self.default_pooling)
        outs = self.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=use_tqdm)
        return [relevance(o.embedding) for o in outs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template; one conversation or a list of them."""
        if self.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not convs:
            raise InvalidRequestError("chat needs at least one conversation")
        prompts = [{"prompt_token_ids": self.processor.render_chat(c, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, made, use_tqdm: bool) -> list[RequestOutput]:
        engine, outp = self.engine, self.output_processor
        order = [req.request_id for req, _ in made]
        for req, text in made:
            outp.add_request(req.request_id, text, req.prompt_token_ids, req.sampling_params, req.arrival_time)
            engine.add_request(req)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(made), desc="generate", unit="req", disable=not use_tqdm or len(made) < 2,
                   dynamic_ncols=True)
        n_out, t0 = 0, time.perf_counter()
        try:
            while len(done) < len(made):
                batch = engine.step_with_batch_queue()  # the core's step pipeline (engine_core/core.py)
                core_outs = batch.outputs if batch is not None else []
                if batch is not None:
                    outp.record_started(batch.started)
                processed = outp.process(core_outs, batch.weights_version if batch is not None else 0)
                if processed.to_abort:
                    engine.abort_requests(processed.to_abort)
                if processed.failed:  # a request's output handling raised: the call fails with it
                    raise processed.failed[0][1]
                n_out += sum(len(c.new_token_ids) for c in core_outs)
                for o in processed.outputs:
                    if o.finished:
                        done[o.request_id] = o
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{n_out / (time.perf_counter() - t0):.0f}", refresh=False)
                if batch is None and len(done) < len(made):
                    raise RuntimeError("engine went idle with requests unfinished")  # never expected
        finally:
            bar.close()
            left = [rid for rid in order if rid not in done]
            if left:  # an exception: leave the engine clean for the next call
                engine.abort_requests(left)
                while engine.oldest_batch() is not None:  # finish what is in flight, then tell the
                    engine.step()                         # runner to drop the aborted requests
                engine.step()
                for rid in left:
                    outp.abort(rid)
        return [done[rid] for rid in order]


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Chat messages through the tokenizer's chat template, checked as every chat request is
    (roles, contents; validation.check_messages) but with no length limit."""
    from asyncengine.engine.processor import render_chat_checked  # lazy: loaded on first use of this rarely used call
    from asyncengine.engine.validation import RequestLimits, check_messages  # lazy: loaded on first use of this rarely used call

    msgs = check_messages(messages, RequestLimits(max_messages=1 << 30, max_prompt_chars=1 << 62), 1)
    return render_chat_checked(tokenizer, msgs, add_generation_prompt)
