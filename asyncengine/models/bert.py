"""BERT encoder (bidirectional attention) for embeddings and cross-encoder reranking.

An encoder sees the whole prompt at once and keeps no KV cache: every token attends to every
other token of its own sequence. The packed batch (sequences back to back, ``query_start_loc``)
runs packed through every projection and MLP; only q/k/v are scattered into a padded [n, L, H]
block, so one SDPA call with a key-padding mask serves the batch. Module names equal
transformers' ``BertModel`` so a checkpoint's tensors load by name (``bert.`` prefix of the ForSequenceClassification head stripped)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.layers import packed_linear
from asyncengine.layers.pooler import pool_batch

ENCODER_ARCHS = ("BertModel", "BertForSequenceClassification")
# RoBERTa / XLM-R: BERT's modules with positions counted from pad_token_id + 1 (bert_engine.py)
ROBERTA_ARCHS = ("RobertaModel", "RobertaForSequenceClassification", "XLMRobertaModel",
                 "XLMRobertaForSequenceClassification")


class _Embeddings(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h = c["hidden_size"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], h)
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(c.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=c.get("layer_norm_eps", 1e-12))

    def forward(self, ids, positions, types):
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class _Dense(nn.Module):
    """dense -> LayerNorm(x + residual): BERT's post-norm output block."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class _SelfAttention(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)


class _Attention(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.self = _SelfAttention(h)
        self.output = _Dense(h, h, eps)


class _Intermediate(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.dense = nn.Linear(h, i)


class _Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c.get("layer_norm_eps", 1e-12)
        self.heads = c["num_attention_heads"]
        self.attention = _Attention(h, eps)
        self.intermediate = _Intermediate(h, c["intermediate_size"])
        self.output = _Dense(c["intermediate_size"], h, eps)
        # made by BertEncoder.prepare once the weights are final; not parameters (not in the checkpoint):
        # q/k/v as one (weight, bias), and the oneDNN-packed qkv, attention-output, intermediate and
        # output weights (None where oneDNN does not run them)
        self.qkv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.packed: tuple[torch.Tensor, ...] | None = None

    def forward(self, x: torch.Tensor, where: tuple, key_mask: torch.Tensor) -> torch.Tensor:
        """x packed [M, H] (M >= T tokens: rows past T are the padding of a row bucket);
        ``where`` = (flat, padded, rows): each token's row in the padded [n * L] block, that
        zero-filled block [n * L, 3H] and a zero-filled [M, H] (both shared by the layers);
        key_mask [n, 1, 1, L].

        Only the attention sees padding: the projections and the MLP (most of the FLOPs) run on
        the packed tokens, so a batch of uneven lengths does no work for its pad. The pad rows of
        both buffers are written nowhere, so they stay zero (finite keys and values the mask
        hides) in every layer, and q, k and v are strided views of the one block: no per-layer
        fill or copy. With packed weights the bias, GELU and residual adds run in the GEMMs'
        epilogues (layers/packed_linear.py)."""
        flat, padded, rows = where
        n, L, T, h = key_mask.shape[0], key_mask.shape[-1], flat.numel(), x.shape[-1]
        att_out, inter, out = self.attention.output, self.intermediate.dense, self.output
        if self.packed is not None:
            qkv = packed_linear.linear_epilogue(x, self.packed[0], self.qkv[1])
        elif self.qkv is not None:
            qkv = F.linear(x, *self.qkv)
        else:  # a hand-built model: three GEMMs
            sa = self.attention.self
            qkv = torch.cat([sa.query(x), sa.key(x), sa.value(x)], dim=-1)
        padded.index_copy_(0, flat, qkv[:T])
        q, k, v = padded.view(n, L, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask)
        torch.index_select(a.transpose(1, 2).reshape(n * L, h), 0, flat, out=rows[:T])
        if self.packed is None:
            x = att_out(rows, x)
            return out(F.gelu(inter(x)), x)
        x = att_out.LayerNorm(packed_linear.linear_epilogue(rows, self.packed[1], att_out.dense.bias, residual=x))
        mid = packed_linear.linear_epilogue(x, self.packed[2], inter.bias, gelu=True)
        return out.LayerNorm(packed_linear.linear_epilogue(mid, self.packed[3], out.dense.bias, residual=x))


class _Encoder(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))


class _Pooler(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.dense = nn.Linear(h, h)


def _check_config(c: dict) -> None:
    act = c.get("hidden_act", "gelu")
    if act != "gelu":
        raise ModelLoadError(f"BERT hidden_act {act!r} is not supported (only 'gelu')")
    pos = c.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ModelLoadError(f"BERT position_embedding_type {pos!r} is not supported (only 'absolute')")


class BertEncoder(nn.Module):
    """BertModel (+ the classification head when the checkpoint has one)."""

    def __init__(self, c: dict, with_pooler: bool = False, num_labels: int = 0) -> None:
        super().__init__()
        _check_config(c)
        self.config = c
        self.embeddings = _Embeddings(c)
        self.encoder = _Encoder(c)
        self.pooler = _Pooler(c["hidden_size"]) if with_pooler or num_labels else None
        self.classifier = nn.Linear(c["hidden_size"], num_labels) if num_labels else None
        # RoBERTa's position ids start after its padding index (transformers' create_position_ids_from_input_ids)
        self.position_offset = c.get("pad_token_id", 1) + 1 if c.get("model_type") in ("roberta", "xlm-roberta") else 0

    def prepare(self) -> None:
        """Fuse each layer's q, k, v weights into one matrix and, where oneDNN runs this model's
        projections (CPU, fp32 or bf16, ``ASYNCENGINE_PREPACK`` not off, the copies fit the memory
        budget), pack the four GEMMs' weights once. Call again after changing weights."""
        layers = list(self.encoder.layer)
        for layer in layers:
            sa = layer.attention.self
            layer.qkv = (torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]).detach(),
                         torch.cat([sa.query.bias, sa.key.bias, sa.value.bias]).detach())
            layer.packed = None
        w = layers[0].qkv[0] if layers else None
        if (w is None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or not packed_linear.enabled() or not packed_linear.available()):
            return
        weights = [[ly.qkv[0], ly.attention.output.dense.weight, ly.intermediate.dense.weight,
                    ly.output.dense.weight] for ly in layers]
        if packed_linear.fits(4 * len(layers), sum(t.numel() * t.element_size() for ws in weights for t in ws)):
            for layer, ws in zip(layers, weights):
                layer.packed = tuple(packed_linear.pack(t) for t in ws)

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    def forward(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Packed ids [T] -> packed last hidden states [T, H]."""
        T = input_ids.shape[0]
        starts = query_start_loc[:-1].to(torch.int64)
        lens = query_start_loc[1:].to(torch.int64) - starts
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=input_ids.device), lens, output_size=T)
        pos = torch.arange(T, device=input_ids.device) - starts[seq]
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.embeddings(input_ids, pos + self.position_offset if self.position_offset else pos, types)
        n, L, h = lens.numel(), int(lens.max()), x.shape[-1]
        key_mask = (torch.arange(L, device=x.device)[None, :] < lens[:, None]).view(n, 1, 1, L)
        layers = self.encoder.layer
        # packed GEMMs: rows padded to a bucket, so a new batch size rarely means a new oneDNN primitive
        M = packed_linear.bucket_rows(T) if layers and layers[0].packed is not None else T
        if M != T:
            x = torch.cat([x, x.new_zeros(M - T, h)])
        where = (seq * L + pos, x.new_zeros(n * L, 3 * h), x.new_zeros(M, h))
        for layer in layers:
            x = layer(x, where, key_mask)
        return x[:T]

    def classify(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """The sequence-classification logits [n, num_labels] from the CLS token (tanh pooler)."""
        if self.classifier is None:
            raise ValueError("this checkpoint has no classification head")
        cls = hidden.index_select(0, query_start_loc[:-1].to(torch.int64))
        return self.classifier(torch.tanh(self.pooler.dense(cls)))


def _checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # lazy: only encoder checkpoints read this way

    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if k.endswith("position_ids"):
                continue  # a buffer some versions save; we compute positions
            out[k.removeprefix("bert.")] = v
    return out


def load_bert(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> BertEncoder:
    """A BertEncoder with the checkpoint's weights; strict: a missing or stray tensor is an error."""
    root = Path(model_dir)
    c = json.loads((root / "config.json").read_text())
    archs = c.get("architectures") or ["BertModel"]
    if archs[0] not in ENCODER_ARCHS:
        raise ModelLoadError(f"{archs[0]} is not a BERT encoder ({', '.join(ENCODER_ARCHS)})")
    tensors = _checkpoint_tensors(root)
    num_labels = 0
    if archs[0] == "BertForSequenceClassification":
        num_labels = len(c.get("id2label") or {}) or c.get("num_labels", 2)
    model = BertEncoder(c, with_pooler="pooler.dense.weight" in tensors, num_labels=num_labels)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{root}: checkpoint does not fit {archs[0]}: {e}") from None
    model = model.to(dtype).eval()
    model.prepare()
    return model


def _pack(token_lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise ValueError("every input needs at least one token")
    ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.int64, device=device)
    lens = torch.tensor([0] + [len(t) for t in token_lists], device=device)
    return ids, lens.cumsum(0)


@torch.inference_mode()
def embed_token_ids(model: BertEncoder, token_lists: list[list[int]], specs) -> list[torch.Tensor]:
    """One float32 embedding per input (``specs``: a PoolingSpec each), in one packed forward."""
    dev = next(model.parameters()).device
    ids, qsl = _pack(token_lists, dev)
    return pool_batch(model(ids, qsl), qsl, list(specs))


@torch.inference_mode()
def classify_token_ids(model: BertEncoder, token_lists: list[list[int]],
                       type_lists: list[list[int]] | None = None) -> torch.Tensor:
    """Cross-encoder logits [n, num_labels] for packed (query, document) pairs."""
    dev = next(model.parameters()).device
    ids, qsl = _pack(token_lists, dev)
    types = None if type_lists is None else torch.tensor(
        [t for ts in type_lists for t in ts], dtype=torch.int64, device=dev)
    return model.classify(model(ids, qsl, types), qsl)


def rerank_scores(model: BertEncoder, token_lists: list[list[int]], type_lists: list[list[int]]) -> torch.Tensor:
    """Relevance in (0, 1) per (query, document) pair: the sigmoid of a one-label cross-encoder's
    logit, as sentence-transformers' CrossEncoder and the Jina/Cohere rerank APIs report it."""
    logits = classify_token_ids(model, token_lists, type_lists)
    if logits.shape[-1] != 1:
        raise ValueError(f"rerank needs a one-label cross-encoder; this head has {logits.shape[-1]} labels")
    return torch.sigmoid(logits[:, 0].float())
