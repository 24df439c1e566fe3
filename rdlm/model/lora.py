"""LoRA adapters on a recurrent-depth model, built by the `peft` library (docs/fine-tuning.md).

A LoRA adapter adds a trainable low-rank update to a frozen linear layer, `y = W x + (alpha / rank) B A x`
(Hu et al. 2021). Which layers get one is chosen per part of the loop, as quantization is:

    prelude   the prelude blocks' projections (attention q/k/v and output, the MLP's two)
    core      the core blocks' projections: one adapter, applied at every iteration
    adapter   the core's input map A(concat[s, e]) (Huginn's concatenating injection)
    coda      the coda blocks' projections
    head      the un-embedding, where it is a layer of its own (an untied head)

The layers are PEFT's own (`inject_adapter_in_model`): a model here is the plain `RecurrentDepthLM`. An
adapter's files are PEFT's format with what rdlm records beside it (the base's shapes and fingerprint), read,
checked and loaded by rdlm.model.lora_files.

A quantized base (rdlm.model.quantize, QLoRA) takes adapters too: `quantized_lora_class()` is PEFT's LoRA
layer over a `QuantizedLinear`, registered with PEFT's custom-module dispatch; its adapter weights stay in
float32, and the quantized layer passes gradients to its input (rdlm.model.quantize).

Several adapters can sit in one model under different names (`lora_files.load_adapter(..., name=...)`), for
serving: a batch then routes each token to its own adapter (rdlm.model.lora_serving).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rdlm.checks import check_int
from rdlm.model.quantize import QuantizedLinear

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM

PARTS = ("prelude", "core", "adapter", "coda", "head")
# Every block projection of the loop, head excluded: adapters on all linear layers is what matched a full
# fine-tune in the QLoRA study (Dettmers et al. 2023), and the head is vocabulary-wide (tied in Huginn).
DEFAULT_PARTS = ("prelude", "core", "adapter", "coda")
DEFAULT_RANK, DEFAULT_ALPHA = 16, 32.0
DEFAULT_NAME = "default"


class LoraError(ValueError):
    """An adapter spec, file or base that cannot be used (one line naming it)."""


def peft_module():
    try:
        import peft
    except ImportError:
        raise LoraError("LoRA adapters need the peft library: pip install 'rdlm[lora]' (or pip install peft)") from None
    return peft


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: rank, alpha (the update is scaled by alpha / rank), dropout on its input during
    training, and the parts of the loop whose layers get one (PARTS)."""

    rank: int = DEFAULT_RANK
    alpha: float = DEFAULT_ALPHA
    dropout: float = 0.0
    parts: tuple[str, ...] | None = None  # None: the DEFAULT_PARTS the model has (`default_parts`)

    def __post_init__(self) -> None:
        check_int("lora rank", self.rank, error=LoraError)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise LoraError(f"lora alpha must be a finite number, got {self.alpha!r}")
        if self.alpha <= 0:
            raise LoraError(f"lora alpha must be > 0, got {self.alpha}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise LoraError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if self.parts is None:
            return
        if not self.parts:
            raise LoraError(f"lora parts: give at least one of {', '.join(PARTS)}")
        for part in self.parts:
            if part not in PARTS:
                raise LoraError(f"lora parts: unknown part {part!r} (expected some of {', '.join(PARTS)})")
        if len(set(self.parts)) != len(self.parts):
            raise LoraError(f"lora parts: a part is named twice in {','.join(self.parts)}")

    @staticmethod
    def parse_parts(text: str) -> tuple[str, ...] | None:
        """ "core,coda" -> ("core", "coda"); "all" -> every part; "default" -> None (`default_parts`: those of
        DEFAULT_PARTS the model has)."""
        if text.strip() == "all":
            return PARTS
        if text.strip() == "default":
            return None
        return tuple(item.strip() for item in text.split(","))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict[str, Any]:
        parts = None if self.parts is None else list(self.parts)
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "parts": parts}


# ------------------------------------------------------------------------------------------------
# Which layers


def _part_prefixes(part: str) -> tuple[str, ...]:
    return {"prelude": ("prelude.",), "core": ("core.",), "coda": ("coda.",)}.get(part, ())


def default_parts(model: RecurrentDepthLM) -> tuple[str, ...]:
    """The DEFAULT_PARTS `model` has (Ouro has neither prelude, coda nor adapter layer: its core alone)."""
    has = {
        "prelude": len(model.prelude) > 0,
        "core": len(model.core) > 0,
        "adapter": model.adapter is not None,
        "coda": len(model.coda) > 0,
    }
    return tuple(part for part in DEFAULT_PARTS if has[part])


def target_modules(model: RecurrentDepthLM, parts: Sequence[str]) -> list[str]:
    """The rdlm names of the linear layers `parts` adapt, in model order. A part this model does not have (a
    tied head, no adapter layer, no coda layers) is refused by name."""
    names: list[str] = []
    for part in parts:
        if part == "head":
            if model.lm_head is None:
                raise LoraError(
                    "lora part 'head': this model ties its head to the embedding (no head layer of its "
                    "own to adapt); leave 'head' out"
                )
            found = ["lm_head"]
        elif part == "adapter":
            if model.adapter is None:
                raise LoraError(
                    f"lora part 'adapter': this model injects the embedding by {model.config.injection!r}, "
                    "with no adapter layer; leave 'adapter' out"
                )
            found = ["adapter"]
        else:
            found = [
                name
                for name, module in model.named_modules()
                if name.startswith(_part_prefixes(part)) and is_linear(module) and ".lora_" not in name
            ]
            if not found:
                raise LoraError(f"lora part {part!r}: this model has no {part} layers")
        names += found
    return names


def is_linear(module: nn.Module) -> bool:
    peft = peft_module()
    base = module.get_base_layer() if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer) else module
    return isinstance(base, (nn.Linear, QuantizedLinear)) and not isinstance(module, (nn.ModuleDict, nn.ParameterDict))


def _pattern(names: Sequence[str]) -> str:
    """A regular expression PEFT matches (re.fullmatch) against module names: exactly `names`, on the bare
    RecurrentDepthLM and under RavenForCausalLM's `model.` (and PeftModel's wrappers)."""
    return r"(?:.*\.)?(?:" + "|".join(re.escape(n) for n in names) + ")"


def lora_config(spec: LoraSpec, names: Sequence[str], base_source: str | None = None):
    peft = peft_module()
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=_pattern(names),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_source,
    )
    config._register_custom_module({QuantizedLinear: quantized_lora_class()})
    return config


def lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(rdlm module name, PEFT LoRA layer) of every adapted layer."""
    peft = peft_module()
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            yield name, module


def loaded_adapters(model: nn.Module) -> list[str]:
    """The adapters `add_lora` and `load_adapter` gave `model`, in the order they came (none: []). Reads the
    model's own record (`lora_specs`), so a model without adapters never needs peft."""
    return list(getattr(model, "lora_specs", {}))


# ------------------------------------------------------------------------------------------------
# The LoRA layer over a quantized base (QLoRA)


@functools.cache
def quantized_lora_class() -> type:
    peft = peft_module()
    base_class = peft.tuners.lora.layer.Linear

    class QuantizedLoraLinear(base_class):  # type: ignore[valid-type,misc]  # PEFT's class, imported lazily
        """PEFT's LoRA linear layer over rdlm's QuantizedLinear (int8/int4/w8a8 weights): the frozen base
        computes with its integer kernels, the adapter in float32. Merging is refused: rounding the update
        into the integer weights would lose it silently (merge into the unquantized base instead)."""

        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            assert isinstance(module, QuantizedLinear)  # what this class is dispatched for
            return module.in_features, module.out_features

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise LoraError(
                f"cannot merge a LoRA adapter into a {self.base_layer.scheme}-quantized layer: the update would be "
                "rounded into the integer weights; merge into the unquantized base (rdlm lora merge BASE ADAPTER)"
            )

    # pickled by name as `rdlm.model.lora.QuantizedLoraLinear` (the module's __getattr__ builds it on demand), so a
    # model with QLoRA adapters travels to another process (rdlm serve --engine-process)
    QuantizedLoraLinear.__qualname__ = QuantizedLoraLinear.__name__
    QuantizedLoraLinear.__module__ = __name__
    return QuantizedLoraLinear


def __getattr__(name: str) -> type:
    if name == "QuantizedLoraLinear":
        return quantized_lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------
# Adding, training and fingerprints


def add_lora(model: RecurrentDepthLM, spec: LoraSpec, name: str = DEFAULT_NAME) -> RecurrentDepthLM:
    """Add a fresh adapter `name` (A random, B zero: the model's outputs are unchanged until trained) to the
    layers `spec.parts` names, in float32, and freeze every other parameter. Returns the model."""
    peft = peft_module()
    if name in loaded_adapters(model):
        raise LoraError(f"the model already has an adapter named {name!r}")
    if spec.parts is None:
        spec = dataclasses.replace(spec, parts=default_parts(model))
    assert spec.parts is not None
    names = target_modules(model, spec.parts)
    with quiet_peft():
        peft.inject_adapter_in_model(lora_config(spec, names), model, adapter_name=name)
    for param_name, param in model.named_parameters():
        param.requires_grad = f".lora_A.{name}." in param_name or f".lora_B.{name}." in param_name
        if param.requires_grad:
            param.data = param.data.float()
    model.lora_specs = {**getattr(model, "lora_specs", {}), name: spec}
    return model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts (quantized weights are buffers: not counted in `all`)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def set_adapter(model: nn.Module, name: str | None) -> None:
    """Make `name` the adapter every adapted layer applies (None: none, the base alone)."""
    for _, layer in lora_layers(model):
        if name is None:
            layer.enable_adapters(False)
        elif name in layer.lora_A:
            layer.enable_adapters(True)
            layer.set_adapter(name)
        else:  # this adapter leaves the layer alone
            layer.enable_adapters(False)


@contextmanager
def quiet_peft() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        # PEFT warns that a custom module mapping is experimental, and that a model is not a transformers one.
        warnings.simplefilter("ignore", UserWarning)
        yield


# ------------------------------------------------------------------------------------------------
# Merging


def merge_adapter(model: RecurrentDepthLM, name: str = DEFAULT_NAME) -> RecurrentDepthLM:
    """Fold adapter `name` into the base weights (W += alpha/rank B A, in the weights' dtype) and remove every
    LoRA layer: the result is a plain model with the base's layout. A quantized layer is refused (the
    update would be rounded into its integer weights)."""
    layers = list(lora_layers(model))
    if not any(name in layer.lora_A for _, layer in layers):
        raise LoraError(f"the model has no adapter named {name!r}")
    for module, layer in layers:
        if name in layer.lora_A and isinstance(layer.get_base_layer(), QuantizedLinear):
            raise LoraError(
                f"cannot merge into {module}: it is quantized ({layer.get_base_layer().scheme}), and the update would "
                "be rounded into its integer weights; merge into the unquantized base"
            )
    with torch.no_grad():
        for module, layer in layers:
            base = layer.get_base_layer()
            if name in layer.lora_A:
                delta = layer.get_delta_weight(name)
                base.weight.data = (base.weight.data.float() + delta.float()).to(base.weight.dtype)
            parent_name, _, leaf = module.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, base)
    if hasattr(model, "lora_specs"):
        del model.lora_specs
    return model
