"""The Llama family's decode step as one native call (kernels/cpu/step.c), beside the per-op model.

Why: at batch 1 on 2 cores the default model's layer kernels take ~70 us, and the ~10 Python-level
calls between them cost as much again (docs/cpu_decode.md has the per-layer profile); a serving
app's own Python also had to win the interpreter lock back at every op. One ctypes call per step
runs every layer (ctypes releases the lock for it); Python keeps scheduling, the embedding, the
LM head and sampling.

When it runs (:func:`native_step_reason` says why not, otherwise None): CPU, fp32 activations,
every projection in a GGUF block format, the cpu attention backend's kernels, one rank, per-head
q/k norms (Qwen3) or none, a step of at most ``MAX_TOKENS`` rows all attended by the kernel.
Mixture-of-experts layers with block-quantized experts (GGUF MoE files: Mixtral, Qwen2/3-MoE) run
in it as one call each to kernels/cpu/moe.c, the call the per-op model's MoE layer makes too
(layers/moe_native.py), so both paths give the same bits. Rows under LoRA adapters run in it
too (not on MoE models): after each projection's GEMM, kernels/cpu/lora.c adds each adapter's
low-rank product to its rows, from the slot stacks of ``model.lora`` (lora/hooks.py) on the CPU
in fp32 (a tensor-parallel or non-CPU LoRA keeps the per-op path and its hooks).
``ASYNCENGINE_NATIVE_STEP=0`` turns it off (the per-op model is the reference, and the test holds
the two to the same greedy tokens); ``=1`` makes a model it cannot serve an error.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from asyncengine.attention.cpu_backend import CpuAttentionMetadata
from asyncengine.attention.int8_cache import Int8AttentionMetadata
from asyncengine.kernels.cpu import lora as cpu_lora, quant
from asyncengine.kernels.cpu.build import load
from asyncengine.layers import moe_native
from asyncengine.layers.linear import Linear
from asyncengine.layers.moe import SparseMoE
from asyncengine.models.llama import LlamaForCausalLM

# Steps up to this many token rows (decode batches, speculative rows, short prefill chunks) run
# natively; longer prefill chunks keep the per-op path, whose large-M GEMMs (fp32 mode: tiled
# dequantize + torch.mm) are faster there, and which already beats llama.cpp's pp32 / pp512.
MAX_TOKENS = 32


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", ctypes.c_void_p),
                ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("qkv_type", ctypes.c_int32), ("o_type", ctypes.c_int32), ("gate_up_type", ctypes.c_int32),
                ("down_type", ctypes.c_int32), ("window", ctypes.c_int32), ("act_int8", ctypes.c_int32),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("moe", ctypes.c_void_p),
                ("moe_load", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("num_blocks", ctypes.c_int32), ("block_size", ctypes.c_int32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("nthreads", ctypes.c_int32), ("kv_int8", ctypes.c_int32)]


class _Batch(ctypes.Structure):
    _fields_ = [("cos", ctypes.c_void_p), ("sin_signed", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("block_ids", ctypes.c_void_p), ("block_starts", ctypes.c_void_p),
                ("query_starts", ctypes.c_void_p), ("query_lens", ctypes.c_void_p),
                ("context_lens", ctypes.c_void_p), ("T", ctypes.c_int32), ("num_seqs", ctypes.c_int32),
                ("attn_parallel", ctypes.c_int32)]


def lora_native_reason(lora) -> str | None:
    """None where the native step can add ``lora``'s (a LoRAModel) products, else why not."""
    if lora is None:
        return "no LoRA slots on the model"
    return lora.cpu_kernel_reason()


def _mode() -> str:
    mode = os.environ.get("ASYNCENGINE_NATIVE_STEP", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"ASYNCENGINE_NATIVE_STEP={mode!r}: expected auto, 0 or 1")
    return mode


def native_step_reason(model) -> str | None:
    """None where :class:`NativeStep` can run ``model``'s steps, else why not."""

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not of the Llama family"
    if getattr(model, "native_step_unsupported", None):
        return model.native_step_unsupported
    if model.rotary.rotary_dim != model.args.head_dim:
        return "partial rotary (Phi-4-mini) is not in the native step"
    if model.args.qk_norm and any(n.eps != model.norm.eps for layer in model.layers
                                  for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)):
        return "q/k norms with another epsilon than the layer norms'"
    if model.tp.size > 1:
        return "tensor parallel"
    if load() is None:
        return "the C kernels are not built"
    if model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return f"activations are {model.norm.weight.dtype} on {model.norm.weight.device}, not float32 on cpu"
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            why = moe_native.native_reason(layer.mlp)
            if why is not None:
                return f"a mixture-of-experts layer: {why}"
            mlp = ()
        else:
            mlp = (layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if layer.mlp.act_and_mul.name != "silu":
                return f"activation {layer.mlp.act_and_mul.name}"
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp):
            if not lin.quantized:
                return "a projection is dense (the native step runs block-quantized weights)"
    return None


class NativeStep:
    """The decoder layers of one step in one C call; build with :meth:`for_model` (None where it
    does not apply)."""

    def __init__(self, model) -> None:
        self.model = model
        self.lib = load()
        self.fn = self.lib.ae_llama_step
        self.fn.argtypes = [ctypes.c_void_p] * 7
        self.fn.restype = ctypes.c_int
        self._caches_key = None
        self._layers = None
        self._lora = None  # (the LoRAModel, its projection table): built once, its slots never move
        self.lora_calls = 0  # steps run here with adapter rows (the tests hold it above zero)
        # the dense MLPs' intermediate size (the step's scratch; 0 when every layer is MoE)
        self.inter = max((getattr(layer.mlp, "inter", 0) for layer in model.layers), default=0)

    def forget(self) -> None:
        """Drop the tables (they point into the KV caches and the LoRA slots): sleep, weight updates."""
        self._keep = self._layers = self._caches_key = self._lora = None
        for layer in self.model.layers:  # the MoE layers' C tables point into their weights too
            if isinstance(layer.mlp, SparseMoE):
                moe_native.forget(layer.mlp)

    @classmethod
    def for_model(cls, model) -> "NativeStep | None":
        mode = _mode()
        if mode == "0":
            return None
        why = native_step_reason(model)
        if why is not None and getattr(model, "is_moe", False):
            # a MoE model on the CPU would otherwise look like it lost the fast decode path silently
            logging.getLogger(__name__).info("decode: the torch step (%s)", why)
        if why is not None:
            if mode == "1":
                raise ValueError(f"ASYNCENGINE_NATIVE_STEP=1, but this model cannot run natively: {why}")
            return None
        return cls(model)

    def accepts(self, num_tokens: int, meta) -> bool:
        m = self.model
        if m.lora_active and (lora_native_reason(m.lora) is not None or getattr(m, "is_moe", False)):
            return False
        return (num_tokens <= MAX_TOKENS and isinstance(meta, (CpuAttentionMetadata, Int8AttentionMetadata))
                and not meta.prefills and getattr(meta.backend, "kernels", False) and meta.backend.dtype == torch.float32)

    def _layer_table(self, kv_caches, backend):
        # the layers' modes and layouts too: set_quantized_activations may switch them between steps

        key = (tuple(k.data_ptr() for k, _ in kv_caches), Linear.mode_epoch, quant.ACTIVATIONS)
        if key != self._caches_key:
            m = self.model
            table = (_Layer * len(m.layers))()
            for i, (layer, (kc, vc)) in enumerate(zip(m.layers, kv_caches)):
                table[i] = self._layer(layer, kc, vc)
            self._layers, self._caches_key = table, key
            self._keep = (kv_caches, [layer.mlp.native_cache for layer in m.layers
                                      if isinstance(layer.mlp, SparseMoE)])  # the table points into them
        return self._layers

    def _layer(self, layer, kc, vc) -> _Layer:
        at, mlp = layer.self_attn, layer.mlp
        moe = moe_native.table(mlp) if isinstance(mlp, SparseMoE) else None
        if isinstance(mlp, SparseMoE) and moe is None:
            raise ValueError("native step: a MoE layer's experts mix activation modes")
        qkv, o = at.qkv_proj, at.o_proj
        gu, down = (None, None) if moe is not None else (mlp.gate_up_proj, mlp.down_proj)
        lins = [lin for lin in (qkv, o, gu, down) if lin is not None]
        acts = {lin.activations or quant.ACTIVATIONS for lin in lins}
        if len(acts) != 1 or not (kc.is_contiguous() and vc.is_contiguous()):
            raise ValueError("native step: mixed activation modes or a non-contiguous KV cache")
        load = moe_native.load_counter(mlp) if moe is not None else None
        return _Layer(
            layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
            qkv.qweight.data_ptr(), o.qweight.data_ptr(), gu.qweight.data_ptr() if gu else None,
            down.qweight.data_ptr() if down else None,
            qkv.bias.data_ptr() if qkv.bias is not None else None, kc.data_ptr(), vc.data_ptr(),
            quant.type_id(qkv.qtype, qkv.packed), quant.type_id(o.qtype, o.packed),
            quant.type_id(gu.qtype, gu.packed) if gu else 0, quant.type_id(down.qtype, down.packed) if down else 0,
            at.sliding_window or 0, int(acts.pop() == "int8"),
            at.q_norm.weight.data_ptr() if at.q_norm is not None else None,
            at.k_norm.weight.data_ptr() if at.k_norm is not None else None,
            moe.address if moe is not None else None, load.data_ptr() if load is not None else None)

    def _lora_step(self, t: int) -> cpu_lora.StepLoRA | None:
        """This step's adapters for the C step (None: base rows only)."""
        m = self.model
        lora = m.lora
        if not m.lora_active or lora is None or lora.native_rows is None:
            return None
        rows = lora.native_rows
        if rows.numel() != t:
            raise ValueError(f"native step: {rows.numel()} LoRA row slots for a step of {t} rows")
        if self._lora is None or self._lora[0] is not lora:
            if len(lora.slots.layers) != 4 * len(m.layers):
                raise ValueError(f"native step: {len(lora.slots.layers)} LoRA slot stacks for {len(m.layers)} layers")
            self._lora = (lora, cpu_lora.proj_table(lora.slots.layers))
        self.lora_calls += 1
        return cpu_lora.StepLoRA(ctypes.addressof(self._lora[1]), rows.data_ptr(), lora.slots.max_loras,
                                 lora.max_lora_rank)

    def __call__(self, x: torch.Tensor, rope, kv_caches, meta) -> torch.Tensor:
        """x: the step's embeddings [T, H] fp32 (used as scratch); returns the final norm's output."""
        from asyncengine.kernels.cpu.attention import PARALLEL_MIN_WORK  # lazy: the kernels build/load (C compile, triton) only on this path

        m, a = self.model, self.model.args
        backend = meta.backend
        t = x.shape[0]
        x = x.contiguous()
        cos, sin = (r.reshape(t, -1).contiguous() for r in rope)
        kc0 = kv_caches[0][0]
        hk, nb, bs, _ = kc0.shape
        d = backend.head_dim  # (an int8 cache's rows are longer: values + scale)
        dims = _Dims(len(m.layers), a.hidden_size, m.num_heads, m.num_kv_heads, d, self.inter, nb, bs, m.norm.eps,
                     backend.scale, torch.get_num_threads(), int(backend.kv_int8))
        p = meta.paged
        batch = _Batch(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), p.block_ids.data_ptr(),
                       p.block_starts.data_ptr(), p.query_starts.data_ptr(), p.query_lens.data_ptr(),
                       p.context_lens.data_ptr(), t, p.num_seqs,
                       int(p.work * m.num_heads * d >= PARALLEL_MIN_WORK))
        hidden = torch.empty(t, a.hidden_size, dtype=torch.float32)
        lora = self._lora_step(t)
        rc = self.fn(ctypes.addressof(self._layer_table(kv_caches, backend)), ctypes.addressof(dims),
                     ctypes.addressof(batch), x.data_ptr(), m.norm.weight.data_ptr(), hidden.data_ptr(),
                     None if lora is None else ctypes.addressof(lora))
        if rc:
            raise MemoryError(f"the native decode step failed ({rc}: out of memory?)") if rc == -2 else \
                RuntimeError(f"the native decode step failed ({rc}: a bad argument, a LoRA row slot, or a GEMM)")
        return hidden
