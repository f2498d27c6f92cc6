"""The ggml tensor types: id, name and block geometry, as llama.cpp writes them into a GGUF file.

These ids and sizes are llama.cpp's stable file format (``enum ggml_type`` and ``type_traits`` in
ggml), so we keep our own copy: reading a file's tensor table then needs no ``gguf`` package, whose
import (~0.12 s, 88 ms of it ``gguf.constants``) was on the chat's start-up path only for this table.
tests/models/test_gguf.py checks every entry against ``gguf.GGMLQuantizationType`` / ``GGML_QUANT_SIZES``.
"""

from __future__ import annotations

import enum


class GGMLType(enum.IntEnum):
    """A tensor's type id in a GGUF file: every type gguf-py 0.16 (our oldest) knows. Ids 4, 5,
    31-33 and 36-38 were removed from ggml; newer types (MXFP4 = 39...) read as "unknown type id N"."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35


# type -> (elements per block, bytes per block); a row's length is a whole number of blocks
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (256, 2 + 2 + 256 // 16 + 256 // 4),
    GGMLType.Q3_K: (256, 2 + 256 // 4 + 256 // 8 + 12),
    GGMLType.Q4_K: (256, 2 + 2 + 256 // 2 + 12),
    GGMLType.Q5_K: (256, 2 + 2 + 256 // 2 + 256 // 8 + 12),
    GGMLType.Q6_K: (256, 2 + 256 // 2 + 256 // 4 + 256 // 16),
    GGMLType.Q8_K: (256, 4 + 256 + 256 // 8),
    GGMLType.IQ2_XXS: (256, 2 + 256 // 4),
    GGMLType.IQ2_XS: (256, 2 + 256 // 4 + 256 // 32),
    GGMLType.IQ3_XXS: (256, 2 + 256 // 4 + 256 // 8),
    GGMLType.IQ1_S: (256, 2 + 256 // 8 + 256 // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (256, 2 + 256 // 4 + 256 // 8 + 256 // 32 + 4),
    GGMLType.IQ2_S: (256, 2 + 256 // 4 + 256 // 16),
    GGMLType.IQ4_XS: (256, 2 + 2 + 256 // 2 + 256 // 64),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 256 // 8 + 256 // 16 + 256 // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 2 + 4 * 13),
    GGMLType.TQ2_0: (256, 2 + 64),
}

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
# The types we read (gguf.quants dequantizes them; see tensors.py for those torch decodes itself).
SUPPORTED_TENSOR_TYPES: frozenset[GGMLType] = frozenset(FLOAT_TYPES + tuple(GGMLType[n] for n in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M",
    "TQ1_0", "TQ2_0",
)))
# The types the CPU kernels run as they are (asyncengine/layers/linear.py, kernels/cpu/quant.c).
BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Handed to layers as blocks: the kernels' formats, and Q5_0 converted exactly to Q8_0 on the way
# (its values d * (q - 16), q < 32, are Q8_0 values with the same d: gguf/dequant.py's q5_0_as_q8_0)
KEPT_AS_BLOCKS = BLOCK_FORMATS + ("Q5_0",)


def type_name(type_id: int) -> str:
    """``Q4_1``..., or ``unknown type id N`` for an id this table does not know (a corrupt or newer file)."""
    try:
        return GGMLType(type_id).name
    except ValueError:
        return f"unknown type id {type_id}"
