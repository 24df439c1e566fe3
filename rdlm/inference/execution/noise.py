"""s_0 at inference: the initial state of the token at position p is row p of a table drawn from
(seed, position) alone, so a prompt gets the same s_0 alone or in any batch, on any device, and a
speculative draft the same as plain decoding (docs/inference.md, "s0 at inference"). Every front end
that decodes or scores with a random s_0 (the engine, the continuous batch, the transformers model, the
lm-eval model) reads it here."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import Tensor

from rdlm.model.lm import RecurrentDepthLM

NOISE_BLOCK = 256  # the s_0 table is drawn in blocks of positions, each from its own seed


def block_seed(seed: int, block: int) -> int:
    """The seed of a block of the s_0 table: seed x 1_000_003 + block, modulo 2**64 (a generator takes
    0 .. 2**64 - 1): every seed in [0, 2**63) has one, and the seeds that had one before the modulo (below
    about 1.8e13) keep it, so their s_0 and their tokens stay as they were."""
    return (seed * 1_000_003 + block) % 2**64


class NoiseBlocks:
    """The blocks of s_0 tables an engine drew last, kept for the next request with the same seed and scale
    (a server's requests mostly share the default seed): drawing a block of a 256-wide model costs ~0.9 ms
    on a CPU, as much as a prompt's prelude. Least recently used first out, at most `max_bytes` kept."""

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[tuple[int, float, int], Tensor] = OrderedDict()

    def get(self, model: RecurrentDepthLM, seed: int, scale: float, block: int) -> Tensor:
        key = (seed, scale, block)
        drawn = self.blocks.get(key)
        if drawn is None:
            drawn = draw_block(model, seed, scale, block)
            self.blocks[key] = drawn
            while len(self.blocks) * drawn.nbytes > self.max_bytes and len(self.blocks) > 1:
                self.blocks.popitem(last=False)
        else:
            self.blocks.move_to_end(key)
        return drawn


def draw_block(model: RecurrentDepthLM, seed: int, scale: float, block: int) -> Tensor:
    """Positions block x NOISE_BLOCK .. (block + 1) x NOISE_BLOCK - 1 of the s_0 table, on the CPU in float32."""
    generator = torch.Generator().manual_seed(block_seed(seed, block))
    return model.init_state(torch.zeros(NOISE_BLOCK, model.config.hidden_size), scale, generator)


def noise_table(
    model: RecurrentDepthLM,
    seed: int,
    scale: float,
    length: int,
    dtype: torch.dtype,
    device: torch.device,
    blocks: NoiseBlocks | None = None,
) -> Tensor | None:
    """s_0 for every position 0..length-1, [length, hidden]: a function of (seed, position) only, so a
    row gets the same noise alone or in any batch, and a draft the same as plain decoding. Drawn on the
    CPU (the same numbers on every device), or taken from `blocks` where drawn before. None where s_0 is
    all zeros."""
    if scale == 0 or model.config.state_init != "random":
        return None
    block = draw_block if blocks is None else blocks.get
    drawn = [block(model, seed, scale, b) for b in range(math.ceil(length / NOISE_BLOCK))]
    return torch.cat(drawn)[:length].to(device=device, dtype=dtype)
