"""The w8a8 product in tensor ops (rdlm.model.w8a8): FBGEMM's quantization parameters and its product, which
the eager layer computes with FBGEMM itself."""

import torch

from rdlm.model.quantize import QuantizedLinear
from rdlm.model.w8a8 import QMAX, fbgemm_qparams, w8a8_matmul


def inputs():
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        x = torch.randn(3, 64, generator=g) * (0.01 + 10 * torch.rand((), generator=g))
        x = x + 4 * (torch.rand((), generator=g) - 0.5) * (i % 3)  # ranges off centre, one-sided
        yield x.abs() if i % 7 == 0 else -x.abs() if i % 11 == 0 else x


def test_the_quantization_parameters_are_pytorchs_own():
    # torch._choose_qparams_per_tensor is PyTorch's ChooseQuantizationParams, which FBGEMM's dynamic linear
    # calls (reduce_range: 7 bits); ours are tensor ops that compile
    for x in [*inputs(), torch.zeros(2, 8)]:
        scale, zero = fbgemm_qparams(x)
        want_scale, want_zero = torch._choose_qparams_per_tensor(x, True)
        assert scale.item() == torch.tensor(want_scale, dtype=torch.float32).item()
        assert zero.item() == want_zero and 0 <= want_zero <= QMAX


def test_the_product_is_fbgemms():
    """Against the eager layer's FBGEMM call on the same int8 weight. Both sum exact int32 products of the same
    integers and scale them by the same float32 product; rounding the input (x / scale against FBGEMM's own
    rounding) may differ at a tie, by one step of one input element: at most scale times the largest
    |weight| of a row, which bounds the difference."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_weight(torch.randn(96, 64) / 8, None, "w8a8", 32)
    layer.traceable()
    weight = layer.qweight.float() * layer.scales[:, None]
    equal = 0
    for x in inputs():
        ours, fbgemm = w8a8_matmul(x, layer.qweight, layer.scales), layer.matmul(x)
        step = fbgemm_qparams(x)[0] * weight.abs().amax()
        torch.testing.assert_close(ours, fbgemm, rtol=0, atol=float(step))
        equal += torch.equal(ours, fbgemm)
    assert equal >= 50  # (measured: all 60 equal on AVX-512; the bound is for a CPU that rounds otherwise)


def test_a_layer_made_traceable_holds_its_int8_weight_beside_fbgemms_copy():
    torch.manual_seed(1)
    layer = QuantizedLinear.from_weight(torch.randn(64, 32), torch.randn(64), "w8a8", 32)
    saved = layer.canonical()
    assert layer.qweight is None  # eagerly FBGEMM's packed copy is the only one
    layer.traceable()
    assert torch.equal(layer.qweight, saved["qweight"]) and layer.nbytes() == 2 * 64 * 32 + 4 * 64 + 4 * 64
    assert all(torch.equal(a, b) for a, b in zip(layer.canonical().values(), saved.values(), strict=True))
