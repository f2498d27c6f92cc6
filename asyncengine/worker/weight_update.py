"""New weights into a loaded model, in place, on one rank: checked in full before anything changes.

A trainer hands the engine its weights in the checkpoint's naming (``model.named_parameters()``
of the HF model, a ``state_dict``, or a safetensors path). The update is two-phase, so a bad one
leaves the old weights serving on every rank: :func:`stage` maps every tensor to its place (the
same mapping the loader uses: ``model.weight_targets``), takes this rank's slice of it (tensor
parallel), and checks names, shapes, dtypes and, unless ``partial``, that every parameter is
covered; it changes nothing. Once every rank staged without error the executor's next control
call :func:`apply`s it: each tensor goes through the layer's own ``load`` (which quantizes into a
block layer and unpacks/repacks the x8 layout), then the copies derived from the dense weights
(oneDNN's packed layout) are rebuilt and the native step's layer table is invalidated.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from asyncengine.layers.linear import Linear, QuantizedTensor, VocabEmbedding
from asyncengine.layers.moe import SparseMoE
from asyncengine.models.weight_loading import check_complete, load_tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WeightUpdate(msgspec.Struct, kw_only=True):
    """What crosses to every rank: the tensors (checkpoint names, full unsharded tensors) or a path
    each rank reads its own slices from. ``partial``: only the given tensors change."""

    tensors: list[tuple[str, object]] | None = None  # (name, torch.Tensor): pickled with the RPC
    path: str | None = None
    partial: bool = False


class StageResult(msgspec.Struct):
    """A rank's verdict on a staged update: ``error`` None when it would apply cleanly."""

    rank: int
    num_tensors: int
    error: str | None = None
    # names this rank has no place for (another pipeline stage's, or nobody's: the core decides)
    unclaimed: list[str] = []


@dataclass
class Staged:
    entries: list[tuple[str, str, int | None, torch.Tensor]] = field(default_factory=list)
    unclaimed: list[str] = field(default_factory=list)


def normalize(weights, partial: bool = False) -> WeightUpdate:
    """A ``WeightUpdate`` from what a caller may pass: a path (str/Path), a mapping name -> tensor,
    or an iterable of (name, tensor). Tensors are detached CPU copies' views (the trainer may go on
    changing its own); anything else is a ``ValueError`` naming it."""
    if isinstance(weights, (str, os.PathLike)):
        return WeightUpdate(path=os.fspath(weights), partial=partial)
    items = weights.items() if hasattr(weights, "items") else weights
    out = []
    try:
        for name, t in items:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise ValueError(f"update_weights takes (name, tensor) pairs; got ({type(name).__name__}, "
                                 f"{type(t).__name__})")
            out.append((name, t.detach().to("cpu", copy=True).contiguous()))
    except TypeError:
        raise ValueError(f"update_weights takes a state_dict, (name, tensor) pairs or a path, "
                         f"not {type(weights).__name__}") from None
    if not out:
        raise ValueError("update_weights got no tensors")
    return WeightUpdate(tensors=out, partial=partial)


def _read_path(model, path: str, sharded: bool):
    """(name, tensor) pairs of a safetensors folder or file; this rank's slices only when sharded."""
    from asyncengine.models.loader import _safetensors_weights  # lazy: only on this path (loading, profiling, a configuration)

    p = Path(path)
    if not p.exists():
        raise ValueError(f"update_weights: {path} does not exist")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"update_weights: {path} is not a .safetensors file or a checkpoint folder")
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as st:
            return [(n, st.get_tensor(n)) for n in st.keys()] if not sharded else \
                [(n, _slice(st.get_tensor(n), model.weight_shard(n))) for n in st.keys()]
    return list(_safetensors_weights(p, model.weight_shard if sharded else None))


def _slice(t: torch.Tensor, spec, last_rank: bool = False) -> torch.Tensor:
    """This rank's slice ``(dim, start, stop)`` of a full tensor. The last rank's slice ends where
    the full tensor does: checked there, so a tensor of the wrong full size fails on some rank."""
    if spec is None:
        return t
    dim, start, stop = spec
    if t.dim() <= dim or t.shape[dim] < stop or (last_rank and t.shape[dim] != stop):
        raise ValueError(f"shape {list(t.shape)} does not fit the model (this rank holds [{start}, {stop}) "
                         f"of dimension {dim})")
    return t.narrow(dim, start, stop - start)


def _expected_shape(modules: dict, params: dict, target: str, shard: int | None) -> tuple[int, ...] | None:
    """The shape the checkpoint tensor for ``target`` (part ``shard``) must have on this rank."""
    mod_name, _, leaf = target.rpartition(".")
    layer = modules.get(mod_name)
    if isinstance(layer, Linear) and leaf in ("weight", "bias"):
        rows = layer.parts[shard] if shard is not None else \
            (layer.valid_rows if isinstance(layer, VocabEmbedding) else layer.out_features)
        return (rows, layer.in_features) if leaf == "weight" else (rows,)
    if isinstance(layer, SparseMoE) and leaf in ("w13", "w2") and shard is not None:
        return layer.part_shape(shard)
    if target in params and shard is None:
        return tuple(params[target].shape)
    return None


def _targets(model, pairs, unclaimed: list[str]):
    """``model.weight_targets`` one tensor at a time, noting the names it skips that are not
    skipped on every rank (the rotary table, a tied head): another stage's, or no one's."""
    for name, tensor in pairs:
        got = list(model.weight_targets([(name, tensor)]))
        if not got:
            bare = name.removeprefix("model.")
            if "rotary_emb.inv_freq" not in name and bare != "lm_head.weight":
                unclaimed.append(name)
        yield from ((*t, name) for t in got)


def stage(model, update: WeightUpdate, tp_size: int = 1) -> Staged:
    """Map and check every tensor of ``update`` on this rank; raises ValueError naming the first
    problem. Nothing in ``model`` changes."""
    sharded = tp_size > 1
    if update.path is not None:
        pairs, pre_sliced = _read_path(model, update.path, sharded), True
    else:
        pairs, pre_sliced = update.tensors or [], False
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    staged, keys = Staged(), set()
    for name, target, shard, tensor, orig in _targets(model, pairs, staged.unclaimed):
        if isinstance(tensor, QuantizedTensor):
            raise ValueError(f"{name}: update_weights takes dense tensors")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')} is not a floating "
                             f"dtype the model can take (float32, bfloat16, float16)")
        # a tensor read whole from a path (no slice of its own: a stacked expert tensor) is cut here
        if sharded and (not pre_sliced or model.weight_shard(orig) is None):
            try:
                tensor = _slice(tensor, model.weight_shard(name), model.tp.rank == model.tp.size - 1)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        want = _expected_shape(modules, params, target, shard)
        if want is None:
            raise ValueError(f"{name}: no such tensor in {type(model).__name__}")
        if tuple(tensor.shape) != want:
            full = " (this rank's slice)" if sharded else ""
            raise ValueError(f"{name}: shape {list(tensor.shape)}{full} != the model's {list(want)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name}: holds NaN or infinite values")
        keys.add(f"{target}#{shard}")
        staged.entries.append((name, target, shard, tensor))
    _expert_keys(modules, keys)
    if not update.partial:
        try:
            check_complete(modules, params, keys)
        except KeyError as e:
            raise ValueError(f"update_weights: {e.args[0]} (pass partial=True to update only some)") from None
    return staged


def _expert_keys(modules: dict, keys: set[str]) -> None:
    """Count a MoE layer's ``w13`` / ``w2`` as covered once every expert part this rank owns is."""
    for n, m in modules.items():
        if isinstance(m, SparseMoE):
            parts = {int(k.rpartition("#")[2]) for k in keys if k.startswith((f"{n}.w13#", f"{n}.w2#"))
                     and not k.endswith("#None")}
            if m.parts_complete(parts):
                keys |= {f"{n}.w13#None", f"{n}.w2#None"}


@torch.no_grad()
def apply(model, staged: Staged) -> int:
    """Copy the staged tensors into ``model`` and rebuild what derives from them; returns how many."""
    from asyncengine.layers import packed_linear  # lazy: sleep, weight updates and hybrid models: loaded on first use

    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    touched = set()
    for name, target, shard, tensor in staged.entries:
        load_tensor(model, modules, params, name, target, shard, tensor)
        touched.add(target.rpartition(".")[0])
    for mod_name in touched:
        layer = modules.get(mod_name)
        if isinstance(layer, Linear) and layer.onednn_weight is not None:
            layer.onednn_weight = packed_linear.pack(layer.weight)
    Linear.mode_epoch += 1  # the native step re-reads its layer table
    return len(staged.entries)
