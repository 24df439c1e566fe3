"""The int4 weights' layouts (rdlm.model.quantize): stored as nibbles, two columns to a byte (column 2j in the
low nibble, 2j+1 in the high one), and packed for PyTorch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`),
whose layout depends on the CPU's kernels and is read off the kernel itself."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_CPU_BLOCK_N = 32  # the CPU int4 kernel packs output rows in blocks of 32 or 64 (a tail of 16/32/48)
_PACK_ROWS = 1024  # rows packed (and unpacked) at a time: a multiple of every block, so blocks never straddle two


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the int4 layout holds a [out, in] layer (others fall back to int8)."""
    return in_features % group_size == 0 and out_features % _CPU_BLOCK_N == 0 and in_features % 2 == 0


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    q = _unpack_nibbles(packed).float()
    out_features, in_features = q.shape
    grouped = q.reshape(out_features, in_features // group_size, group_size)
    return ((grouped - 8) * scales.float()[..., None] + zeros.float()[..., None]).reshape(out_features, in_features)


def _pack_nibbles(q: Tensor) -> Tensor:
    """[out, in] values 0..15 -> uint8 [out, in/2]: column 2j low nibble, 2j+1 high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _to_cpu_int4_layout(q: Tensor) -> Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _nibbles_to_cpu_int4_layout(packed: Tensor, rows: int = _PACK_ROWS) -> Tensor:
    """`_to_cpu_int4_layout(_unpack_nibbles(packed))` a block of rows at a time: the kernel's layout keeps
    blocks of 32 or 64 output rows, and unpacking a whole head to int32 at once costs 8 bytes per weight of
    transient memory (128 MiB for a 32768x1024 head)."""
    return torch.cat(
        [_to_cpu_int4_layout(_unpack_nibbles(packed[i : i + rows])) for i in range(0, packed.shape[0], rows)]
    )


def _from_cpu_int4_layout(packed: Tensor, out_features: int, in_features: int, rows: int = _PACK_ROWS) -> Tensor:
    """The inverse of `_to_cpu_int4_layout` (tested against it), a block of rows at a time as
    `_nibbles_to_cpu_int4_layout` packs them. The layout is PyTorch's and depends on the CPU's kernels
    (blocks of 64 output rows with AVX-512, 32 with AVX2, adjacent rows paired without either), so it is
    read off the kernel itself (`_cpu_int4_order`), not assumed."""
    packed = packed.cpu()
    blocks = []
    for start in range(0, out_features, rows):
        chunk = packed[start : start + rows]
        order = _cpu_int4_order(chunk.shape[0], in_features)
        values = torch.empty(chunk.shape[0] * in_features, dtype=torch.uint8)
        values[order.long()] = _unpack_nibbles(chunk).flatten()
        blocks.append(values.view(chunk.shape[0], in_features))
    return torch.cat(blocks)


@functools.lru_cache(maxsize=4)
def _cpu_int4_order(out_features: int, in_features: int) -> Tensor:
    """For each nibble of the kernel's packed [out, in] weight (read as `_unpack_nibbles` does), the flat
    index (row * in + column) of the weight it holds. Packing is a permutation of the nibbles, so packing
    the indices themselves, 4 bits at a time, spells it out."""
    index = torch.arange(out_features * in_features, dtype=torch.int32).view(out_features, in_features)
    order = torch.zeros(out_features * in_features, dtype=torch.int32)
    for shift in range(0, max(1, (out_features * in_features - 1).bit_length()), 4):
        digits = _unpack_nibbles(_to_cpu_int4_layout((index >> shift) & 15)).flatten()
        order |= digits.to(torch.int32) << shift
    return order
