"""transformers' Llama decoder-layer tensor names, which Ouro's layout and the retrofit sources (Llama,
OLMo-2) share: rdlm's fused q/k/v and gate/up projections are split into them and joined back here."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import Tensor

from rdlm.model.config import RDLMConfig

# rdlm block parameter -> the layer's tensors it holds, in the order they are concatenated.
LAYER_PARTS = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.out.weight": ("self_attn.o_proj.weight",),
    "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.out.weight": ("mlp.down_proj.weight",),
}


def split_sizes(config: RDLMConfig) -> dict[str, tuple[int, ...]]:
    """The rows of each part of a fused parameter: q, k, v; gate, up."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
    return {"attn.qkv.weight": (q_rows, kv_rows, kv_rows), "mlp.fc.weight": (config.intermediate_size,) * 2}


def split(tensor: Tensor, theirs: tuple[str, ...], sizes: tuple[int, ...] | None) -> dict[str, Tensor]:
    """A parameter as the layer's tensors `theirs` (rows `sizes` when there are several)."""
    if len(theirs) == 1:
        return {theirs[0]: tensor}
    return dict(zip(theirs, tensor.split(sizes), strict=True))


def spelled(theirs: tuple[str, ...]) -> str:
    """The names of a fused parameter's parts in one, for messages: self_attn.{q,k,v}_proj.weight."""
    if len(theirs) == 1:
        return theirs[0]
    head = os.path.commonprefix(theirs)
    tail = os.path.commonprefix([name[::-1] for name in theirs])[::-1]
    return f"{head}{{{','.join(name[len(head) : len(name) - len(tail)] for name in theirs)}}}{tail}"


def inverse(parts: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """A layer tensor -> the rdlm parameter that holds it (alone or with others)."""
    return {name: ours for ours, theirs in parts.items() for name in theirs}
