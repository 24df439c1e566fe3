"""A quantized linear layer's gradient for its input, so that LoRA adapters above a frozen quantized base train
(QLoRA: rdlm.model.lora, docs/fine-tuning.md). The weights never get one.

PyTorch's integer kernels (rdlm.model.quantize) have no derivative. The backward pass computes
grad_x = grad_y W from the weight dequantized a block of output rows at a time (`weight_rows`), so no float
copy of a whole layer is ever held: at Huginn-0125's shape a whole dequantized head is 1.3 GiB, a block of
rows of its widest layer 70 MiB.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rdlm.model.cuda_quant import unpack_int4
from rdlm.model.int4 import _PACK_ROWS, _from_cpu_int4_layout, dequantize_int4

# The layers here are rdlm.model.quantize.QuantizedLinear, which imports this module: typed Any, not imported.
QuantizedLinear = Any

# Output rows dequantized at a time: the CPU int4 layout's row blocks (it packs and unpacks that many at once).
BACKWARD_ROWS = _PACK_ROWS


def weight_rows(layer: QuantizedLinear, start: int, end: int) -> Tensor:
    """Rows start..end of `layer`'s dequantized weight, float32 [end - start, in], reading only those rows'
    integer weights (int4 on the CPU or tinygemm's: `start` a multiple of BACKWARD_ROWS, the layouts' row blocks)."""
    if layer.packed is not None:  # FBGEMM keeps the weight: unpacked whole, as int8
        weight, _ = torch.ops.quantized.linear_unpack(layer.packed)
        return weight.int_repr()[start:end].float() * layer.scales[start:end, None].float()
    if layer.scheme in ("int8", "w8a8"):
        return layer.qweight[start:end].float() * layer.scales[start:end, None].float()
    if layer.on_cpu or layer.cuda_kernel == "tinygemm":  # the kernel's layout, rows start..end unpacked
        rows, packed = end - start, layer.qweight
        per_entry = layer.out_features // packed.shape[0]  # output rows per entry of the layout's first dimension
        chunk = packed[start // per_entry : end // per_entry]
        unpack = _from_cpu_int4_layout if layer.on_cpu else unpack_int4
        q = unpack(chunk, rows, layer.in_features).float()
        scales, zeros = layer.scales_and_zeros[:, start:end].float().transpose(0, 1).unbind(-1)
        grouped = q.view(end - start, -1, layer.group_size)
        return ((grouped - 8) * scales[..., None] + zeros[..., None]).view(end - start, layer.in_features)
    return dequantize_int4(layer.qweight[start:end], layer.scales[start:end], layer.zeros[start:end], layer.group_size)


class _MatmulWithInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2: Tensor, layer: QuantizedLinear) -> Tensor:
        ctx.layer, ctx.input_dtype = layer, x2.dtype
        return layer.matmul(x2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        layer: QuantizedLinear = ctx.layer
        grad = grad.float()
        grad_x = torch.zeros(grad.shape[0], layer.in_features, device=grad.device)
        for start in range(0, layer.out_features, BACKWARD_ROWS):
            end = min(start + BACKWARD_ROWS, layer.out_features)
            grad_x.addmm_(grad[:, start:end], weight_rows(layer, start, end).to(grad.device))
        return grad_x.to(ctx.input_dtype), None


def matmul_with_input_grad(x2: Tensor, layer: QuantizedLinear) -> Tensor:
    """`layer.matmul(x2)` ([N, in] -> [N, out], on the layer's integer kernel), with a gradient for `x2`."""
    return _MatmulWithInputGrad.apply(x2, layer)
