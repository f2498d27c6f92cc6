"""The xgrammar backend: one compiler per tokenizer, compiled grammars in one byte-bounded LRU
(cache.py; xgrammar's own compiler cache is off: unbounded, and ~8x slower on a 10k enum), and
per-request matchers that fill token bitmasks and advance only on accepted tokens.

Compiling is the slow part (milliseconds to seconds for a big schema): front ends compile through
the compile service (compile_service.py: worker processes, a time budget, cancellable) before a
request enters the engine, and the request then carries the serialized grammar. A model runner
takes a grammar from its process's cache, else deserializes the one the request carries
(milliseconds), and compiles inline only for a request that bypassed every front end.
"""
from __future__ import annotations

import threading

import torch

from asyncengine.errors import InvalidRequestError
from asyncengine.structured.cache import CompiledEntry, GrammarCache
from asyncengine.structured.compile_worker import compile_kind, unpack
from asyncengine.config.grammar_limits import GrammarLimits, check_upfront
from asyncengine.structured_params import StructuredOutputsParams


def _tokenizer_info(xgr, tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary. Our own tokenizer (models/tokenizer.py, built from GGUF
    metadata without transformers) wraps a ``tokenizers.Tokenizer`` as a fast HF tokenizer does, but
    xgrammar only recognises transformers' classes by type: read it the way xgrammar reads those."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    from_hf = type(tokenizer).__module__.startswith("transformers")
    if from_hf or backend is None:
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = tokenizer.get_vocab()
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != meta["vocab_type"]:
        meta = {"vocab_type": from_vocab,
                "add_prefix_space": xgr.TokenizerInfo._detect_add_prefix_space_by_encoding(tokenizer, from_vocab)}
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids, add_prefix_space=meta["add_prefix_space"])


class GrammarCompiler:
    """Compiles and caches the grammars of one tokenizer (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits | None = None) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise InvalidRequestError("structured outputs need xgrammar, part of asyncengine's install: pip install 'xgrammar>=0.2.9'") from None

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = _tokenizer_info(xgr, tokenizer, vocab_size, list(eos_token_ids))
        self.limits = limits or GrammarLimits()
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache = GrammarCache(self.limits.grammar_cache_bytes)
        # compact JSON never needs a raw control byte (JSON forbids them unescaped inside strings,
        # and there is no free whitespace), but xgrammar's string rule lets them through: JSON
        # matchers AND their masks with this one, which drops every token holding a byte < 0x20
        words = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
        for i, b in enumerate(self.info.decoded_vocab[:vocab_size]):
            words[i] = not any(c < 0x20 for c in b)
        for t in eos_token_ids:
            if 0 <= t < vocab_size:
                words[t] = True
        bits = words.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
        packed = bits.sum(dim=1)
        self.no_control_mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        # after the grammar has ended (a step already in flight, or ignore_eos): only stop tokens
        stop = torch.zeros_like(words)
        for t in eos_token_ids:
            if 0 <= t < vocab_size:
                stop[t] = True
        packed = (stop.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
        self.stop_only_mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def compile(self, p: StructuredOutputsParams):
        """The CompiledGrammar of ``p``: from the cache, else deserialized from ``p.compiled`` (what
        the front end's compile service attached), else compiled here (checked upfront, no time
        budget: only a caller that bypassed every front end gets here)."""
        key = p.key
        entry = self.cache.get(key)
        if entry is None:
            if p.compiled is not None:
                entry = CompiledEntry(p.compiled)
            else:
                check_upfront(*key, self.limits)
                try:
                    g = compile_kind(self.compiler, *key)
                except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
                    raise InvalidRequestError(f"structured_outputs: the {key[0].split('_')[0]} does not compile: "
                                              f"{e}") from None
                entry = CompiledEntry(None, g)  # nobody else needs it serialized
            self.cache.put(key, entry)
        if entry.grammar is None:
            entry.grammar = self.xgr.CompiledGrammar.deserialize_json(unpack(entry.serialized), self.info)
            self.cache.resized(key, entry)
        return entry.grammar

    def matcher(self, p: StructuredOutputsParams) -> "Matcher":
        compact_json = (p.json is not None or p.json_object) and not p.any_whitespace
        return Matcher(self.xgr.GrammarMatcher(self.compile(p)), self.no_control_mask if compact_json else None,
                       self.stop_only_mask)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


class Matcher:
    """One request's grammar state. ``fill`` writes the allowed next tokens into a bitmask row;
    ``accept`` advances (False: the token breaks the grammar, nothing changed); ``rollback`` undoes
    the last n accepted tokens (speculative drafts that were rejected)."""

    __slots__ = ("m", "also", "ended")

    def __init__(self, m, also: torch.Tensor | None, ended: torch.Tensor) -> None:
        self.m = m
        self.also = also  # a mask ANDed with the grammar's (see GrammarCompiler.no_control_mask)
        self.ended = ended  # the mask once the grammar has accepted its stop token

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.m.is_terminated():
            bitmask[row] = self.ended
            return
        self.m.fill_next_token_bitmask(bitmask, row)
        if self.also is not None:
            bitmask[row] &= self.also

    def accept(self, token: int) -> bool:
        if self.m.is_terminated():
            return False
        return self.m.accept_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()


_compilers: dict[tuple, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(key, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits | None = None) -> GrammarCompiler:
    """The process-wide compiler of the tokenizer named ``key`` (the model or tokenizer path):
    built once, since it reads the whole vocabulary; front end and model runner share it (and its
    cache) in one process, as they share the config's ``limits``. ``tokenizer``: the tokenizer, or
    a function returning it."""
    limits = limits or GrammarLimits()
    with _compilers_lock:
        c = _compilers.get((key, limits))
        if c is None:
            tok = tokenizer() if callable(tokenizer) and not hasattr(tokenizer, "encode") else tokenizer
            c = _compilers[(key, limits)] = GrammarCompiler(tok, vocab_size, eos_token_ids, limits)
        return c
