"""The w8a8 matmul on the CPU in plain tensor ops (rdlm.model.quantize), for compiled code.

Eagerly a w8a8 layer runs FBGEMM's dynamic int8 linear (`quantized::linear_dynamic`, reduce_range): it
quantizes the input per tensor to 7 bits and multiplies int8 by int8. FBGEMM's packed weight is an opaque
object that torch.compile cannot trace, so the compiled decode step (rdlm.inference.execution.cpu_compile) computes
the same thing in ops it can: FBGEMM's scale and zero point (`fbgemm_qparams`), the rounded input, and the
integer product by `torch._int_mm` (exact int32 sums, as FBGEMM's), scaled back in float32. The input's
zero point is subtracted before the product: the shifted values lie in [-127, 127], an int8 like the weight.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

QMAX = 127  # reduce_range: 7 bits, so that FBGEMM's 16-bit intermediate sums cannot overflow


def fbgemm_qparams(x: Tensor) -> tuple[Tensor, Tensor]:
    """The per-tensor scale (float32) and zero point (int64) FBGEMM's dynamic linear chooses for `x`, as
    ChooseQuantizationParams computes them (in double; the range widened to hold 0; the zero point taken from
    whichever end of the range it errs least at, then rounded and clamped)."""
    low = x.min().clamp(max=0).double()
    high = x.max().clamp(min=0).double()
    scale = (high - low) / QMAX
    degenerate = (scale.float() == 0) | torch.isinf(1 / scale.float())
    scale = torch.where(degenerate, torch.full_like(scale, 0.1), scale)
    from_low, from_high = -low / scale, QMAX - high / scale
    # the error at each end: |qmin| + |min / scale| against |qmax| + |max / scale| (qmin = 0)
    zero = torch.where(low.abs() / scale < QMAX + high.abs() / scale, from_low, from_high)
    return scale.float(), zero.clamp(0, QMAX).round().long()


def w8a8_matmul(x2: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    """x2 [N, in] (float) times the int8 weight [out, in] with its per-row `scales`, the input quantized as
    FBGEMM's dynamic linear quantizes it; float32 [N, out]."""
    scale, zero = fbgemm_qparams(x2)
    shifted = (torch.clamp(torch.round(x2.float() / scale) + zero, 0, QMAX) - zero).to(torch.int8)
    return torch._int_mm(shifted, qweight.t()).float() * (scale * scales.float())


def fbgemm_pack(qweight: Tensor, scales: Tensor) -> torch.ScriptObject:
    """FBGEMM's prepacked form of an int8 weight [out, in] with per-row `scales` (it keeps its own copy).
    Raises AttributeError or RuntimeError where this PyTorch has no FBGEMM quantized linear."""
    with warnings.catch_warnings():  # PyTorch marks its quantized tensors deprecated (docs/quantization.md)
        warnings.simplefilter("ignore", UserWarning)
        zeros = torch.zeros(qweight.shape[0], dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def fbgemm_unpack(packed: torch.ScriptObject) -> Tensor:
    """The int8 weight [out, in] `fbgemm_pack` packed."""
    weight, _ = torch.ops.quantized.linear_unpack(packed)
    return weight.int_repr().contiguous()
