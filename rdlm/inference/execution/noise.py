"""s_0 at inference: the initial state of the token at position p is row p of a table drawn from
(seed, position) alone, so a prompt gets the same s_0 alone or in any batch, on any device, and a
speculative draft the same as plain decoding (docs/inference.md, "s0 at inference"). Every front end
that decodes or scores with a random s_0 (the engine, the continuous batch, the transformers model, the
lm-eval model) reads it here."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rdlm.model.lm import RecurrentDepthLM

NOISE_BLOCK = 256  # the s_0 table is drawn in blocks of positions, each from its own seed


def block_seed(seed: int, block: int) -> int:
    """The seed of a block of the s_0 table: seed x 1_000_003 + block, modulo 2**64 (a generator takes
    0 .. 2**64 - 1): every seed in [0, 2**63) has one, and the seeds that had one before the modulo (below
    about 1.8e13) keep it, so their s_0 and their tokens stay as they were."""
    return (seed * 1_000_003 + block) % 2**64


def noise_table(
    model: RecurrentDepthLM, seed: int, scale: float, length: int, dtype: torch.dtype, device: torch.device
) -> Tensor | None:
    """s_0 for every position 0..length-1, [length, hidden]: a function of (seed, position) only, so a
    row gets the same noise alone or in any batch, and a draft the same as plain decoding. Drawn on the
    CPU (the same numbers on every device). None where s_0 is all zeros."""
    if scale == 0 or model.config.state_init != "random":
        return None
    blocks = []
    for b in range(math.ceil(length / NOISE_BLOCK)):
        generator = torch.Generator().manual_seed(block_seed(seed, b))
        blocks.append(model.init_state(torch.zeros(NOISE_BLOCK, model.config.hidden_size), scale, generator))
    return torch.cat(blocks)[:length].to(device=device, dtype=dtype)
