"""IncrementalDetokenizer: streamed deltas concatenate to exactly tokenizer.decode(output_ids)."""
from __future__ import annotations

import functools
import json
import random

import pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from asyncengine.engine.detokenizer import IncrementalDetokenizer, rust_tokenizer_of

TRAIN = [
    "Hello world! The quick brown fox jumps over the lazy dog. ",
    "Café, naïve, façade, résumé, Ångström, Straße, jalapeño. ",
    "日本語のテキストです。中文文本，你好世界。한국어 텍스트. ",
    "Emoji: 😀 🎉 👍🏽 ❤️ 👨‍👩‍👧 🇫🇷 ",
    "def f(x):\n    return x ** 2  # square\n\nfor i in range(10):\n\tprint(f'{i}: {f(i)}')\n",
]
# texts with characters never seen in training (byte fallback / rare byte pieces)
TEXTS = [
    "Hello world! Café 日本語 😀🎉 def f(x): return x",
    "  leading spaces and trailing   ",
    "Zoë's 🦀 crab ﷽ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — “quotes” …",
    "中文文本，你好世界。한국어 👨‍👩‍👧 🇫🇷 🇯🇵",
    "\tprint(f'{i}: {f(i)}')\n\n",
    "ÅÅÅ ççç ñ ü ß",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


def _add_byte_fallback(tok: Tokenizer) -> Tokenizer:
    d = json.loads(tok.to_str())
    m = d["model"]
    if m["type"] == "BPE":
        n = len(m["vocab"])
        for b in range(256):
            m["vocab"][f"<0x{b:02X}>"] = n + b
    else:  # Unigram
        m["vocab"].extend([f"<0x{b:02X}>", -50.0] for b in range(256))
    m["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(d))


@functools.cache
def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(TRAIN * 10, tr)
    return tok


@functools.cache
def metaspace_bpe() -> Tokenizer:
    """SentencePiece-style BPE (Mistral / modern Llama conversions): Metaspace + byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                             show_progress=False)
    tok.train_from_iterator(TRAIN * 10, tr)
    tok = _add_byte_fallback(tok)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    return tok


@functools.cache
def llama2_unigram() -> Tokenizer:
    """Llama-2-style conversion: Prepend/Replace normalizer, Unigram + byte fallback, and a
    Replace/ByteFallback/Fuse/Strip decoder."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tr = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                 unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(TRAIN * 10, tr)
    tok = _add_byte_fallback(tok)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


TOKENIZERS = {"byte_level_bpe": byte_level_bpe, "metaspace_bpe": metaspace_bpe,
              "llama2_unigram": llama2_unigram}


def _stream(tok, ids, chunks=None, skip=True, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, **kw)
    deltas = []
    i = 0
    for n in chunks or [1] * len(ids):
        deltas.append(d.push(ids[i:i + n]))
        i += n
    assert i >= len(ids)
    return deltas, d


def _byte_runs_valid(tok: Tokenizer, ids: list[int], skip: bool) -> bool:
    """True if every maximal run of byte-fallback tokens (<0xNN>) is valid UTF-8.

    HF's ByteFallback decoder turns EVERY byte of an invalid run into U+FFFD, including bytes of
    characters that were complete: e.g. decode(<0x00>) == "\\x00" but decode(<0x00><0x80>) == "��".
    Text that was already streamed cannot be taken back, so for such outputs (never produced by
    encoding text; only by a model emitting broken UTF-8) the stream differs from decode().
    """
    specials = {tok.token_to_id(s) for s in (*SPECIALS, "<unk>", "<s>", "</s>")} - {None}
    run: list[int] = []
    for t in [*ids, None]:
        if t is not None and skip and t in specials:
            continue
        piece = tok.id_to_token(t) if t is not None else None
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            run.append(int(piece[3:5], 16))
            continue
        try:
            bytes(run).decode("utf-8")
        except UnicodeDecodeError:
            return False
        run = []
    return True


def _ids_with_specials(tok: Tokenizer, text: str, rng: random.Random) -> list[int]:
    """The text's ids with 2 special tokens inserted at random places (not inside a
    byte-fallback character: see _byte_runs_valid)."""
    specials = [tok.token_to_id(s) for s in (*SPECIALS, "<s>", "</s>") if tok.token_to_id(s) is not None]
    base = tok.encode(text).ids
    while True:
        ids = list(base)
        for _ in range(2):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        if _byte_runs_valid(tok, ids, skip=False):
            return ids


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("decode_stream", [True, False], ids=["DecodeStream", "offsets"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_stream_equals_decode(name, decode_stream, skip):
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    for text in TEXTS:
        ids = _ids_with_specials(tok, text, rng)
        want = tok.decode(ids, skip_special_tokens=skip)
        # one token at a time
        deltas, d = _stream(tok, ids, skip=skip, use_decode_stream=decode_stream)
        assert "".join(deltas) + d.finish() == want
        assert d.text == want
        if "\ufffd" not in want:  # (a special token inserted inside a character breaks it)
            assert not any("\ufffd" in x for x in deltas)
        # random chunk sizes (a step may bring several tokens)
        sizes, n = [], len(ids)
        while n > 0:
            sizes.append(min(n, rng.randint(1, 4)))
            n -= sizes[-1]
        deltas, d = _stream(tok, ids, sizes, skip=skip, use_decode_stream=decode_stream)
        assert "".join(deltas) + d.finish() == want


def test_incomplete_character_is_held_back():
    tok = metaspace_bpe()
    ids = tok.encode("🦀").ids  # unseen: 4 byte-fallback tokens (after '▁')
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    for use_stream in (True, False):
        d = IncrementalDetokenizer(tok, [], use_decode_stream=use_stream)
        got = [d.push([i]) for i in ids]
        assert got[-4:] == ["", "", "", "🦀"], got
        assert d.text == tok.decode(ids) == "🦀"


def test_byte_level_multibyte_split_across_tokens():
    tok = byte_level_bpe()
    ids = tok.encode("x ﷽ 𝔘").ids
    assert len(ids) > 4  # rare characters split into byte pieces
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.push([i]) for i in ids]
    assert "".join(deltas) == "x ﷽ 𝔘"
    assert all("\ufffd" not in x for x in deltas)


def test_truncated_output_finish_releases_replacement_char():
    """An output cut in the middle of a character (max_tokens): finish() releases what decode
    shows, so the final text still equals decode(output_ids)."""
    tok = metaspace_bpe()
    ids = tok.encode("ab 🦀").ids[:-2]
    for use_stream in (True, False):
        d = IncrementalDetokenizer(tok, [], use_decode_stream=use_stream)
        streamed = "".join(d.push([i]) for i in ids)
        assert "\ufffd" not in streamed
        tail = d.finish()
        assert streamed + tail == tok.decode(ids) == d.text
        assert tail.endswith("\ufffd")
        assert d.finish() == ""


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_id_sequences(name, data):
    """Arbitrary id sequences (invalid UTF-8 included): deltas + finish() == decode(ids)."""
    tok = TOKENIZERS[name]()
    V = tok.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=25))
    skip = data.draw(st.booleans())
    stream = data.draw(st.booleans())
    deltas, d = _stream(tok, ids, skip=skip, use_decode_stream=stream)
    text = "".join(deltas) + d.finish()
    assert text == d.text
    if _byte_runs_valid(tok, ids, skip):
        assert text == tok.decode(ids, skip_special_tokens=skip)


def test_invalid_byte_run_differs_from_decode_only_there():
    """The documented exception: HF decode() replaces a whole invalid byte-fallback run."""
    tok = metaspace_bpe()
    ids = [tok.token_to_id("<0x41>"), tok.token_to_id("<0x80>")]
    assert tok.decode(ids) == "\ufffd\ufffd"
    deltas, d = _stream(tok, ids)
    assert deltas[0] == "A"
    assert d.text + d.finish() in ("A\ufffd", "A")


def test_metaspace_leading_space_and_prompt_context():
    tok = metaspace_bpe()
    prompt = tok.encode("The quick brown fox").ids
    out = tok.encode("The quick brown fox jumps over").ids[len(prompt):]
    assert tok.id_to_token(out[0]).startswith("▁")
    # default: exactly decode(output_ids): the first token's space is dropped
    d = IncrementalDetokenizer(tok, prompt)
    for t in out:
        d.push([t])
    assert d.text == tok.decode(out) == "jumps over"
    # prompt_context: the text the output adds to the prompt (vLLM / HF pipeline)
    for use_stream in (True, False):
        d = IncrementalDetokenizer(tok, prompt, prompt_context=True, use_decode_stream=use_stream)
        deltas = [d.push([t]) for t in out]
        full, head = tok.decode(prompt + out), tok.decode(prompt)
        assert "".join(deltas) == d.text == full[len(head):] == " jumps over"


def test_byte_level_prompt_context_is_the_same():
    tok = byte_level_bpe()
    prompt = tok.encode("Hello").ids
    out = tok.encode("Hello world! Café 😀").ids[len(prompt):]
    a = IncrementalDetokenizer(tok, prompt)
    b = IncrementalDetokenizer(tok, prompt, prompt_context=True)
    for t in out:
        a.push([t])
        b.push([t])
    assert a.text == b.text == tok.decode(out) == " world! Café 😀"


def test_transformers_tokenizer_wrappers():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(),
                                 eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    assert rust_tokenizer_of(hf) is not None
    ids = hf.encode("Hello 😀 wörld") + [hf.eos_token_id]
    d = IncrementalDetokenizer(hf, [])
    for t in ids:
        d.push([t])
    assert d.text == hf.decode(ids, skip_special_tokens=True) == "Hello 😀 wörld"

    class SlowLike:  # a slow tokenizer: only decode()
        def decode(self, ids, skip_special_tokens=False):
            return hf.decode(ids, skip_special_tokens=skip_special_tokens)

    assert rust_tokenizer_of(SlowLike()) is None
    d = IncrementalDetokenizer(SlowLike(), [], skip_special_tokens=False)
    deltas = [d.push([t]) for t in ids]
    assert "".join(deltas) == hf.decode(ids, skip_special_tokens=False)
