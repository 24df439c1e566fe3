"""Weight-only quantization of the linear layers, chosen per part of the loop (docs/quantization.md).

A recurrent-depth model applies its core block r times per token, so error in the core's weights is fed
back into the recurrence r times, while the prelude's and coda's is applied once; each part therefore gets
its own precision:

    prelude   the prelude blocks
    core      the core blocks and the adapter (everything applied once per iteration)
    coda      the coda blocks
    head      the un-embedding (a tied head gets a quantized copy; the embedding lookup stays exact)

Schemes: "none" (the model dtype), "int8" (symmetric, one scale per output channel), "int4"
(asymmetric, one scale and zero point per group of `group_size` input columns, as gpt-fast and torchao's
int4 weight-only) and "w8a8" (int8 weights as "int8", and on the CPU the activations quantized to int8 per
call as well: FBGEMM's dynamic linear). On the CPU the weight-only matmuls are PyTorch's own kernels
(`torch._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`, with bfloat16 activations: see
QuantizedLinear); elsewhere the weights are dequantized inside the matmul (under torch.compile that fuses
into one kernel, as gpt-fast's int8 does). The norms, the exit gate and the embedding table stay in the
model dtype. The spec itself is rdlm.model.quant_spec's; under torch.compile (the CPU's compiled decode step) a
w8a8 layer computes FBGEMM's product in tensor ops instead (rdlm.model.w8a8, `traceable`).

On disk (safetensors, `save_pretrained`) a quantized linear layer `X.weight` is stored as `X.qweight`
(int8 and w8a8: int8 [out, in]; int4: uint8 [out, in/2], column 2j in the low nibble and 2j+1 in the
high one), `X.scales` (float32: int8 [out], int4 [out, in/group]) and, for int4, `X.zeros` (float32, like the
scales); config.json says which parts are quantized under "rdlm_quantization".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rdlm.model.cuda_quant import agrees, int4_matmul, int8_matmul, pack_int4, tinygemm_fits, unpack_int4
from rdlm.model.int4 import (
    _from_cpu_int4_layout,
    _nibbles_to_cpu_int4_layout,
    _pack_nibbles,
    dequantize_int4,
    int4_fits,
)
from rdlm.model.quant_spec import (
    CONFIG_KEY,
    DEFAULT_GROUP_SIZE,
    PARTS,
    SCHEMES,
    SUFFIXES,
    QuantizationError,
    QuantSpec,
    as_spec,
)
from rdlm.model.quantize_grad import matmul_with_input_grad
from rdlm.model.w8a8 import fbgemm_pack, fbgemm_unpack, w8a8_matmul

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM

# ------------------------------------------------------------------------------------------------
# The quantized linear layer


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W held in int8 or int4. Inference only: nothing here has a gradient; the buffers
    are not in the state dict (`quantized_tensors` saves them).

    On the CPU, PyTorch's weight-only kernels run with bfloat16 activations whatever the model's dtype (their
    float32 variants are 5-25x slower than the bfloat16 ones and than a float32 matmul on x86), so the
    scales (and int4 zero points) are kept in bfloat16 and the integer weights are chosen for the rounded
    scales; the output comes back in the input's dtype. The int4 weights are held packed for
    `aten._weight_int4pack_mm_for_cpu` (in its layout, which depends on the CPU's kernels). "w8a8" holds
    int8 weights like "int8" but on the CPU also quantizes the activations per call (FBGEMM's dynamic int8
    linear, 7-bit activations): several times faster there, at the cost of activation rounding.
    On CUDA a layer reads its integer weights inside PyTorch's kernels (tinygemm for int4, `_weight_int8pack_mm`
    for int8: rdlm.model.cuda_quant, `cuda_kernel`) where they reproduce its dequantized weight on the device,
    and dequantizes in the matmul otherwise. `canonical()` gives the portable form that is saved, and
    `from_canonical` reads it back."""

    # The buffers __init__ registers, declared for the type checker. Each is read only by the scheme and device
    # that hold it: qweight is None under w8a8 on the CPU (`packed` holds the weight), zeros is int4's off the
    # CPU, scales_and_zeros int4's on it and under tinygemm (whose layers hold neither scales nor zeros).
    qweight: Tensor
    scales: Tensor
    zeros: Tensor
    scales_and_zeros: Tensor
    bias: Tensor | None

    def __init__(
        self,
        scheme: str,
        in_features: int,
        out_features: int,
        group_size: int,
        qweight: Tensor,
        scales: Tensor,
        zeros: Tensor | None,
        bias: Tensor | None,
    ) -> None:
        super().__init__()
        self.scheme, self.in_features, self.out_features, self.group_size = (
            scheme,
            in_features,
            out_features,
            group_size,
        )
        self.on_cpu = qweight.device.type == "cpu"
        kernel_dtype = torch.bfloat16 if self.on_cpu else torch.float32
        self.packed = None
        self.cuda_kernel: str | None = None  # "tinygemm" or "int8pack": PyTorch's CUDA kernel this layer runs
        if scheme == "w8a8" and self.on_cpu:
            # FBGEMM's prepacked weight (it keeps its own copy; qweight is held only for compiled code, `traceable`)
            try:
                self.packed = fbgemm_pack(qweight, scales)
            except (AttributeError, RuntimeError) as err:
                raise QuantizationError(
                    f"w8a8 needs PyTorch's FBGEMM quantized linear, which this PyTorch lacks ({err}); use int8"
                ) from None
            self.register_buffer("qweight", None, persistent=False)
            self.register_buffer("scales", scales.float(), persistent=False)
        elif scheme == "int4" and self.on_cpu:
            assert zeros is not None  # an int4 weight has its zero points (from_weight, from_canonical)
            self.register_buffer("qweight", _nibbles_to_cpu_int4_layout(qweight), persistent=False)
            # [in/group, out, 2]: scale and zero point, as the kernel reads them
            self.register_buffer(
                "scales_and_zeros",
                torch.stack((scales, zeros), -1).transpose(0, 1).contiguous().to(kernel_dtype),
                persistent=False,
            )
        else:
            self.register_buffer("qweight", _aligned(qweight), persistent=False)
            self.register_buffer("scales", _aligned(scales.to(kernel_dtype)), persistent=False)
            self.register_buffer("zeros", None if zeros is None else zeros.to(kernel_dtype), persistent=False)
            if qweight.is_cuda:
                self._choose_cuda_kernel()
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, group_size: int) -> QuantizedLinear:
        return cls.from_weight(linear.weight, linear.bias, scheme, group_size)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, scheme: str, group_size: int) -> QuantizedLinear:
        """Quantize `weight` [out, in] (on its device)."""
        w = weight.detach().float()
        out_features, in_features = w.shape
        # the scales as the kernel will hold them (bfloat16 on the CPU, except FBGEMM's float ones)
        held = torch.bfloat16 if weight.device.type in ("cpu", "cuda") and scheme != "w8a8" else torch.float32
        tiny = torch.finfo(torch.bfloat16).tiny
        if scheme in ("int8", "w8a8"):
            scales = (w.abs().amax(dim=1) / 127).clamp(min=tiny).to(held).float()
            q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            return cls(scheme, in_features, out_features, group_size, q, scales, None, bias)
        grouped = w.reshape(out_features, in_features // group_size, group_size)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = ((high - low) / 15).clamp(min=tiny).to(held).float()
        zeros = (low + 8 * scales).to(held).float()  # the kernels' convention: w = (q - 8) * scale + zero
        q = torch.round((grouped - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15).to(torch.uint8)
        packed = _pack_nibbles(q.reshape(out_features, in_features))
        return cls("int4", in_features, out_features, group_size, packed, scales, zeros, bias)

    @classmethod
    def from_canonical(
        cls,
        name: str,
        scheme: str,
        tensors: Mapping[str, Tensor],
        bias: Tensor | None,
        out_features: int,
        in_features: int,
        group_size: int,
        device,
    ) -> QuantizedLinear:
        """Read the stored form (see the module docstring) of a layer `scheme` quantizes, refusing tensors
        that do not fit the layer `name` [out_features, in_features] in one line."""
        q, scales, zeros = (tensors.get(s) for s in SUFFIXES)
        if q is None or scales is None:
            raise QuantizationError(f"{name}: needs {name}.qweight and {name}.scales")
        if q.dtype == torch.int8:
            stored, expected = "int8", {"qweight": (out_features, in_features), "scales": (out_features,)}
        elif q.dtype == torch.uint8:
            stored = "int4"
            expected = {
                "qweight": (out_features, in_features // 2),
                "scales": (out_features, in_features // group_size),
                "zeros": (out_features, in_features // group_size),
            }
            if zeros is None:
                raise QuantizationError(f"{name}: an int4 weight needs {name}.zeros")
        else:
            raise QuantizationError(f"{name}.qweight has dtype {q.dtype}; expected int8 (int8) or uint8 (int4)")
        if stored == "int8" and zeros is not None:
            raise QuantizationError(f"{name}.zeros is not part of an int8 weight")
        if scheme == "w8a8" and stored == "int8":
            stored = "w8a8"
        given = {"qweight": q, "scales": scales} | ({} if zeros is None else {"zeros": zeros})
        for key, shape in expected.items():
            if tuple(given[key].shape) != shape:
                raise QuantizationError(
                    f"{name}.{key} has shape {list(given[key].shape)}, expected {list(shape)}"
                    + (f" (group size {group_size})" if stored == "int4" and key != "qweight" else "")
                )
            if key != "qweight" and not given[key].is_floating_point():
                raise QuantizationError(f"{name}.{key} has dtype {given[key].dtype}; expected a float tensor")
            if key != "qweight" and not torch.isfinite(given[key]).all():
                raise QuantizationError(f"{name}.{key} holds non-finite values")
        if not (scales > 0).all():
            raise QuantizationError(f"{name}.scales holds values <= 0")
        return cls(
            stored,
            in_features,
            out_features,
            group_size,
            q.to(device),
            scales.float().to(device),
            None if zeros is None else zeros.float().to(device),
            None if bias is None else bias.to(device),
        )

    def canonical(self) -> dict[str, Tensor]:
        """The stored form: qweight, scales (and zeros for int4) on the CPU, scales in float32."""
        if self.packed is not None:
            return {"qweight": fbgemm_unpack(self.packed), "scales": self.scales.float().cpu()}
        if self.scheme in ("int8", "w8a8"):
            return {"qweight": self.qweight.cpu(), "scales": self.scales.float().cpu()}
        if self.on_cpu or self.cuda_kernel == "tinygemm":
            shape = (self.out_features, self.in_features)
            q = _from_cpu_int4_layout(self.qweight, *shape) if self.on_cpu else unpack_int4(self.qweight, *shape).cpu()
            scales, zeros = self.scales_and_zeros.float().cpu().transpose(0, 1).unbind(-1)
            return {"qweight": _pack_nibbles(q), "scales": scales.contiguous(), "zeros": zeros.contiguous()}
        return {"qweight": self.qweight.cpu(), "scales": self.scales.float().cpu(), "zeros": self.zeros.float().cpu()}

    # -- compute -----------------------------------------------------------------------------

    @property
    def weight(self) -> Tensor:
        """The dequantized weight [out, in] in float32 (for code that needs the matrix itself: the chunked
        loss, analysis)."""
        parts = self.canonical()
        if self.scheme in ("int8", "w8a8"):
            w = parts["qweight"].float() * parts["scales"][:, None]
        else:
            w = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], self.group_size)
        return w.to(self.bias.device if self.bias is not None else self._device())

    def _device(self) -> torch.device:
        return next((b.device for b in self.buffers()), torch.device("cpu"))

    def forward(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        if self.on_cpu != (x.device.type == "cpu"):
            raise RuntimeError(
                f"a layer quantized {'on' if self.on_cpu else 'off'} the CPU got input on {x.device}: "
                "quantize the model on the device it runs on (load_model(..., device=..., "
                "quantize=...))"
            )
        # With a gradient wanted for the input, a LoRA adapter above trains (QLoRA, rdlm.model.lora).
        y = matmul_with_input_grad(x2, self) if torch.is_grad_enabled() and x2.requires_grad else self.matmul(x2)
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [N, in] times the weight, on this device's kernel for the scheme (the output in the kernel's
        dtype)."""
        if self.packed is not None and not torch.compiler.is_compiling():
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, True)
        elif self.packed is not None:  # compiled code cannot trace FBGEMM's packed weight: the same in tensor ops
            if self.qweight is None:
                raise QuantizationError("a w8a8 layer is compiled without its int8 weight: call traceable() first")
            y = w8a8_matmul(x2, self.qweight, self.scales)
        elif self.scheme in ("int8", "w8a8") and self.on_cpu:
            y = torch._weight_int8pack_mm(x2.to(self.scales.dtype).contiguous(), self.qweight, self.scales)
        elif self.on_cpu and self.scheme == "int4":
            kernel = self.scales_and_zeros.dtype
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(kernel).contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        elif self.cuda_kernel == "tinygemm":
            y = int4_matmul(x2, self.qweight, self.group_size, self.scales_and_zeros)
        elif self.cuda_kernel == "int8pack":
            y = int8_matmul(x2, self.qweight, self.scales)
        else:
            y = self.dequantized_matmul(x2)
        return y

    def dequantized_matmul(self, x2: Tensor) -> Tensor:
        """x2 W^T off the CPU (the portable layout): the weight dequantized inside the matmul, in x2's dtype."""
        if self.scheme in ("int8", "w8a8"):
            return F.linear(x2, self.qweight.to(x2.dtype)) * self.scales.to(x2.dtype)
        return F.linear(x2, dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size).to(x2.dtype))

    def _choose_cuda_kernel(self, rows: int = 256) -> None:
        """Take PyTorch's CUDA kernel for the scheme where it computes this layer's dequantized weight (its first
        `rows` output rows, rdlm.model.cuda_quant.agrees); else keep the dequantizing matmul."""
        n, bf16 = min(rows, self.out_features), torch.bfloat16
        if self.scheme == "int4" and tinygemm_fits(self.out_features, self.in_features, self.group_size):
            reference = dequantize_int4(self.qweight[:n], self.scales[:n], self.zeros[:n], self.group_size)
            try:
                packed = pack_int4(self.qweight)
            except (RuntimeError, NotImplementedError):  # no tinygemm in this build or on this device
                return
            both = torch.stack((self.scales, self.zeros), -1).transpose(0, 1).contiguous().to(bf16)
            if agrees(lambda x: int4_matmul(x, packed, self.group_size, both), reference):
                self.register_buffer("qweight", packed, persistent=False)
                self.register_buffer("scales_and_zeros", both, persistent=False)
                self.register_buffer("scales", None, persistent=False)
                self.register_buffer("zeros", None, persistent=False)
                self.cuda_kernel = "tinygemm"
        elif self.scheme in ("int8", "w8a8"):
            reference, scales = self.qweight[:n].float() * self.scales[:n, None].float(), self.scales.to(bf16)
            if agrees(lambda x: int8_matmul(x, self.qweight, scales), reference):
                self.register_buffer("scales", scales, persistent=False)
                self.cuda_kernel = "int8pack"

    def traceable(self) -> None:
        """Hold what torch.compile can trace: a w8a8 layer on the CPU keeps its int8 weight as a tensor beside
        FBGEMM's opaque packed copy (a byte per weight more), for `w8a8_matmul`; other layers hold it already."""
        if self.packed is not None and self.qweight is None:
            with torch.inference_mode(False):  # a buffer, not an inference tensor (it has a version counter)
                self.register_buffer("qweight", fbgemm_unpack(self.packed), persistent=False)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}{group}"

    def nbytes(self) -> int:
        held = sum(b.numel() * b.element_size() for b in self.buffers())
        return held + (self.out_features * self.in_features if self.packed is not None else 0)


def _aligned(tensor: Tensor) -> Tensor:
    """`tensor`, copied where its data does not start on a 64-byte boundary. A tensor read from a
    safetensors file can start anywhere in the file's buffer, and PyTorch's AVX-512 int8 kernel
    (`_weight_int8pack_mm`) crashes on such a weight; its own allocations are 64-byte aligned."""
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


# ------------------------------------------------------------------------------------------------
# Quantizing a model


def layers(model: RecurrentDepthLM) -> Iterator[tuple[str, str, nn.Linear | QuantizedLinear | nn.Embedding]]:
    """(part, module name, module) of every linear layer a spec can quantize."""
    for part, prefix in (("prelude", "prelude."), ("core", "core."), ("coda", "coda.")):
        for name, module in model.named_modules():
            if name.startswith(prefix) and isinstance(module, (nn.Linear, QuantizedLinear)):
                yield part, name, module
    if isinstance(model.adapter, (nn.Linear, QuantizedLinear)):
        yield "core", "adapter", model.adapter
    yield "head", "lm_head", model.lm_head if model.lm_head is not None else model.embedding


def quantize(
    model: RecurrentDepthLM, spec: QuantSpec | str | None, group_size: int = DEFAULT_GROUP_SIZE
) -> RecurrentDepthLM:
    """Quantize `model` (a RecurrentDepthLM) in place by `spec` and return it; `model.quantization` records
    the spec. A layer int4 cannot hold (in_features not a multiple of the group size, out_features not of
    32) is quantized to int8 instead; `model.quantized_layers` says what each layer got."""
    spec = as_spec(spec, group_size)
    if spec is None:
        return model
    if getattr(model, "quantization", None) is not None:
        raise QuantizationError(
            f"the model is quantized already ({model.quantization}); load the unquantized "
            "model to quantize it differently"
        )
    chosen: dict[str, str] = {}
    with torch.no_grad():
        for part, name, module in list(layers(model)):
            scheme = getattr(spec, part)
            if scheme == "none":
                continue
            weight = module.weight
            out_features, in_features = weight.shape
            if scheme == "int4" and not int4_fits(out_features, in_features, spec.group_size):
                scheme = "int8"
            bias = module.bias if isinstance(module, nn.Linear) else None
            quantized = QuantizedLinear.from_weight(weight, bias, scheme, spec.group_size)
            _set_module(model, name, quantized)
            chosen[name] = scheme
    model.quantization = spec
    model.quantized_layers = chosen
    return model


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply(
    model: RecurrentDepthLM, spec: QuantSpec | str | None, group_size: int = DEFAULT_GROUP_SIZE
) -> RecurrentDepthLM:
    """`quantize` for a model just loaded: a model saved quantized keeps its quantization when `spec` asks for
    nothing or for the same; asking a different one is refused (quantizing twice compounds the error)."""
    spec = as_spec(spec, group_size)
    stored = getattr(model, "quantization", None)
    if spec is None or spec == stored:
        return model
    if stored is not None:
        raise QuantizationError(
            f"the model is saved quantized ({stored}); --quantize {spec} would quantize it "
            "twice: drop --quantize, or quantize the unquantized model"
        )
    return quantize(model, spec)


def traceable(model: nn.Module) -> None:
    """Make every quantized layer of `model` traceable by torch.compile (QuantizedLinear.traceable)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.traceable()


def is_quantized(model: nn.Module) -> bool:
    return getattr(model, "quantization", None) is not None


def quantized_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The stored tensors of every quantized layer, keyed `<module>.<qweight|scales|zeros>` (and
    `<module>.bias` for a quantized layer with a bias)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            for key, tensor in module.canonical().items():
                out[f"{name}.{key}"] = tensor.contiguous()
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias.detach().cpu()
    return out


def attach_quantized(model: RecurrentDepthLM, spec: QuantSpec, tensors: dict[str, Tensor], device, source: str) -> None:
    """Replace the layers `spec` quantizes by QuantizedLinear layers read from `tensors` (keys as
    `quantized_tensors` writes them; used entries are removed). A missing, extra or ill-fitting tensor is
    refused in one line naming it."""
    chosen: dict[str, str] = {}
    for part, name, module in list(layers(model)):
        if getattr(spec, part) == "none":
            continue
        if isinstance(module, nn.Embedding):  # a tied head: its quantized copy
            out_features, in_features = module.weight.shape
            has_bias = False
        else:
            out_features, in_features = module.out_features, module.in_features
            has_bias = module.bias is not None
        parts = {s: tensors.pop(f"{name}.{s}") for s in SUFFIXES if f"{name}.{s}" in tensors}
        bias = tensors.pop(f"{name}.bias", None) if has_bias else None
        if has_bias and bias is None:
            raise QuantizationError(f"{source}: missing {name}.bias")
        try:
            layer = QuantizedLinear.from_canonical(
                name, getattr(spec, part), parts, bias, out_features, in_features, spec.group_size, device
            )
        except QuantizationError as err:
            raise QuantizationError(f"{source}: {err}") from None
        _set_module(model, name, layer)
        chosen[name] = layer.scheme
    model.quantization = spec
    model.quantized_layers = chosen


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a forward pass reads (parameters and quantized buffers; RoPE tables excluded)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedLinear))


def describe(model: RecurrentDepthLM) -> str:
    spec = getattr(model, "quantization", None)
    if spec is None:
        return "not quantized"
    counts: dict[str, int] = {}
    for scheme in model.quantized_layers.values():
        counts[scheme] = counts.get(scheme, 0) + 1
    layers_text = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return f"{spec} ({layers_text} layers; weights {weight_bytes(model) / 2**20:.1f} MiB)"


__all__ = [
    "CONFIG_KEY",
    "DEFAULT_GROUP_SIZE",
    "PARTS",
    "SCHEMES",
    "SUFFIXES",
    "QuantSpec",
    "QuantizationError",
    "QuantizedLinear",
    "as_spec",
    "attach_quantized",
    "describe",
    "is_quantized",
    "quantize",
    "quantized_tensors",
    "traceable",
    "weight_bytes",
]
