"""A GGUF file's tokenizer, from its ``tokenizer.ggml.*`` metadata, and its end-of-generation ids.

Two ways: :func:`fast_tokenizer` builds our :class:`~asyncengine.models.tokenizer.ChatTokenizer`
straight from the vocabulary arrays for byte-level BPE (GPT-2 and StarCoder-style pre-tokenizers:
SmolLM2, Qwen, Llama 3...), with no transformers import; :func:`build_tokenizer` is transformers'
GGUF tokenizer conversion, plus one fix of our own (``_fix_pre_tokenizer``), for everything else
and for ``load_gguf``'s Hugging Face view.
"""

from __future__ import annotations

import os
import typing
from typing import Any

from asyncengine.errors import ModelLoadError
from asyncengine.models.tokenizer import ChatTokenizer, byte_level_bpe

if typing.TYPE_CHECKING:
    from asyncengine.models.gguf.reader import GGUFFile

__all__ = ["build_tokenizer", "eos_token_ids", "fast_tokenizer"]

# llama.cpp pre-tokenizers that split every digit on its own before the byte-level regex
# (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA); transformers
# leaves these on its GPT-2 default, which keeps runs of digits together.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}

# Special tokens llama.cpp treats as end-of-generation when the vocabulary has them.
_EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")


def fast_tokenizer(f: GGUFFile, md: dict[str, Any]):
    """A :class:`~asyncengine.models.tokenizer.ChatTokenizer` for byte-level BPE vocabularies with
    GPT-2's or the StarCoder-family pre-tokenizer; None for anything else (the caller falls back)."""
    if md.get("tokenizer.ggml.model") != "gpt2":
        return None
    pre = md.get("tokenizer.ggml.pre")
    if pre not in _DIGIT_SPLIT_PRE and pre not in ("default", "gpt2", None):
        return None

    tokens = f.read_array("tokenizer.ggml.tokens")
    merges = f.read_array("tokenizer.ggml.merges")
    if not tokens or merges is None:
        return None
    backend = byte_level_bpe(tokens, merges, f.read_array("tokenizer.ggml.token_type"),
                             digits_split=pre in _DIGIT_SPLIT_PRE)

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return ChatTokenizer(backend, chat_template=md.get("tokenizer.chat_template"), bos_token=token("bos_token_id"),
                         eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
                         pad_token=token("padding_token_id"),
                         add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", False)))


def build_tokenizer(path: str, md: dict[str, Any]):
    """A transformers fast tokenizer from the file's metadata (chat template included), or None
    when the file has no vocabulary."""
    if "tokenizer.ggml.model" not in md or "tokenizer.ggml.tokens.count" not in md:
        return None
    try:
        tokenizer = _tokenizer_via_transformers(path)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds on unusual vocabularies
        raise ModelLoadError(
            f"{path}: could not build a tokenizer from the GGUF metadata (tokenizer model "
            f"{md.get('tokenizer.ggml.model')!r}, pre-tokenizer {md.get('tokenizer.ggml.pre')!r}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if md.get("tokenizer.ggml.model") == "gpt2":  # byte-level BPE
        _fix_pre_tokenizer(tokenizer, md.get("tokenizer.ggml.pre"))
    if tokenizer.chat_template is None and md.get("tokenizer.chat_template"):
        tokenizer.chat_template = md["tokenizer.chat_template"]
    return tokenizer


def _tokenizer_via_transformers(path: str):
    """transformers' own GGUF tokenizer conversion, called on the file alone.

    ``PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=...)`` would also pick up a stray
    tokenizer.json/tokenizer_config.json lying next to the GGUF, so we call the conversion directly,
    falling back to the public path only if those internals moved.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
        backend, additional = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ImportError, AttributeError, TypeError):
        folder, name = os.path.split(os.path.abspath(path))
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)
    kwargs = {k: v for k, v in {**tokenizer_config, **(additional or {})}.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def _fix_pre_tokenizer(tokenizer, pre: str | None) -> None:
    """Make digit handling match llama.cpp for the StarCoder-style pre-tokenizers (SmolLM among them)."""
    if pre not in _DIGIT_SPLIT_PRE:
        return
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def eos_token_ids(md: dict[str, Any], tokenizer) -> list[int]:
    """The file's eos id first, then its eot/eom ids, then known end-of-turn special tokens.

    llama.cpp also stops on those special tokens (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``...)
    when the vocabulary has them, as HF generation configs often list several.
    """
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = md.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if tokenizer is not None:
        special = {tok.content: i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
        for text in _EOG_TEXTS:
            token_id = special.get(text)
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
    return ids
