"""Incremental detokenization: token ids in, text deltas out, correct for multi-byte characters.

A character may span several tokens (byte-level BPE pieces, SentencePiece ``<0xNN>`` byte-fallback
tokens): :meth:`IncrementalDetokenizer.push` returns ``""`` until its bytes are complete, never a
replacement character for a half-received one.

Invariant: the concatenation of the deltas is ``tokenizer.decode(output_ids,
skip_special_tokens=...)`` (plus :meth:`~IncrementalDetokenizer.finish` at the end, which only
matters when the output ends with an incomplete character, which ``decode`` shows as ``"�"``).

Note on SentencePiece / ``Metaspace`` tokenizers (Llama, Mistral, Gemma...): ``decode`` drops the
leading space of the first token (``"▁Paris"`` alone decodes to ``"Paris"``). By default this
module follows ``decode(output_ids)``, so a completion's first word comes without its space.
``prompt_context=True`` instead gives the text the output adds after the prompt, i.e.
``decode(prompt + output)[len(decode(prompt)):]`` (``" Paris"``), which is what vLLM and HF's
text-generation pipeline return; that is the choice for completions that are appended to the
prompt. For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM...) both are the same.

Fast tokenizers (``tokenizers.Tokenizer``, or a transformers tokenizer backed by one) use the Rust
``tokenizers.decoders.DecodeStream``; anything else (slow tokenizers, or a transformers tokenizer
with ``clean_up_tokenization_spaces``) uses the prefix/read-offset algorithm over its ``decode``.
"""
from __future__ import annotations

from typing import Any, Sequence

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency
    _RustTokenizer = None
    DecodeStream = None

__all__ = ["IncrementalDetokenizer", "rust_tokenizer_of"]

_REPLACEMENT = "\ufffd"
# prompt_context: how many prompt tokens prime the stream (enough for any merge/strip context)
_PROMPT_CONTEXT_TOKENS = 6


def rust_tokenizer_of(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` whose ``decode`` equals ``tokenizer.decode``, or ``None``."""
    if _RustTokenizer is None:
        return None
    if isinstance(tokenizer, _RustTokenizer):
        return tokenizer
    if not getattr(tokenizer, "is_fast", False):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # transformers post-processes decode's output: use its decode instead
    rust = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return rust if isinstance(rust, _RustTokenizer) else None


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens.

    ``push(ids)`` returns the new text; ``text`` is everything so far; ``finish()`` returns what
    was held back (an incomplete trailing character) when the sequence ends.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, *, prompt_context: bool = False,
                 use_decode_stream: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_token_ids: list[int] = []
        self._chunks: list[str] = []
        self._text_cache = ""
        self._text_len_chunks = 0
        # context ids decoded before the output (prompt_context) and not part of the text
        ctx = list(prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:] if prompt_context else []
        self._rust = rust_tokenizer_of(tokenizer) if use_decode_stream is not False else None
        if use_decode_stream and self._rust is None:
            raise ValueError("use_decode_stream=True needs a fast (tokenizers-backed) tokenizer")
        self._stream = None
        if self._rust is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._step_list = True
            if ctx:
                self._stream_step(ctx)  # prime: its text is the prompt's, not ours
        # prefix/read-offset state (fallback; also used by finish())
        self._ids: list[int] = list(ctx)  # context + output ids
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text = self._decode(self._ids) if ctx else ""

    # -- public -------------------------------------------------------------------------------

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add generated token ids; return the text they complete (maybe ``""``)."""
        if not new_token_ids:
            return ""
        self.output_token_ids.extend(new_token_ids)
        if self._stream is not None:
            try:
                delta = self._stream_step(new_token_ids)
            except Exception:
                # the Rust stream refused (e.g. a decoder whose output is not prefix-stable):
                # continue with the generic algorithm from here
                self._stream = None
                self._ids.extend(new_token_ids)
                delta = self._offset_step()
            else:
                self._ids.extend(new_token_ids)
                if delta:
                    self._sync_offsets()
        else:
            self._ids.extend(new_token_ids)
            delta = self._offset_step()
        if delta:
            self._chunks.append(delta)
        return delta

    def finish(self) -> str:
        """At the end of the sequence: the held-back text, if the output ends with an incomplete
        character (``decode`` shows it as ``"�"``); usually ``""``."""
        if len(self._ids) <= self._read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        delta = full[len(self._prefix_text):] if full.startswith(self._prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        self._stream = None
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """The whole output text so far."""
        if self._text_len_chunks != len(self._chunks):
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache] if self._text_cache else []
            self._text_len_chunks = len(self._chunks)
        return self._text_cache

    # -- internals ----------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        if self._rust is not None:
            return self._rust.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _stream_step(self, ids: Sequence[int]) -> str:
        stream, rust = self._stream, self._rust
        if self._step_list:
            try:
                return stream.step(rust, list(ids)) or ""
            except TypeError:  # tokenizers < 0.22: one id per step
                self._step_list = False
        out = []
        for t in ids:
            piece = stream.step(rust, t)
            if piece:
                out.append(piece)
        return "".join(out)

    def _sync_offsets(self) -> None:
        """After the stream emitted: everything pushed so far is text; keep a little context
        for finish() / the fallback."""
        n = len(self._ids)
        self._prefix_offset = max(0, n - _PROMPT_CONTEXT_TOKENS)
        self._read_offset = n
        self._prefix_text = None  # computed lazily

    def _offset_step(self) -> str:
        """The prefix/read-offset algorithm: decode the window since ``prefix_offset`` and emit
        what it adds beyond the already emitted part, unless it ends with an incomplete char."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(self._prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = None
            return delta
        return ""
