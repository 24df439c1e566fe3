"""Several LoRA adapters in one model, for serving (rdlm.model.lora builds, reads and checks each one).

Adapters loaded under different names (`load_adapters`) sit side by side in the same PEFT layers. The
model's own forward applies the active one (`set_adapter`); a batch whose rows ask for different adapters
runs under `routed` instead, where every adapted layer gives each token the base's output plus its own
adapter's update:

    y = W x + sum_i mask_i * (alpha_i / rank_i) B_i A_i x        mask_i: 1 for the tokens of adapter i

the same arithmetic as that adapter alone (its update computed as PEFT computes it, then added; the other
adapters add exact zeros). The routing index is a tensor shaped as the call's leading dimensions ([rows, 1]
for one token or adapter per row, [1, T] for a packed call), so the engine's calls route without a host
sync, and a CUDA graph captured under `routed` reads it in place. Each loaded adapter's update runs for every
token (masked), so k adapters cost k low-rank products per adapted layer whatever the batch asks for.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rdlm.model.lora import loaded_adapters, lora_layers, set_adapter
from rdlm.model.lora_files import AdapterFiles, load_adapter, read_adapter, recorded_base

if TYPE_CHECKING:
    import os

    from rdlm.model.lm import RecurrentDepthLM


def active_adapter(model: nn.Module) -> str | None:
    """The adapter `set_adapter` (or the latest `load_adapter`) made active: what the model's own forward
    applies. None: the base alone."""
    if not loaded_adapters(model):
        return None
    for _, layer in lora_layers(model):
        if not layer.disable_adapters:
            return layer.active_adapters[0]
    return None


# ------------------------------------------------------------------------------------------------
# Each token through its own adapter


class Routing:
    """Which adapter each token of a call applies: `index` shaped as the call's leading dimensions ([batch,
    seq], or [rows, 1] for one per row), 0 for none and i for `names[i - 1]`. Each adapter's mask of its
    tokens is computed once per call, not once per layer."""

    def __init__(self, names: Sequence[str], index: Tensor) -> None:
        self.names, self.index = list(names), index
        self._masks: dict[tuple[int, torch.dtype], Tensor] = {}

    def mask(self, number: int, dtype: torch.dtype) -> Tensor:
        """1 for the tokens of adapter `number`, 0 for the others, shaped to broadcast over the features."""
        key = (number, dtype)
        if key not in self._masks:
            self._masks[key] = (self.index == number).unsqueeze(-1).to(dtype)
        return self._masks[key]


def _routed_forward(layer: Any, routing: Routing, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """The layer's output with each token's own adapter: the base for every token, plus each adapter's update
    times the mask of its tokens (the same arithmetic as the adapter alone: B(A(x)) * scaling, then +; a
    token's other adapters add exact zeros)."""
    result = layer.base_layer(x)
    dtype = result.dtype
    for number, name in enumerate(routing.names, start=1):
        if name not in layer.lora_A:
            continue
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        update = lora_b(lora_a(x.to(lora_a.weight.dtype))) * layer.scaling[name]
        result = result + update * routing.mask(number, update.dtype)
    return result.to(dtype)


@contextmanager
def routed(model: nn.Module, names: Sequence[str], index: Tensor) -> Iterator[None]:
    """Within the block, every adapted layer of `model` applies to each token the adapter `index` names
    (see Routing; `index` shaped as the calls' leading dimensions, e.g. [batch, seq]). The layers' own
    forward returns when the block ends."""
    routing = Routing(names, index)
    layers = [layer for _, layer in lora_layers(model)]
    saved = [layer.__dict__.get("forward") for layer in layers]  # an outer block's routing, or none
    try:
        for layer in layers:
            layer.forward = functools.partial(_routed_forward, layer, routing)
        yield
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward


# ------------------------------------------------------------------------------------------------
# A model with adapters by name


def read_adapters(directories: dict[str, str | os.PathLike]) -> dict[str, AdapterFiles]:
    """Each named adapter read (`read_adapter`: an adapter directory, or a LoRA run or checkpoint's adapter/),
    in the order given."""
    return {name: read_adapter(path) for name, path in directories.items()}


def adapters_base(adapters: dict[str, AdapterFiles]) -> str:
    """The model the adapters were trained on, as the first one records it (`recorded_base`): what a command
    given adapters and no model runs (the others are checked against it when they load)."""
    return recorded_base(next(iter(adapters.values())))


def load_adapters(model: RecurrentDepthLM, adapters: dict[str, AdapterFiles], *, any_base: bool = False) -> list[str]:
    """Load each adapter into `model` under its name (`load_adapter`, which checks its base; `any_base` skips
    the fingerprint). One adapter becomes the active one; with several, none is (the base alone, until a
    request or `set_adapter` names one). Returns their names."""
    for name, files in adapters.items():
        load_adapter(model, files, name, any_base=any_base)
    if len(adapters) > 1:
        set_adapter(model, None)
    return list(adapters)
