"""Eager float32 linear layers on the CPU through oneDNN where it measures faster than ATen's default
(docs/generation.md, "Which GEMM runs the eager linear layers").

An eager `nn.Linear` on the CPU runs ATen's GEMM (MKL in PyTorch's builds). MKL picks its code path by CPU vendor:
on an AMD EPYC (Zen 5) a float32 product of 8-64 rows by one of the `small` preset's weights ran at less than half
the rate of oneDNN's on the same call (`torch.ops.mkldnn._linear_pointwise`, the kernel inductor's frozen graphs
use), while at one row MKL's matrix-vector product was the faster of the two for every shape; on a Zen 3 (AVX2) MKL
was as fast as oneDNN or faster at every layer shape. So no fixed rule fits every CPU: the first eager call of a
weight shape at a given number of rows (rounded up to a power of two, at most `MEASURED_ROWS`) and threads times
both kernels, alternated, each after an ATen product (switching kernels has a cost of its own), and oneDNN runs
such calls from then on only where its median took at most `KEEP` of MKL's. The decision is kept for the process
(`_decisions`: a cache of measurements, as inductor keeps its autotuning); `RDLM_CPU_LINEAR=aten` or `=onednn`
replaces it by a fixed choice.

The engine's model calls (rdlm.inference.execution.model_calls) run under `OneDnnLinears.over(rows)`: for the
duration of a call the model's plain float32 `nn.Linear` layers (a LoRA layer's base too) and a tied head whose
product was measured faster on oneDNN at that many rows take it through `_forward` / `_tied_head`; the others are
left as they are. Nothing is patched while inductor traces (the compiled step packs its own weights), for a call on
another device or dtype, with gradients, or below `MIN_ROWS`. No packed copy of a weight is kept: oneDNN reorders
the weight per call, which cost little beside MKL's slower path in the same measurements, and nothing can go stale
when a weight changes in place. oneDNN builds a kernel for each number of rows it meets, so a call of more than
`PAD_ROWS` rows (a prompt's, of a new length at nearly every step of a server) is padded with zero rows to a
multiple of `PAD_ROWS`.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# "auto" (the default): measured per shape; "aten": ATen's GEMM always; "onednn": oneDNN from MIN_ROWS rows on
ENV = "RDLM_CPU_LINEAR"
CHOICES = ("auto", "aten", "onednn")
MIN_ROWS = 2  # one row is a matrix-vector product, where ATen's was the faster kernel for every shape measured
KEEP = 0.9  # oneDNN is kept for a shape only if its median time is at most this fraction of ATen's
# the measurement: _REPEATS alternated rounds, each a sample of the calls of each kernel that take about SAMPLE seconds
# (at most _CALLS): short samples of short calls misjudged 10-25 % gaps on a shared Zen 3 host
_REPEATS, _CALLS, SAMPLE = 5, 16, 0.001
MEASURED_ROWS = 64  # calls of more rows take the decision measured at this many (a measurement: ~12 samples)
PAD_ROWS = 32  # above this many rows, a call's rows are padded to a multiple of it (see `_forward`)
MEASURED_OUTPUTS = 4096  # a larger weight (a 65536-token head) is measured on this many of its output rows
SLOW_CALL = 0.005  # seconds: a product slower than this is measured in one round of one call

# (in features, out features, has bias, threads, rows bucket) -> oneDNN or not: measured once per process
_decisions: dict[tuple[int, int, bool, int, int], bool] = {}


def mode() -> str:
    """The `RDLM_CPU_LINEAR` setting, checked: "auto", "aten" or "onednn"."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def available() -> bool:
    """Whether this PyTorch has oneDNN (mkldnn) for the CPU."""
    return torch.backends.mkldnn.is_available()


def onednn_product(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's product of rows x2 [m, k] by `weight` [n, k] (plain or packed by oneDNN), plus `bias`."""
    return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")


def _seconds_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(weight: Tensor, bias: Tensor | None, rows: int) -> tuple[float, float]:
    """Median seconds a call of ATen's and of oneDNN's product of `rows` rows by `weight` take where the call before
    was ATen's (as in a model whose other products stay on ATen: switching kernels cost ~20 µs a call on a Zen 3 that
    a kernel timed alone does not show), on random input: samples of ATen's product twice and of ATen's then oneDNN's,
    each about SAMPLE seconds, alternated in `_REPEATS` rounds after an untimed one. A weight of more than
    MEASURED_OUTPUTS rows is measured on its first MEASURED_OUTPUTS (the kernels' efficiency, not the full product's
    time, decides), and a product that still takes more than SLOW_CALL seconds in one round of one call: a large
    model's first calls must not spend seconds choosing."""
    weight = weight[:MEASURED_OUTPUTS]
    bias = None if bias is None else bias[:MEASURED_OUTPUTS]
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)

    def aten() -> None:
        F.linear(x, weight, bias)
        F.linear(x, weight, bias)

    def onednn() -> None:
        F.linear(x, weight, bias)
        onednn_product(x, weight, bias)

    onednn()  # (oneDNN builds its kernel for this shape)
    first = _seconds_per_call(aten, 1)
    rounds, calls = (_REPEATS, min(_CALLS, max(1, round(SAMPLE / first)))) if first < SLOW_CALL else (1, 1)
    if rounds > 1:  # one untimed round first: a process's first products ran up to ~40 % slower than later ones
        _seconds_per_call(aten, calls)
        _seconds_per_call(onednn, calls)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        times[0].append(_seconds_per_call(aten, calls))
        times[1].append(_seconds_per_call(onednn, calls))
    aten_pair, mixed_pair = statistics.median(times[0]), statistics.median(times[1])
    return aten_pair / 2, mixed_pair - aten_pair / 2


def bucket(rows: int) -> int:
    """The power of two at or above `rows`, at most MEASURED_ROWS: calls of similar sizes share one measurement."""
    return min(1 << (rows - 1).bit_length(), MEASURED_ROWS)


def use_onednn(weight: Tensor, bias: Tensor | None, rows: int, setting: str = "auto") -> bool:
    """Whether a product of `rows` rows by `weight` runs on oneDNN: below MIN_ROWS never; otherwise as `setting`
    (`mode`) fixes it, or as measured ("auto": once per shape, bias, threads and rows bucket, at the bucket's size)."""
    if rows < MIN_ROWS:
        return False
    if setting != "auto":
        return setting == "onednn"
    key = (weight.shape[1], weight.shape[0], bias is not None, torch.get_num_threads(), bucket(rows))
    decision = _decisions.get(key)
    if decision is None:
        with torch.no_grad():
            aten, onednn = measure(weight.detach(), None if bias is None else bias.detach(), key[-1])
        decision = _decisions[key] = onednn <= KEEP * aten
    return decision


def _records_grad(*tensors: Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _product(weight: Tensor, bias: Tensor | None, setting: str, x: Tensor) -> Tensor:
    """`F.linear(x, weight, bias)`, on oneDNN where `use_onednn` says so."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and _records_grad(x, weight, bias))  # (oneDNN's op has no backward here)
        and use_onednn(weight, bias, rows, setting)
    ):
        # oneDNN builds a kernel for each number of rows it meets (~0.5 ms for a 256x1408 weight on one thread): long
        # calls are padded with zero rows to one of few sizes, whose kernels are built once
        x2 = x.reshape(rows, x.shape[-1])
        padded = rows if rows <= PAD_ROWS else -(-rows // PAD_ROWS) * PAD_ROWS
        if padded != rows:
            x2 = F.pad(x2, (0, 0, 0, padded - rows))
        out = onednn_product(x2, weight, bias)[:rows]
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _forward(layer: nn.Linear, setting: str, x: Tensor) -> Tensor:
    """`layer(x)`, its product on oneDNN where `use_onednn` says so."""
    return _product(layer.weight, layer.bias, setting, x)


def _tied_head(model: nn.Module, setting: str, x: Tensor) -> Tensor:
    """A tied head's logits (`RecurrentDepthLM.head`: x times the embedding's weight, in float32), the product on
    oneDNN where `use_onednn` says so. The weight is read at each call, as the model's own head reads it."""
    return _product(model.get_parameter("embedding.weight"), None, setting, x).float()


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's float32 `nn.Linear` layers on the CPU (exactly that class: quantized layers and PEFT's wrappers are
    other classes; a wrapper's base layer is one)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    return [m for m in linears if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


def tied_head_weight(model: nn.Module) -> Tensor | None:
    """The embedding weight a model's tied head multiplies by (`lm_head` is None), where it is a float32 weight on
    the CPU of a plain `nn.Embedding` (not a PEFT wrapper's); None otherwise."""
    embedding = getattr(model, "embedding", None)
    if getattr(model, "lm_head", 0) is not None or type(embedding) is not nn.Embedding:
        return None
    weight = embedding.weight
    return weight if weight.dtype == torch.float32 and weight.device.type == "cpu" else None


class OneDnnLinears:
    """A model's eager linear layers (and a tied head's product) on oneDNN during model calls of enough rows (see the
    module doc). Built once per engine; `over(rows)` is the context of one call."""

    def __init__(self, model: nn.Module) -> None:
        self.setting = mode()  # read once per engine
        enabled = available() and self.setting != "aten"
        self.layers = plain_linears(model) if enabled else []
        self.head_model = model if enabled and tied_head_weight(model) is not None else None
        # (object, attribute, what replaces it during a call): each layer's forward, a tied head's `head`
        self.patches: list[tuple[nn.Module, str, functools.partial]] = [
            (layer, "forward", functools.partial(_forward, layer, self.setting)) for layer in self.layers
        ]
        if self.head_model is not None:
            self.patches.append((self.head_model, "head", functools.partial(_tied_head, model, self.setting)))
        # (threads, rows bucket) -> the patches whose product takes oneDNN there: a call patches only those, so where
        # ATen wins every product (a CPU whose MKL path is fast) a call costs nothing more than before
        self._chosen: dict[tuple[int, int], list[tuple[nn.Module, str, functools.partial]]] = {}

    def _products(self) -> list[tuple[Tensor, Tensor | None]]:
        """Each patch's (weight, bias), read now."""
        weights: list[tuple[Tensor, Tensor | None]] = [(layer.weight, layer.bias) for layer in self.layers]
        if self.head_model is not None:
            weights.append((self.head_model.get_parameter("embedding.weight"), None))
        return weights

    def measure_all(self) -> None:
        """Measure now what `auto` would measure at the first calls (every layer shape and a tied head's at every
        row bucket, at the current thread count), so that a server's first requests do not wait for it."""
        rows = MIN_ROWS
        while self.patches and rows <= MEASURED_ROWS:
            self.chosen(rows)
            rows *= 2

    def chosen(self, rows: int) -> list[tuple[nn.Module, str, functools.partial]]:
        """The patches whose product of `rows` rows takes oneDNN (`use_onednn`: measured at the first call of each
        bucket, for every shape at once)."""
        key = (torch.get_num_threads(), bucket(rows))
        chosen = self._chosen.get(key)
        if chosen is None:
            taken = [use_onednn(w, b, rows, self.setting) for w, b in self._products()]  # (it measures without grad)
            chosen = self._chosen[key] = [patch for patch, take in zip(self.patches, taken, strict=True) if take]
        return chosen

    def over(self, rows: int) -> AbstractContextManager:
        """The context a model call of `rows` rows (tokens) runs in: the layers whose product takes oneDNN at that
        many rows patched, or nothing to do."""
        if not self.patches or rows < MIN_ROWS or torch.compiler.is_compiling():
            return nullcontext()
        chosen = self.chosen(rows)
        return _patched(chosen) if chosen else nullcontext()


@contextmanager
def _patched(patches: list[tuple[nn.Module, str, functools.partial]]) -> Iterator[None]:
    saved = [owner.__dict__.get(name) for owner, name, _ in patches]  # an outer call's patch, or none
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)  # an instance's attribute, shadowing the class's method
        yield
    finally:
        for (owner, name, _), previous in zip(patches, saved, strict=True):
            if previous is None:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, previous)
