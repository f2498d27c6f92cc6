"""A light tokenizer: a Rust ``tokenizers.Tokenizer`` plus a chat template, without transformers.

Importing transformers and building its tokenizer from a GGUF file took ~4.7 s of a one-line chat
(2.2 s the import, 2.5 s the conversion) for 50k tokens. For the byte-level BPE vocabularies most
small chat models use (SmolLM, Qwen, Llama 3: GGUF ``tokenizer.ggml.model == "gpt2"``) the
tokenizer is a BPE model, a byte-level pre-tokenizer and decoder, and the control tokens as
special tokens; :func:`byte_level_bpe` builds that straight from the GGUF vocabulary in
milliseconds. :class:`ChatTokenizer` wraps it with the part of transformers' tokenizer interface the
engine uses (encode, decode, apply_chat_template...). Its chat templates render as transformers'
do (a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``tojson``,
``raise_exception``, ``strftime_now``); the tests compare both on the default model.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@lru_cache(maxsize=1)
def _unspelled_char() -> "re.Pattern[str]":
    """Matches a character outside GPT-2's byte alphabet."""
    return re.compile("[^" + "".join(re.escape(c) for c in sorted(byte_alphabet().values())) + "]")


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None,
                   digits_split: bool, split_regex: str | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer from GGUF vocabulary arrays.

    ``digits_split``: every digit is its own pre-token (llama.cpp's StarCoder-family pre-tokenizers,
    SmolLM among them). ``split_regex``: a custom split pattern applied before the byte mapping.
    Tokens of type 3 (control) become special tokens, of type 4 (user-defined) plain added tokens,
    both matched whole in the text."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    unspelled = _unspelled_char()
    # one C-level scan finds the few tokens written as raw text (a per-token set() took 3x longer)
    spelt = [("".join(alphabet[b] for b in tok.encode("utf-8")) if unspelled.search(tok) else tok)
             for tok in tokens]
    # the first id of a duplicated spelling wins: build from the end
    vocab = dict(zip(reversed(spelt), range(len(spelt) - 1, -1, -1)))
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    if split_regex is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif digits_split:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    if token_types:
        special = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, token_types) if ty == 3 and set(t) <= spelled]
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, token_types) if ty == 4]
        if special:
            tk.add_special_tokens(special)
        if user:
            tk.add_tokens(user)
    return tk


class ChatTokenizer:
    """The subset of a transformers fast tokenizer the engine and its front ends use."""

    is_fast = True
    clean_up_tokenization_spaces = False

    def __init__(self, backend: Tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, unk_token: str | None = None, pad_token: str | None = None,
                 add_bos_token: bool = False) -> None:
        self.backend_tokenizer = self._tokenizer = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.add_bos_token = add_bos_token
        if add_bos_token and bos_token is not None:
            bos_id = backend.token_to_id(bos_token)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)])
        self._template = None

    # ids of the special tokens, as transformers names them
    def _id(self, tok: str | None) -> int | None:
        return None if tok is None else self._tokenizer.token_to_id(tok)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._tokenizer.get_added_tokens_decoder()

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i, t in self.added_tokens_decoder.items() if t.special]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]):
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(self, conversation: list[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, continue_final_message: bool = False,
                            tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, **kwargs: Any):
        """Render ``conversation`` with the chat template (and tokenize it, without adding special
        tokens, as transformers does: the template writes them)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        text = _compile(template).render(
            messages=conversation, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", unk_token=self.unk_token or "",
            pad_token=self.pad_token or "", **kwargs)
        if continue_final_message and conversation:
            final = conversation[-1].get("content")
            if isinstance(final, str) and final.strip() and final.strip() in text:
                text = text[:text.rindex(final.strip()) + len(final.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
