"""Rotary position embeddings (RoPE) for every model family rdlm runs (docs/model-families.md).

A table holds cos/sin of angle(position, j) = position * inv_freq_j for the head's d/2 frequencies,
inv_freq_j = base^(-2j/d). Families differ in two ways, both config fields:
- which dimensions form a rotated pair: Huginn rotates adjacent pairs (2j, 2j+1), Llama-style models
  (the retrofitted models, Ouro) rotate dimension j with j + d/2 ("halves");
- `rope_scaling`, transformers' dict: "llama3" (Llama-3.1/3.2's long-context frequency scaling) and
  "linear" (positions divided by `factor`) change inv_freq; plain RoPE otherwise.
The arithmetic is the same as transformers' (`ROPE_INIT_FUNCTIONS`, `apply_rotary_pos_emb`), written
here so that rdlm needs no transformers to run these models; tests compare the two where it is installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

SCALING_TYPES = ("default", "llama3", "linear")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_scaling(scaling: Mapping[str, Any] | None) -> None:
    """Raise ValueError naming what is wrong with a `rope_scaling` dict rdlm cannot compute."""
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling_type(scaling)
    if kind not in SCALING_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SCALING_TYPES)})")
    needed = {"llama3": _LLAMA3_KEYS, "linear": ("factor",), "default": ()}[kind]
    for key in needed:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling.{key} must be a number > 0 for rope_type {kind!r}, got {value!r}")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_scaling.partial_rotary_factor other than 1 is not supported")


def scaling_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inverse_frequencies(head_dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """inv_freq [head_dim/2] in float32, after `scaling` (see the module doc)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = scaling_type(scaling)
    if scaling is None:  # (kind "default")
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    # Llama 3: wavelengths longer than the original context / low_freq_factor are stretched by `factor`,
    # shorter than original / high_freq_factor are kept, and the band between is interpolated.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int, length: int, base: float, scaling: Mapping[str, Any] | None = None
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [length, head_dim/2] in float32."""
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inverse_frequencies(head_dim, base, scaling))
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, pairs: str = "adjacent") -> Tensor:
    """Rotate each head's pairs of dimensions by the position's angles, computed in float32.

    x: [B, S, ..., d], with cos/sin broadcastable to [B, S, ..., d/2]. `pairs` "adjacent": (2j, 2j+1)
    rotate together (complex-number style); "halves": (j, j + d/2) (Llama's rotate-half)."""
    if pairs == "halves":
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)
    split = x.float().unflatten(-1, (-1, 2))
    real, imag = split[..., 0], split[..., 1]
    rotated = torch.stack((real * cos - imag * sin, imag * cos + real * sin), dim=-1)
    return rotated.flatten(-2).type_as(x)
