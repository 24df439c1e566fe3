"""PyTorch's CUDA weight-only kernels for quantized layers (rdlm.model.quantize): int4 through tinygemm
(`aten._weight_int4pack_mm`, on the packed layout `aten._convert_weight_to_int4pack` makes, as gpt-fast
uses it) and int8 through `torch._weight_int8pack_mm`. Both read the integer weights inside the matmul, with
no dequantized copy, so the static step's CUDA graphs capture them like any other op.

Neither kernel runs on the CPU, and no GPU was available when this was written: a layer takes a kernel only
where `agrees` finds that it reproduces the dequantized reference on the layer's own device (a few random
rows, at quantization time), and keeps the dequantizing matmul otherwise; and the int4 layout is read back
(`unpack_int4`, for saving and for QLoRA's backward) by packing the weights' own indices through the kernel's
packing, as for the CPU's layout (rdlm.model.int4), not from an assumed layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rdlm.model.int4 import _PACK_ROWS, _pack_nibbles, _unpack_nibbles

INNER_K_TILES = 8  # tinygemm's k tiles per packed inner block (2, 4 or 8; gpt-fast's choice)
_N_TILE = 8  # tinygemm packs output rows in tiles of 8


def tinygemm_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether tinygemm's packed layout holds a [out, in] int4 layer of this group size."""
    return out_features % _N_TILE == 0 and in_features % (INNER_K_TILES * 16) == 0 and group_size in (32, 64, 128, 256)


def tinygemm_nibbles(packed: Tensor) -> Tensor:
    """Our nibbles (uint8 [out, in/2], column 2j low, 2j+1 high) in the order tinygemm's packing reads them
    (column 2j in the high nibble): the two nibbles of each byte swapped."""
    return ((packed & 15) << 4) | (packed >> 4)


def pack_int4(packed: Tensor) -> Tensor:
    """Our nibbles [out, in/2] (on a CUDA device) in tinygemm's layout."""
    return torch.ops.aten._convert_weight_to_int4pack(tinygemm_nibbles(packed).contiguous(), INNER_K_TILES)


def int4_matmul(x2: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """x2 [N, in] times the tinygemm-packed weight, bfloat16 activations (the kernel's), float32 [N, out]."""
    y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), packed, group_size, scales_and_zeros)
    return y.float()


def int8_matmul(x2: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    """x2 [N, in] times the int8 weight [out, in] with its per-row bfloat16 `scales`, float32 [N, out]."""
    return torch._weight_int8pack_mm(x2.to(scales.dtype).contiguous(), qweight, scales).float()


def agrees(kernel: Callable[[Tensor], Tensor], weight: Tensor, rows: int = 4) -> bool:
    """Whether `kernel` (x [rows, in] -> x W^T [rows, out]) computes `weight` (the dequantized reference of the
    layer's first output rows, float32 [n, in], on the kernel's device) on random inputs; False where it raises
    (no such kernel on this device or build). Bound: the kernels take bfloat16 activations and dequantize to
    bfloat16 (a relative error of 2^-9 each in a product) and sum in float32, so each output is within 2^-7 of
    the sum of its terms' magnitudes."""
    generator = torch.Generator(weight.device).manual_seed(0)  # its own: the caller's random stream is untouched
    x = torch.randn(rows, weight.shape[1], device=weight.device, generator=generator).to(torch.bfloat16).float()
    try:
        y = kernel(x)
    except (RuntimeError, NotImplementedError):
        return False
    if y.dim() != 2 or y.shape[0] != rows or y.shape[1] < weight.shape[0]:
        return False
    bound = (x.abs() @ weight.abs().T) * 2**-7 + 1e-6
    return bool(((y[:, : weight.shape[0]].float() - x @ weight.T).abs() <= bound).all())


def unpack_int4(
    packed: Tensor, out_features: int, in_features: int, pack: Callable[[Tensor], Tensor] = pack_int4
) -> Tensor:
    """The inverse of `pack` (tinygemm's `pack_int4`): the values 0..15, uint8 [out, in], on the packed tensor's
    device, a block of output rows at a time. Packing is a permutation of the nibbles, so packing the weights'
    flat indices, four bits at a time, spells out where each one went."""
    per_entry = out_features // packed.shape[0]  # output rows per entry of the packed tensor's first dimension
    blocks = []
    for start in range(0, out_features, _PACK_ROWS):
        rows = min(_PACK_ROWS, out_features - start)
        chunk = packed[start // per_entry : (start + rows) // per_entry]
        order = _order(rows, in_features, packed.device, pack)
        values = torch.empty(rows * in_features, dtype=torch.uint8, device=packed.device)
        values[order] = _nibbles_of(chunk, rows).to(torch.uint8)
        blocks.append(values.view(rows, in_features))
    return torch.cat(blocks)


def _nibbles_of(packed: Tensor, rows: int) -> Tensor:
    """Every nibble of a packed tensor, in memory order (as bytes read low nibble first)."""
    return _unpack_nibbles(packed.contiguous().view(torch.uint8).reshape(rows, -1)).flatten().long()


def _order(rows: int, in_features: int, device: torch.device, pack: Callable[[Tensor], Tensor]) -> Tensor:
    """For each nibble of the packed [rows, in] weight (read as `_nibbles_of` reads it), the flat index
    (row * in + column) of the weight it holds."""
    index = torch.arange(rows * in_features, dtype=torch.int32, device=device).view(rows, in_features)
    order = torch.zeros(rows * in_features, dtype=torch.long, device=device)
    for shift in range(0, max(1, (rows * in_features - 1).bit_length()), 4):
        digits = _pack_nibbles((index >> shift) & 15)
        order |= _nibbles_of(pack(digits), rows) << shift
    return order
