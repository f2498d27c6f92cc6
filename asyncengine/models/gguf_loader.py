"""Reading a GGUF file into Hugging Face terms: a config, HF-named float tensors, a tokenizer.

    ckpt = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config            # LlamaConfig(architectures=["LlamaForCausalLM"], ...)
    ckpt.tensors           # {"model.embed_tokens.weight": float32 tensor, ...}, as in the HF checkpoint
    ckpt.tokenizer         # a transformers fast tokenizer, chat template included
    ckpt.eos_token_ids     # [2, 0]

What llama.cpp's ``convert_hf_to_gguf.py`` changed, and what this module undoes:

* names: ``blk.N.attn_q.weight`` <- ``model.layers.N.self_attn.q_proj.weight`` and so on (``_LAYER_NAMES``);
* for the ``llama`` architecture only, the rows of ``q_proj`` and ``k_proj`` (weight and bias) were
  permuted per head, from HF's "rotate half" rope layout to GGML's interleaved pairs
  (``reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)``). We apply the inverse, with the number of
  KV heads for ``k_proj``. Qwen2/Qwen3 use GGML's NEOX rope, so nothing was permuted there;
* weights are stored quantized; ``gguf.quants.dequantize`` turns them back to float32. The permutation
  is over whole rows and the quantization blocks run along a row, so un-permuting after dequantizing
  is exact;
* the config lives in metadata keys (``llama.block_count``...), read in ``_build_config``;
* Llama 3.x rope scaling becomes a ``rope_freqs`` tensor of per-frequency divisors; we fit the
  ``llama3`` rope parameters back from it (``_llama3_rope_from_freqs``) and keep the raw tensor in
  ``extra_tensors``.

The tokenizer is rebuilt by transformers' GGUF tokenizer support, plus one fix of our own
(``_fix_pre_tokenizer``). Anything wrong with the file raises :class:`ModelLoadError` naming the path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import struct
import typing
import warnings
from typing import Any, Iterator

import numpy as np
import torch

if typing.TYPE_CHECKING:
    import transformers

from asyncengine.errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["GGUFCheckpoint", "load_gguf", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TENSOR_TYPES"]


@dataclasses.dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in the terms a Hugging Face checkpoint would use."""

    config: "transformers.PretrainedConfig"
    tensors: dict[str, torch.Tensor]
    tokenizer: "transformers.PreTrainedTokenizerBase | None"
    eos_token_ids: list[int]
    # Tensors with no HF name (e.g. Llama 3's "rope_freqs"), under their GGUF names.
    extra_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # The raw GGUF metadata (scalars and short arrays; the vocabulary arrays are left out).
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    path: str = ""


# GGUF `general.architecture` -> (transformers model_type, HF architecture name)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),  # also Mistral-style models, which llama.cpp writes as llama
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# Architectures whose q/k rows llama.cpp permuted for its interleaved ("normal") rope.
_PERMUTED_QK_ARCHITECTURES = {"llama"}

_FLOAT_TYPES = ("F32", "F16", "BF16")
_QUANT_TYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M",
    "TQ1_0", "TQ2_0",
)


def _supported_types() -> frozenset:
    import gguf

    names = {q.name for q in gguf.GGMLQuantizationType}
    return frozenset(gguf.GGMLQuantizationType[n] for n in _FLOAT_TYPES + _QUANT_TYPES if n in names)


SUPPORTED_TENSOR_TYPES: frozenset = _supported_types()

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# GGUF tensors kept under their own names in `extra_tensors` (they have no HF counterpart).
_EXTRA_TENSORS = {"rope_freqs.weight"}

# llama.cpp pre-tokenizers that split every digit on its own before the byte-level regex
# (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA); transformers
# leaves these on its GPT-2 default, which keeps runs of digits together.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}

# Special tokens llama.cpp treats as end-of-generation when the vocabulary has them.
_EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")


def gguf_config(path: str | os.PathLike) -> transformers.PretrainedConfig:
    """Only the model config of a GGUF file (its header; no tensor data is read)."""
    path = _resolve_file(path)
    f = _GGUFFile(path)
    arch = f.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}.")
    return _build_config(f, arch, path)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, *, tensors: bool = True,
              tokenizer: bool = True, shard_of=None, keep_quantized: frozenset = frozenset()) -> GGUFCheckpoint:
    """Read a GGUF file (or a folder holding exactly one) into HF-named, dequantized tensors.

    ``dtype`` is what each tensor is cast to right after it is dequantized (float32 by default, which
    is exact for every GGUF type). ``tensors=False`` reads only the config and tokenizer (``tensors``
    is then empty). ``shard_of(hf_name) -> (dim, start, stop) | None``: a tensor-parallel rank's
    slice of each tensor; only those rows (or columns) of the memory map are dequantized.
    ``keep_quantized``: HF names of block-format tensors (Q4_0, Q4_1, Q8_0) to hand over as a
    ``QuantizedTensor`` (their slice of the raw blocks), not dequantized.
    Raises :class:`ModelLoadError` for a missing, truncated or corrupt file, an unsupported tensor type
    or an unsupported architecture.
    """
    path = _resolve_file(path)
    gguf_file = _GGUFFile(path)
    metadata = gguf_file.metadata
    gguf_arch = _architecture(metadata, path)
    _check_tensor_types(gguf_file, path)
    config = _build_config(gguf_file, gguf_arch, path)
    if tensors:
        weights, extra = _load_tensors(gguf_file, config, gguf_arch, path, dtype, shard_of,
                                       keep_quantized=keep_quantized)
    else:  # rope_freqs still matter for the config
        weights, extra = {}, _load_tensors(gguf_file, config, gguf_arch, path, dtype, None,
                                           only=_EXTRA_TENSORS)[1]
    del gguf_file  # every tensor is a copy: the memory map can go

    _fix_rope_from_freqs(config, extra, path)
    if tensors and shard_of is None:
        _check_tensors(config, weights, path)  # (a shard's shapes are checked by the model)
    tok = _build_tokenizer(path, metadata) if tokenizer else None
    eos_ids = _eos_token_ids(metadata, tok)
    return GGUFCheckpoint(
        config=config,
        tensors=weights,
        tokenizer=tok,
        eos_token_ids=eos_ids,
        extra_tensors=extra,
        metadata=metadata,
        path=path,
    )


# --------------------------------------------------------------------------------------------- file


def _resolve_file(path: str | os.PathLike) -> str:
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        if len(found) != 1:
            what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(found)})"
            raise ModelLoadError(f"{path}: is a folder with {what}; pass the path of one .gguf file.")
        path = os.path.join(path, found[0])
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such GGUF file.")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not a regular file.")
    return path


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    name: str
    type_id: int  # a gguf.GGMLQuantizationType value (kept as int: the file may hold an unknown one)
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    offset: int  # absolute, in bytes from the start of the file

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch/numpy shape (outermost first), e.g. (out_features, in_features)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"unknown type id {self.type_id}"


# GGUF metadata value types -> struct format (fixed-size ones); 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# Metadata arrays we only count: the vocabulary (transformers' tokenizer code reads those itself).
_COUNTED_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.precompiled_charsmap"}


class _Truncated(Exception):
    pass


class _GGUFFile:
    """A GGUF v2/v3 file: its metadata and tensor table, parsed with ``struct`` over a memory map.

    ``gguf.GGUFReader`` builds a numpy view per metadata element, which takes seconds on a 50k-150k
    token vocabulary (about 2 s for SmolLM2, several for Qwen/Llama 3); this parser skips the
    vocabulary arrays and takes milliseconds. Tensor bytes are read as numpy views of the map and
    dequantized with ``gguf.quants``; the tests cross-check this parser against ``GGUFReader``.
    """

    def __init__(self, path: str):
        import mmap

        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise ModelLoadError(f"{path}: file is too short ({len(head)} bytes) to be a GGUF file.")
                if head[:4] != b"GGUF":
                    raise ModelLoadError(
                        f"{path}: not a GGUF file (it starts with {head[:4]!r}, a GGUF file starts with b'GGUF')."
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read the file: {exc.strerror or exc}.") from None
        self.size = size
        try:
            self._parse()
        except (_Truncated, struct.error):
            raise ModelLoadError(
                f"{path}: the GGUF header is cut short ({size} bytes in all): the file is truncated or corrupt."
            ) from None
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{path}: corrupt GGUF header (a string is not UTF-8: {exc}).") from None

    # -- parsing
    def _take(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        end = self._pos + n
        if end > self.size:
            raise _Truncated
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, type_id: int, key: str):
        if type_id in _SCALAR_FORMATS:
            return self._take(_SCALAR_FORMATS[type_id])
        if type_id == 8:
            return self._string()
        if type_id == 9:
            item_type, count = self._take("<I"), self._take("<Q")
            if key in _COUNTED_ARRAYS:
                self.arrays[key] = (item_type, count, self._pos)
                self._skip_array(item_type, count)
                return _ArrayCount(count)  # a plain int once stored
            return [self._value(item_type, key) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: corrupt GGUF metadata (key {key!r} has unknown value type {type_id}).")

    def _skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALAR_FORMATS:
            self._pos += struct.calcsize(_SCALAR_FORMATS[item_type]) * count
        elif item_type == 8:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self._map, self._pos
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            self._pos = pos
        else:
            for _ in range(count):
                self._value(item_type, "")
        if self._pos > self.size:
            raise _Truncated

    def read_array(self, key: str) -> list | None:
        """A vocabulary array the header parse skipped (tokens, merges, token types), or None."""
        if key not in self.arrays:
            return None
        item_type, count, pos = self.arrays[key]
        if item_type == 8:
            out, unpack, buf = [], struct.Struct("<Q").unpack_from, self._map
            for _ in range(count):
                n = unpack(buf, pos)[0]
                out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
            return out
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            return list(np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=pos).tolist())
        return None

    def _parse(self) -> None:
        self.arrays: dict[str, tuple[int, int, int]] = {}
        self._pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are){hint}.")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        if n_tensors > self.size or n_kv > self.size:
            raise _Truncated
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._take("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            if n_dims > 8:
                raise ModelLoadError(f"{self.path}: corrupt tensor table ({name!r} has {n_dims} dimensions).")
            dims = tuple(self._take("<Q") for _ in range(n_dims))
            type_id, offset = self._take("<I"), self._take("<Q")
            infos.append((name, type_id, dims, offset))
        alignment = int(metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: invalid general.alignment {alignment}.")
        data_start = (self._pos + alignment - 1) // alignment * alignment
        # A skipped vocabulary array `k` appears as `k.count`.
        self.metadata = {(k + ".count" if isinstance(v, _ArrayCount) else k): v for k, v in metadata.items()}
        self.tensors = [_TensorInfo(n, t, d, data_start + o) for n, t, d, o in infos]
        self.tensor_names = {t.name for t in self.tensors}

    # -- tensor data
    def nbytes(self, t: _TensorInfo) -> int:
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type_id)]
        n_elements = math.prod(t.dims)
        if n_elements % block or (t.dims and t.dims[0] % block):
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} has shape {list(t.shape)}, whose rows do not divide into "
                f"{t.type_name} blocks of {block}: the file is corrupt."
            )
        return n_elements // block * type_size

    def release(self, t: _TensorInfo) -> None:
        """Drop this process's mapping of a tensor's pages (they stay in the page cache; a later
        read faults them back in), so a load's peak RSS does not count the file on top of the
        weights copied out of it."""
        import mmap

        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.offset - t.offset % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, t.offset + self.nbytes(t) - start)
        except (OSError, ValueError):
            pass

    def raw(self, t: _TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 with shape (*outer dims, bytes per row): what gguf.quants expects."""
        nbytes = self.nbytes(t)
        data = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=t.offset)
        return data.reshape(*t.shape[:-1], nbytes // max(1, math.prod(t.shape[:-1])))


class _ArrayCount(int):
    """Stands for a metadata array that was skipped: the number of its elements."""


def _check_tensor_types(f: _GGUFFile, path: str) -> None:
    supported_ids = {int(q) for q in SUPPORTED_TENSOR_TYPES}
    unsupported: dict[str, list[str]] = {}
    for t in f.tensors:
        if t.type_id not in supported_ids:
            unsupported.setdefault(t.type_name, []).append(t.name)
    if unsupported:
        listed = "; ".join(f"{k} ({len(v)} tensors, e.g. {v[0]!r})" for k, v in sorted(unsupported.items()))
        raise ModelLoadError(
            f"{path}: unsupported tensor type(s): {listed}. Supported: "
            f"{', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))}. Re-quantize the model "
            f"(e.g. llama-quantize to Q4_K_M or Q8_0) or use an F16/F32 file."
        )
    for t in f.tensors:
        end = t.offset + f.nbytes(t)
        if end > f.size:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} ends at byte {end} but the file has only {f.size} bytes: "
                f"the file is truncated."
            )


# ------------------------------------------------------------------------------------------- config


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _build_config(f: _GGUFFile, gguf_arch: str, path: str) -> transformers.PretrainedConfig:
    """The metadata as a transformers config (for load_gguf's Hugging Face view)."""
    import transformers

    model_type, kwargs = _config_kwargs(f, gguf_arch, path)
    config_cls = transformers.CONFIG_MAPPING[model_type]
    try:
        config = config_cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{path}: the GGUF metadata does not make a valid {config_cls.__name__}: {exc}") from None
    config._name_or_path = path  # as from_pretrained records where a model came from
    return config


def _config_kwargs(f: _GGUFFile, gguf_arch: str, path: str) -> tuple[str, dict[str, Any]]:
    """(model_type, the config's fields under their Hugging Face names) from the metadata."""
    model_type, hf_arch = SUPPORTED_ARCHITECTURES[gguf_arch]
    md = f.metadata
    names = {t.name: t for t in f.tensors}

    def key(name: str, default: Any = KeyError):
        full = f"{gguf_arch}.{name}"
        if full in md:
            return md[full]
        if default is KeyError:
            raise ModelLoadError(f"{path}: required metadata key {full!r} is missing.")
        return default

    hidden = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):  # per-layer counts (some hybrid models); a plain transformer has one value
        if len(set(n_kv)) != 1:
            raise ModelLoadError(f"{path}: per-layer KV head counts {n_kv} are not supported.")
        n_kv = n_kv[0]
    n_kv = int(n_kv)

    embd = names.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: the file has no 'token_embd.weight' tensor.")
    vocab_size = int(embd.shape[0])  # (vocab, hidden)

    head_dim = key("attention.key_length", None)
    if head_dim is None:
        q = names.get("blk.0.attn_q.weight")
        head_dim = int(q.shape[0]) // n_head if q is not None else hidden // n_head
    head_dim = int(head_dim)

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", None)
    if scaling not in (None, "none"):
        factor = _f32(key("rope.scaling.factor", 1.0))
        original = key("rope.scaling.original_context_length", None)
        if scaling == "linear":
            rope.update(rope_type="linear", factor=factor)
        elif scaling == "yarn":
            rope.update(rope_type="yarn", factor=factor)
            if original is not None:
                rope["original_max_position_embeddings"] = int(original)
        else:
            raise ModelLoadError(f"{path}: rope scaling type {scaling!r} is not supported (linear and yarn are).")

    def token_id(name: str) -> int | None:
        value = md.get(f"tokenizer.ggml.{name}")
        return int(value) if value is not None else None

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        hidden_act="silu",
    )
    if model_type == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    elif model_type == "qwen2":
        del kwargs["head_dim"]  # Qwen2Config derives it (hidden // heads), it takes no argument
        if head_dim != hidden // n_head:
            raise ModelLoadError(f"{path}: qwen2 with head_dim {head_dim} != hidden/heads is not supported.")
    elif model_type == "qwen3":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    return model_type, kwargs


# ------------------------------------------------------------------------------------------ tensors


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute(w, n_head)``: GGML's interleaved rope rows back to HF's halves.

    llama.cpp wrote ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``: per head, HF row ``i`` of
    the first half and row ``i`` of the second half became rows ``2i`` and ``2i + 1``. Works on a
    weight (rows, cols) and on a bias (rows,). For ``k_proj`` pass the number of KV heads.
    """
    return w.index_select(0, torch.from_numpy(unpermute_rows(w.shape[0], n_head)))


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[index]``."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of an even size")
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def _slice_raw(f: _GGUFFile, t: _TensorInfo, spec, qtype):
    """Dequantize only rows [start, stop) (dim 0) or columns [start, stop) (dim 1) of a tensor
    straight from the memory map. Quantized rows are independent, so a row slice is a slice of the
    bytes; a column slice is one too when it falls on quantization-block edges, and otherwise is
    dequantized a few rows at a time (never the whole tensor at once)."""
    import gguf
    from gguf.quants import dequantize

    dim, start, stop = spec
    raw = f.raw(t)
    if dim == 0:
        part = raw[start:stop]
        return dequantize(np.ascontiguousarray(part), qtype).reshape((stop - start,) + tuple(t.shape[1:]))
    if dim != 1 or len(t.shape) != 2:
        raise ModelLoadError(f"{f.path}: cannot shard tensor {t.name!r} of shape {list(t.shape)} along dim {dim}")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = t.shape
    if start % block == 0 and stop % block == 0:
        part = np.ascontiguousarray(raw[:, start // block * type_size:stop // block * type_size])
        return dequantize(part, qtype).reshape(rows, stop - start)
    out = np.empty((rows, stop - start), dtype=np.float32)
    for r0 in range(0, rows, 256):
        r1 = min(rows, r0 + 256)
        out[r0:r1] = dequantize(np.ascontiguousarray(raw[r0:r1]), qtype).reshape(r1 - r0, cols)[:, start:stop]
    return out


def _load_tensors(f: _GGUFFile, config, gguf_arch: str, path: str, dtype: torch.dtype, shard_of=None,
                  only=None, keep_quantized: frozenset = frozenset()):
    import gguf
    from gguf.quants import dequantize

    unknown = [t.name for t in f.tensors if _hf_name(t.name) is None and t.name not in _EXTRA_TENSORS]
    if unknown:
        raise ModelLoadError(
            f"{path}: {len(unknown)} tensor(s) have no known meaning for architecture {gguf_arch!r} "
            f"(e.g. {', '.join(unknown[:5])}); this file is not a plain {gguf_arch} model."
        )
    permute = gguf_arch in _PERMUTED_QK_ARCHITECTURES
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    for t in f.tensors:
        if only is not None and t.name not in only:
            continue
        hf = _hf_name(t.name)
        spec = shard_of(hf) if shard_of is not None and hf is not None else None
        qtype = gguf.GGMLQuantizationType(t.type_id)
        if hf in keep_quantized and t.type_name in _BLOCK_FORMATS:
            tensors[hf] = _quantized_shard(f, t, hf, spec, permute, n_head, n_kv)
            continue
        try:
            if spec is None:
                array = dequantize(f.raw(t), qtype).reshape(t.shape)
            else:
                array = _slice_raw(f, t, spec, qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has type {t.type_name}, which cannot be "
                                 f"dequantized here ({exc}).") from None
        if permute and hf is not None and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
            heads = n_head if ".q_proj." in hf else n_kv
            if spec is not None:  # whole heads of rows: unpermute within this rank's heads
                heads = heads * array.shape[0] // t.shape[0]
            try:
                rows = unpermute_rows(array.shape[0], heads)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: tensor {t.name!r} of shape {list(t.shape)}: {exc}.") from None
            array = array[rows]  # a gather: a fresh array
        if not array.flags.writeable or not array.flags.c_contiguous or array.dtype != np.float32:
            array = np.array(array, dtype=np.float32, order="C")  # F32/F16 can still be views of the map
        tensor = torch.from_numpy(array)
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if hf is None:
            extra[t.name.removesuffix(".weight")] = tensor
        else:
            tensors[hf] = tensor
    return tensors, extra


def _quantized_shard(f: _GGUFFile, t: _TensorInfo, hf: str, spec, permute: bool, n_head: int, n_kv: int):
    """This rank's slice of a block-format tensor, still in blocks: rows are a byte slice, a K slice
    must fall on block edges (``QuantizedTensor.cols`` raises otherwise); q/k rows un-permuted
    within this rank's heads."""
    q = _quantized_view(f, t)
    if spec is not None:
        dim, start, stop = spec
        try:
            q = q.rows(start, stop) if dim == 0 else q.cols(start, stop)
        except ValueError as exc:
            raise ModelLoadError(f"{f.path}: tensor {t.name!r}: {exc}") from None
    if permute and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
        heads = (n_head if ".q_proj." in hf else n_kv) * q.shape[0] // t.shape[0]
        q = q.index_rows(torch.from_numpy(unpermute_rows(q.shape[0], heads)))
    return q


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.model_type == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def _check_tensors(config, tensors: dict[str, torch.Tensor], path: str) -> None:
    expected = _expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{path}: {len(missing)} tensor(s) the {config.architectures[0]} config calls for are missing from "
            f"the file (e.g. {', '.join(missing[:4])})."
        )
    def shape(n):  # tensors, or their shapes
        return tuple(tensors[n]) if isinstance(tensors[n], tuple) else tuple(tensors[n].shape)

    wrong = [f"{n} is {list(shape(n))}, expected {list(s)}" for n, s in expected.items() if shape(n) != s]
    if wrong:
        raise ModelLoadError(f"{path}: tensor shapes do not match the metadata: {'; '.join(wrong[:4])}.")


# ----------------------------------------------------------------------------------- llama3 rope


def _llama3_rope_from_freqs(freqs: np.ndarray, theta: float, head_dim: int, original_ctx: int):
    """Recover ``llama3`` rope parameters from llama.cpp's ``rope_freqs`` divisors, or None.

    llama.cpp stores, per frequency ``i``, the divisor it applies: 1 (high frequency), ``factor``
    (low frequency) or ``1 / ((1 - s) / factor + s)`` in between, with
    ``s = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    ``s`` is affine in ``1 / wavelen``; fitting that line gives the two frequency factors for the
    chosen ``original_ctx`` (any choice reproduces the same divisors).
    """
    freqs = np.asarray(freqs, dtype=np.float64)
    factor = float(freqs.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(inv_freq) != len(freqs):
        return None
    wavelen = 2 * math.pi / inv_freq
    inner = (freqs > 1.0 + 1e-4) & (freqs < factor - 1e-4 * factor)
    if inner.sum() < 2:
        return None
    s = (1.0 / freqs[inner] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[inner], s, 1)  # s = slope / wavelen + intercept
    if slope <= 0:
        return None
    span = original_ctx / slope  # high_freq_factor - low_freq_factor
    low = -intercept * span
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + span),
        "original_max_position_embeddings": int(original_ctx),
    }
    # The fit is exact up to float noise: prefer the round numbers configs use (1.0, 4.0) when they fit.
    rounded = dict(params, low_freq_factor=round(params["low_freq_factor"], 4),
                   high_freq_factor=round(params["high_freq_factor"], 4))
    if np.allclose(_llama3_divisors(rounded, wavelen), freqs, rtol=1e-4, atol=1e-4):
        params = rounded
    if not np.allclose(_llama3_divisors(params, wavelen), freqs, rtol=1e-3, atol=1e-3):
        return None
    return params


def _llama3_divisors(params: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """The per-frequency divisors llama.cpp derives from llama3 rope parameters."""
    factor, original_ctx = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    low_wl, high_wl = original_ctx / low, original_ctx / high
    smooth = (original_ctx / wavelen - low) / (high - low)
    with np.errstate(divide="ignore", invalid="ignore"):
        middle = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, middle))


def _fix_rope_from_freqs(config, extra: dict[str, torch.Tensor], path: str) -> None:
    freqs = extra.get("rope_freqs")
    if freqs is None:
        return
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        return  # the metadata already said how the rope is scaled
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    original_ctx = 8192  # Llama 3's; any value fits, see _llama3_rope_from_freqs
    params = _llama3_rope_from_freqs(freqs.float().numpy(), rope.get("rope_theta", 10000.0), head_dim, original_ctx)
    if params is None:
        logger.warning(
            "%s: has a rope_freqs tensor that is not Llama 3 rope scaling; it is left in extra_tensors "
            "and the model will use unscaled rope.", path,
        )
        return
    config.rope_parameters = params


# ---------------------------------------------------------------------------------------- tokenizer


def _build_tokenizer(path: str, md: dict[str, Any]):
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


def _eos_token_ids(md: dict[str, Any], tokenizer) -> list[int]:
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


# ------------------------------------------------------------------------ the engine's fast path


class GGUFModelConfig:
    """A model config straight from GGUF metadata, under Hugging Face's attribute names (what the
    model classes read), without building a transformers config (importing transformers' model
    configs cost ~2.5 s of a one-line chat)."""

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"GGUFModelConfig({self.__dict__!r})"


@dataclasses.dataclass
class GGUFModel:
    """A GGUF file opened for the engine: config and tokenizer ready, weights made on demand."""

    config: GGUFModelConfig
    tokenizer: Any
    eos_token_ids: list[int]
    metadata: dict[str, Any]
    path: str
    tensor_types: dict[str, str]  # HF name -> GGUF type name (F32, Q4_1, ...)
    _file: _GGUFFile = dataclasses.field(repr=False, default=None)
    _permute: bool = False

    def weights(self, dtype: torch.dtype = torch.float32, keep_quantized: frozenset = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in ``dtype``) pairs, each dequantized only when it is asked for, so that
        at most one float copy of one tensor exists beyond what the caller keeps. Tensors named in
        ``keep_quantized`` (and stored in a block format the CPU kernels run) come as a
        ``QuantizedTensor``: a view of the file's bytes (a copy only for permuted q/k rows)."""
        f, cfg = self._file, self.config
        for t in f.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                continue  # extra tensors (rope_freqs) were read when the file was opened
            permuted = self._permute and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf)
            rows = None
            if permuted:
                rows = torch.from_numpy(unpermute_rows(t.shape[0], cfg.num_attention_heads if ".q_proj." in hf
                                                       else cfg.num_key_value_heads))
            if hf in keep_quantized and t.type_name in _BLOCK_FORMATS:
                w = _quantized_view(f, t)
                yield hf, (w.index_rows(rows) if permuted else w)  # whole rows of blocks: exact
            else:
                w = _dequantize_torch(f, t, self.path, dtype)
                if permuted:
                    w = w.index_select(0, rows)
                yield hf, w
            f.release(t)  # the caller has copied it: its file pages need not count in our RSS



# GGUF types the CPU kernels run as they are (asyncengine/layers/linear.py, kernels/cpu/quant.c)
_BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q8_0")


def _quantized_view(f: _GGUFFile, t: _TensorInfo):
    """A 2-D block-format tensor as a ``QuantizedTensor`` over the memory map (no copy)."""
    from asyncengine.layers.linear import QuantizedTensor

    with warnings.catch_warnings():  # the map is read-only; layers copy out of it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(f._map, dtype=torch.uint8, count=f.nbytes(t), offset=t.offset)
    rows, cols = t.shape
    return QuantizedTensor(t.type_name, (rows, cols), raw.view(rows, -1))


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """HF name -> GGUF type name (F32, Q4_1, ...) of every model tensor, from the header alone."""
    f = _GGUFFile(_resolve_file(path))
    return {_hf_name(t.name): t.type_name for t in f.tensors if _hf_name(t.name)}


def _architecture(metadata: dict, path) -> str:
    """The file's ``general.architecture``, refused unless we support it."""
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch is None:
        raise ModelLoadError(f"{path}: the GGUF metadata has no 'general.architecture' key.")
    if gguf_arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}."
        )
    return gguf_arch


def open_gguf(path: str | os.PathLike, *, tokenizer: bool = True) -> GGUFModel:
    """Open a GGUF file for the engine: metadata, config and tokenizer now (milliseconds for the
    config, ~0.2 s for a 50k byte-level vocabulary), weights when :meth:`GGUFModel.weights` is
    consumed. Checks what :func:`load_gguf` checks, from the tensor table, before any weight is read."""
    path = _resolve_file(path)
    f = _GGUFFile(path)
    md = f.metadata
    gguf_arch = _architecture(md, path)
    _check_tensor_types(f, path)
    model_type, kwargs = _config_kwargs(f, gguf_arch, path)
    config = GGUFModelConfig(model_type, **kwargs)
    unknown = [t.name for t in f.tensors if _hf_name(t.name) is None and t.name not in _EXTRA_TENSORS]
    if unknown:
        raise ModelLoadError(
            f"{path}: {len(unknown)} tensor(s) have no known meaning for architecture {gguf_arch!r} "
            f"(e.g. {', '.join(unknown[:5])}); this file is not a plain {gguf_arch} model."
        )
    extra = {t.name.removesuffix(".weight"): _dequantize_torch(f, t, path, torch.float32)
             for t in f.tensors if t.name in _EXTRA_TENSORS}
    _fix_rope_from_freqs(config, extra, path)
    shapes = {_hf_name(t.name): t.shape for t in f.tensors if _hf_name(t.name) is not None}
    _check_tensors(config, shapes, path)
    permute = gguf_arch in _PERMUTED_QK_ARCHITECTURES
    if permute:
        for name, shape in shapes.items():
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
                if shape[0] % (2 * heads):
                    raise ModelLoadError(f"{path}: tensor {name!r} of shape {list(shape)}: {shape[0]} rows cannot "
                                         f"be split into {heads} heads of an even size.")
    tok = None
    if tokenizer:
        tok = _fast_tokenizer(f, md)
        if tok is None:  # not a vocabulary the fast path knows: transformers' conversion
            tok = _build_tokenizer(path, md)
    return GGUFModel(config=config, tokenizer=tok, eos_token_ids=_eos_token_ids(md, tok), metadata=md, path=path,
                     tensor_types={_hf_name(t.name): t.type_name for t in f.tensors if _hf_name(t.name)},
                     _file=f, _permute=permute)


def _fast_tokenizer(f: _GGUFFile, md: dict[str, Any]):
    """A :class:`~asyncengine.models.tokenizer.ChatTokenizer` for byte-level BPE vocabularies with
    GPT-2's or the StarCoder-family pre-tokenizer; None for anything else (the caller falls back)."""
    if md.get("tokenizer.ggml.model") != "gpt2":
        return None
    pre = md.get("tokenizer.ggml.pre")
    if pre not in _DIGIT_SPLIT_PRE and pre not in ("default", "gpt2", None):
        return None
    from asyncengine.models.tokenizer import ChatTokenizer, byte_level_bpe

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


def _dequantize_torch(f: _GGUFFile, t: _TensorInfo, path: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor as a fresh ``dtype`` tensor. F32/F16/BF16, Q8_0, Q4_0 and Q4_1 are decoded with
    torch (multi-threaded, no float64 detour); other types go through ``gguf.quants``."""
    import gguf

    qt = gguf.GGMLQuantizationType(t.type_id)
    with warnings.catch_warnings():  # the map is read-only; every path below copies
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(f._map, dtype=torch.uint8, count=f.nbytes(t), offset=t.offset)
    shape = t.shape
    if qt == gguf.GGMLQuantizationType.F32:
        return raw.view(torch.float32).view(shape).to(dtype, copy=True)
    if qt == gguf.GGMLQuantizationType.F16:
        return raw.view(torch.float16).view(shape).to(dtype, copy=True)
    if qt == gguf.GGMLQuantizationType.BF16:
        return raw.view(torch.bfloat16).view(shape).to(dtype, copy=True)
    if qt in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        b = raw.view(-1, size)
        d = b[:, 0:2].contiguous().view(torch.float16).to(torch.float32)  # [blocks, 1]
        if qt == gguf.GGMLQuantizationType.Q8_0:
            w = b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
        else:
            qs = b[:, 4:] if qt == gguf.GGMLQuantizationType.Q4_1 else b[:, 2:]
            q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.float32)  # elements 0-15, then 16-31
            if qt == gguf.GGMLQuantizationType.Q4_1:
                m = b[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
                w = torch.addcmul(m, q, d)
            else:
                w = (q - 8.0) * d
        return w.view(shape).to(dtype)
    try:
        array = gguf.quants.dequantize(f.raw(t), qt)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has type {t.type_name}, which cannot be "
                             f"dequantized here ({exc}).") from None
    return torch.from_numpy(np.ascontiguousarray(array.reshape(shape), dtype=np.float32)).to(dtype)
