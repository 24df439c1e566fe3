"""Tiny random models of every family rdlm reads, with a head size vLLM's CPU attention takes (32: its
smallest), saved in each family's own layout: what the vLLM plugin's tests and benchmark serve. The
conformance fixtures (tests/fixtures) have 16-wide heads, which vLLM's CPU backend refuses."""

from __future__ import annotations

from pathlib import Path

import torch

from rdlm.model.huginn import read_config, save_pretrained
from rdlm.model.lm import RecurrentDepthLM

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# family -> (conformance fixture whose wiring the model takes, head counts that make 32-wide heads)
FAMILIES = {
    "huginn": (FIXTURES / "huginn-tiny", {"num_heads": 2, "num_kv_heads": None}),
    "retrofit-llama": (FIXTURES / "families" / "retrofit-llama-tiny", {"num_heads": 2, "num_kv_heads": 1}),
    "retrofit-olmo": (FIXTURES / "families" / "retrofit-olmo-tiny", {"num_heads": 2, "num_kv_heads": 1}),
    "ouro": (FIXTURES / "families" / "ouro-tiny", {"num_heads": 2, "num_kv_heads": 1}),
}


def make_model(family: str, path: str | Path, seed: int = 0, **changes) -> Path:
    """A random model of `family` (its fixture's wiring, 64 wide with 32-wide heads) saved at `path`. Norm
    weights and biases are random too, so a norm or bias in the wrong place changes the tokens."""
    fixture, heads = FAMILIES[family]
    config = read_config(fixture).replace(head_size=None, **heads, **changes)
    torch.manual_seed(seed)
    model = RecurrentDepthLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return save_pretrained(model, path)
