"""A KV cache designed for recurrence (SPEC section 4, paper section 6).

Every attention layer of the model gets a preallocated key and value tensor, written by index:

    prelude:  [l_P, batch, heads, max_length, head_dim]
    core:     [l_R, slots, batch, heads, max_length, head_dim]   one slot per iteration (full), or k
    coda:     [l_C, batch, heads, max_length, head_dim]

Strategies for the core block:
- "full": a slot per iteration, iteration i uses slot i (slots = the largest r you will run).
- "shared": a budget of k slots, iteration i reads and writes slot i mod k; memory drops from r to k
  copies of the core's keys and values (paper section 6.3).

A token that ran fewer iterations than there are slots (an early exit, or a prompt prefilled at a
smaller r) has no entries for its later slots; later tokens then read the latest entry that exists for
that layer. `fill_missing` makes this true by copying the token's last written slot into its empty
slots once, when the token is done, so reading stays a plain slice (no per-token gathers).

The model calls `update(key, k, v)` for every attention layer; the generator sets, before each model
call, where the new tokens go (`start`) and which batch rows may write core entries (`core_writers`:
sequences that exited early stop writing, so nobody reads states computed only for others).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rdlm.config import RDLMConfig

Strategy = Literal["full", "shared"]


class RecurrentKVCache:
    def __init__(self, config: RDLMConfig, batch_size: int, max_length: int, num_slots: int,
                 strategy: Strategy = "full", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if strategy not in ("full", "shared"):
            raise ValueError(f"cache strategy must be 'full' or 'shared', got {strategy!r}")
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_length > config.context_length:
            raise ValueError(f"max_length {max_length} exceeds the model's context length {config.context_length}")
        self.strategy, self.num_slots = strategy, num_slots
        self.batch_size, self.max_length = batch_size, max_length
        shape = (batch_size, config.num_heads, max_length, config.head_dim)
        new = lambda *lead: torch.zeros(*lead, *shape, dtype=dtype, device=device)  # noqa: E731
        self.prelude_k, self.prelude_v = new(config.prelude_layers), new(config.prelude_layers)
        self.core_k, self.core_v = new(config.core_layers, num_slots), new(config.core_layers, num_slots)
        self.coda_k, self.coda_v = new(config.coda_layers), new(config.coda_layers)
        self.start = 0                       # index where the current call's tokens are written
        self.core_writers: Tensor | None = None  # bool [batch]: rows whose core entries are written

    def slot(self, iteration: int) -> int:
        if self.strategy == "shared":
            return iteration % self.num_slots
        if iteration >= self.num_slots:
            raise ValueError(f"iteration {iteration} needs a cache slot, but this full cache has "
                             f"{self.num_slots}; build it with num_slots >= r or use the shared strategy")
        return iteration

    def update(self, key: tuple[str, int, int], k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        group, layer, iteration = key
        if group == "core":
            slot = self.slot(iteration)
            cache_k, cache_v = self.core_k[layer, slot], self.core_v[layer, slot]
        elif group == "prelude":
            cache_k, cache_v = self.prelude_k[layer], self.prelude_v[layer]
        elif group == "coda":
            cache_k, cache_v = self.coda_k[layer], self.coda_v[layer]
        else:
            raise ValueError(f"unknown layer group {group!r} in cache key {key!r}")
        start, end = self.start, self.start + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"the cache holds {self.max_length} tokens; writing up to {end} does not fit")
        if group == "core" and self.core_writers is not None:
            keep = ~self.core_writers.view(-1, 1, 1, 1)
            k = torch.where(keep, cache_k[:, :, start:end], k)
            v = torch.where(keep, cache_v[:, :, start:end], v)
        cache_k[:, :, start:end] = k
        cache_v[:, :, start:end] = v
        return cache_k[:, :, :end], cache_v[:, :, :end]

    def fill_missing(self, steps: Tensor, start: int, end: int) -> None:
        """Tokens start..end of each row ran `steps[row]` core iterations: give their unwritten slots
        (slot >= steps) a copy of the last written slot, so later tokens read the latest entry."""
        steps = steps.to(self.core_k.device).view(-1)
        if steps.shape[0] != self.batch_size:
            raise ValueError(f"steps has {steps.shape[0]} rows, the cache {self.batch_size}")
        if steps.min() < 1:
            raise ValueError("every token must have run at least one iteration")
        if bool((steps >= self.num_slots).all()):
            return  # every slot was written (always true for shared caches once r >= k)
        rows = torch.arange(self.batch_size, device=steps.device)
        last = (steps - 1).clamp(max=self.num_slots - 1)
        missing = torch.arange(self.num_slots, device=steps.device).view(-1, 1) >= steps.view(1, -1)
        missing = missing.view(1, self.num_slots, self.batch_size, 1, 1, 1)  # [1, slots, batch, ...]
        for cache in (self.core_k, self.core_v):
            window = cache[:, :, :, :, start:end]                    # [l_R, slots, batch, H, n, d]
            latest = window[:, last, rows].unsqueeze(1)              # [l_R, 1, batch, H, n, d]
            window.copy_(torch.where(missing, latest, window))

    @property
    def core_nbytes(self) -> int:
        return self.core_k.nbytes + self.core_v.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes held by all cache tensors."""
        return sum(t.nbytes for t in (self.prelude_k, self.prelude_v, self.core_k, self.core_v,
                                      self.coda_k, self.coda_v))
