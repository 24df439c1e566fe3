"""PyTorch's CUDA weight-only kernels for quantized layers (rdlm.model.cuda_quant), tested as far as a CPU can:
the nibble order tinygemm's packing reads, reading a packed layout back, and the check that decides whether a
layer takes a kernel. The kernels themselves run only on a GPU (benchmarks/gpu_suite.py)."""

import pytest
import torch

from rdlm.model.cuda_quant import agrees, int4_matmul, pack_int4, tinygemm_fits, tinygemm_nibbles, unpack_int4
from rdlm.model.int4 import _pack_nibbles, _to_cpu_int4_layout, _unpack_nibbles, dequantize_int4
from rdlm.model.quantize import QuantizedLinear


def test_tinygemm_reads_column_2j_from_the_high_nibble():
    q = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0))
    expected = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # the order gpt-fast hands _convert_weight_to_int4pack
    assert torch.equal(tinygemm_nibbles(_pack_nibbles(q)), expected)


@pytest.mark.parametrize("shape", [(64, 128), (2048, 64)])  # one block of rows, and two
def test_a_packed_layout_is_read_back_from_its_own_packing(shape):
    """unpack_int4 reads any layout that permutes nibbles, by packing indices through the same function: here
    the CPU kernel's packing (a real PyTorch layout, with its own row blocks) stands in for tinygemm's."""
    q = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(1)).to(torch.uint8)

    def pack(nibbles):
        return _to_cpu_int4_layout(_unpack_nibbles(nibbles))

    assert torch.equal(unpack_int4(pack(_pack_nibbles(q)), *shape, pack=pack), q)


def test_a_kernel_is_taken_only_where_it_computes_the_dequantized_weight():
    torch.manual_seed(2)
    layer = QuantizedLinear.from_weight(torch.randn(64, 128), None, "int4", 32)
    parts = layer.canonical()
    weight = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], 32)
    assert agrees(lambda x: (x.to(torch.bfloat16) @ weight.to(torch.bfloat16).T).float(), weight)  # bf16 round-off
    swapped = dequantize_int4(tinygemm_nibbles(parts["qweight"]), parts["scales"], parts["zeros"], 32)
    assert not agrees(lambda x: x @ swapped.T, weight)  # the nibbles in the other order
    assert not agrees(lambda x: x @ weight[:32].T, weight)  # too few outputs
    assert not agrees(lambda x: int4_matmul(x, parts["qweight"], 32, parts["scales"]), weight)  # raises on the CPU


def test_on_the_cpu_no_cuda_kernel_is_taken():
    with pytest.raises((RuntimeError, NotImplementedError)):
        pack_int4(torch.zeros(8, 64, dtype=torch.uint8))
    assert tinygemm_fits(4096, 5120, 128) and not tinygemm_fits(4096, 5120 + 64, 64) and not tinygemm_fits(12, 128, 32)
    for scheme in ("int8", "int4"):
        assert QuantizedLinear.from_weight(torch.randn(64, 128), None, scheme, 32).cuda_kernel is None
