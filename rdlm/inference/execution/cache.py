"""A KV cache designed for recurrence (paper section 6).

Every attention layer of the model gets a preallocated key and value tensor, written by index:

    prelude:  [l_P, batch, heads, max_length, head_dim]
    core:     [l_R, slots, batch, heads, max_length, head_dim]   one slot per iteration (full), or k
    coda:     [l_C, batch, heads, max_length, head_dim]

Strategies for the core block:
- "full": a slot per iteration, iteration i uses slot i (slots = the largest r you will run).
- "shared": a budget of k slots, iteration i reads and writes slot i mod k; memory drops from r to k
  copies of the core's keys and values (paper section 6, "Zero-Shot KV-cache Sharing").

A token that ran fewer iterations than there are slots (an early exit, or a prompt prefilled at a
smaller r) has no entries for its later slots; later tokens then read the latest entry that exists for
that layer. `fill_missing` makes this true by copying the token's last written slot into its empty
slots once, when the token is done, so reading stays a plain slice (no per-token gathers).

Each model call gets the cache with its write plan, `cache.at(start, rows=..., ...)` (a `CacheCall`,
which the model's attention layers call `update(key, k, v)` on): the plan says where the new tokens go
and which rows take part, as an argument of the call, never as state set on the cache beforehand.
- `start`: an int writes the new tokens at buffer index start.. and returns the keys/values up to
  their end, or up to `end` where given (slices: the eager path; rows named by an index tensor from index 0
  read the new keys themselves, not a gather of what was just written; a CPU prompt chunk reads a little past
  its tokens, masked, for the attention kernel's sake: rdlm.inference.execution.model_calls.KEY_MULTIPLE).
  A 0-dim index tensor on the device writes one token per row at that index and returns the whole
  preallocated buffer, so every shape is fixed for the life of a generation (the static decode step that
  `torch.compile` and CUDA graphs take whole; the attention mask hides the entries not yet written).
- `rows`: the batch rows of this call, a subset of the cache's rows (rows whose tokens exited early
  leave the core's matmuls): an index tensor, a slice for consecutive rows (read as views, without
  a gather), or None for all of them.
- `core_writers`: bool over this call's rows; rows that exited early stop writing core entries, so
  nobody reads states computed only for others (with `slots` too: continuous batching's frozen rows).
- `writers`: bool over this call's rows, the rows that write prelude and coda entries (a static call over
  every row of a continuous batch, where only the rows whose token starts or ends write).
- `slots`: one core slot per row of this call, instead of the slot of the key's iteration (rows at
  different iterations in one call: continuous batching). Needs `rows` and a device-side `start`
  with one index per row. `end` then bounds the keys returned (the longest row's length), so a call
  reads what its rows hold, not the whole buffer.
- `budget`: block calls (prompts) whose request cycles through fewer slots than the cache has:
  iteration i uses slot i mod budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from rdlm.checks import check_int
from rdlm.model.config import RDLMConfig
from rdlm.resources import check_memory

Strategy = Literal["full", "shared"]


@dataclass(frozen=True)
class CacheWrite:
    """Where one model call writes and which rows take part (the module doc says what each field means)."""

    start: int | Tensor = 0
    rows: Tensor | slice | None = None
    core_writers: Tensor | None = None
    slots: Tensor | None = None
    budget: int | None = None
    end: int | None = None
    entries: Tensor | None = None  # one token per row at its own index: where they lie (`with_entries`)
    writers: Tensor | None = None


class CacheCall:
    """The cache as one model call sees it: `update(key, k, v)` writes by the call's plan."""

    def __init__(self, cache: RecurrentKVCache, plan: CacheWrite) -> None:
        self.cache, self.plan = cache, plan

    def update(self, key: tuple[str, int, int], k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.write(self.plan, key, k, v)

    def but(self, **changes) -> CacheCall:
        """The same call with some fields of its plan changed (e.g. `core_writers` per iteration)."""
        plan = replace(self.plan, **changes)
        moved = "start" in changes or "rows" in changes
        return CacheCall(self.cache, self.cache.with_entries(plan) if moved else plan)


@dataclass(frozen=True)
class Segment:
    """One call's worth of a packed call: `rows` x n tokens at `tokens` of the packed sequence (row-major),
    attending to their own cache rows by `plan`, with `mask` ([rows, 1, n, keys] boolean); `iteration`
    is the core iteration its cache slot stands for."""

    tokens: slice
    rows: int
    plan: CacheWrite
    mask: Tensor
    iteration: int


class PackedCall:
    """Several core calls in one: their tokens form one sequence [1, T, h], so every per-token operation
    of a core iteration (norms, projections, the MLP: the weights, read once) runs once for all of them,
    and attention runs per segment against its own cache rows. The continuous batch runs its decoding
    rows and the prompts being prefilled (each at its own iteration) this way."""

    def __init__(self, cache: RecurrentKVCache, segments: list[Segment]) -> None:
        self.cache, self.segments = cache, segments

    def attend(
        self,
        key: tuple[str, int, int],
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attention: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:
        """q, k, v: [1, heads, T, d] of the packed tokens; returns attention's output, the same shape."""
        group, layer, _ = key
        if group != "core":
            raise ValueError(f"a packed call runs core iterations only, not {group!r} layers")

        def split(x: Tensor, seg: Segment) -> Tensor:  # [1, H, rows * n, d] -> [rows, H, n, d]
            x = x[0, :, seg.tokens]
            return x.view(x.shape[0], seg.rows, -1, x.shape[-1]).transpose(0, 1)

        out = []
        for seg in self.segments:
            ks, vs = self.cache.write(seg.plan, (group, layer, seg.iteration), split(k, seg), split(v, seg))
            y = attention(split(q, seg), ks, vs, seg.mask)  # [rows, H, n, d]
            out.append(y.transpose(0, 1).reshape(y.shape[1], -1, y.shape[-1]))  # [H, rows * n, d]
        return torch.cat(out, dim=1).unsqueeze(0)


class RecurrentKVCache:
    def __init__(
        self,
        config: RDLMConfig,
        batch_size: int,
        max_length: int,
        num_slots: int,
        strategy: Strategy = "full",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if strategy not in ("full", "shared"):
            raise ValueError(f"cache strategy must be 'full' or 'shared', got {strategy!r}")
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("num_slots", num_slots)):
            check_int(name, value)
        if max_length > config.context_length:
            raise ValueError(f"max_length {max_length} exceeds the model's context length {config.context_length}")
        layers = config.prelude_layers + config.core_layers * num_slots + config.coda_layers
        need = (
            2
            * layers
            * batch_size
            * config.kv_heads
            * config.head_dim
            * max_length
            * torch.empty((), dtype=dtype).element_size()
        )
        check_memory(
            need,
            device if device is not None else "cpu",
            f"a {strategy} KV cache of {num_slots} core slot(s) for {batch_size} x {max_length} tokens",
        )
        self.strategy, self.num_slots = strategy, num_slots
        self.batch_size, self.max_length = batch_size, max_length
        shape = (batch_size, config.kv_heads, max_length, config.head_dim)
        new = lambda *lead: torch.zeros(*lead, *shape, dtype=dtype, device=device)  # noqa: E731
        self.prelude_k, self.prelude_v = new(config.prelude_layers), new(config.prelude_layers)
        self.core_k, self.core_v = new(config.core_layers, num_slots), new(config.core_layers, num_slots)
        self.coda_k, self.coda_v = new(config.coda_layers), new(config.coda_layers)

    def at(
        self,
        start: int | Tensor = 0,
        *,
        rows: Tensor | slice | None = None,
        core_writers: Tensor | None = None,
        slots: Tensor | None = None,
        budget: int | None = None,
        end: int | None = None,
        writers: Tensor | None = None,
    ) -> CacheCall:
        """The cache for one model call that writes its tokens at `start` (see the module doc)."""
        plan = CacheWrite(start, rows, core_writers, slots, budget, end, writers=writers)
        return CacheCall(self, self.with_entries(plan))

    def with_entries(self, plan: CacheWrite) -> CacheWrite:
        """`plan` with its `entries`: for one token per row of `rows` at its own buffer index (the continuous
        batch), where those tokens lie among the flattened entries of one layer's cache [rows, heads, length,
        d] (the rows a slice selects, or all of them for an index tensor), computed once per call instead of
        at every layer's write."""
        start, rows = plan.start, plan.rows
        if not (isinstance(start, Tensor) and start.numel() > 1 and plan.slots is None and rows is not None):
            return replace(plan, entries=None)
        index = start.view(-1)
        picked = rows if isinstance(rows, Tensor) else torch.arange(index.numel(), device=index.device)
        heads, length = self.core_k.shape[3:5]
        return replace(plan, entries=self._entries(heads, length, picked, index))

    def slot(self, iteration: int, budget: int | None = None) -> int:
        if budget is not None:
            return iteration % budget
        if self.strategy == "shared":
            return iteration % self.num_slots
        if iteration >= self.num_slots:
            raise ValueError(
                f"iteration {iteration} needs a cache slot, but this full cache has "
                f"{self.num_slots}; build it with num_slots >= r or use the shared strategy"
            )
        return iteration

    def write(self, plan: CacheWrite, key: tuple[str, int, int], k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store one attention layer's new keys/values by `plan`; return the keys/values the call reads."""
        group, layer, iteration = key
        start, rows, end = plan.start, plan.rows, plan.end
        if group == "core" and plan.slots is not None:  # each row at its own slot and index
            assert isinstance(start, Tensor) and isinstance(rows, Tensor)  # a per-row slot goes with per-row indices
            index = start.view(-1)
            cache_k, cache_v = self.core_k[layer], self.core_v[layer]
            k, v = k.squeeze(2), v.squeeze(2)
            # (slot, row) pairs as rows of the flattened [slots * batch] axis: one index_copy_ / index_select,
            # faster than the equivalent two-axis advanced indexing
            pairs = plan.slots * self.batch_size + rows
            at = self._entries(cache_k.shape[2], cache_k.shape[3], pairs, index)
            if plan.core_writers is not None:  # the others keep their entries
                keep = ~plan.core_writers.view(-1, 1, 1)
                kept = lambda c: c.reshape(-1, c.shape[-1]).index_select(0, at).view_as(k)  # noqa: E731
                k = torch.where(keep, kept(cache_k), k)
                v = torch.where(keep, kept(cache_v), v)
            self._put(cache_k.flatten(0, 1), at, k)
            self._put(cache_v.flatten(0, 1), at, v)
            flat = lambda c: first_entries(c.flatten(0, 1), end, pairs)  # noqa: E731
            return flat(cache_k), flat(cache_v)
        if group == "core":
            slot = self.slot(iteration, plan.budget)
            cache_k, cache_v = self.core_k[layer, slot], self.core_v[layer, slot]
        elif group == "prelude":
            cache_k, cache_v = self.prelude_k[layer], self.prelude_v[layer]
        elif group == "coda":
            cache_k, cache_v = self.coda_k[layer], self.coda_v[layer]
        else:
            raise ValueError(f"unknown layer group {group!r} in cache key {key!r}")
        writers = plan.core_writers if group == "core" else plan.writers
        if writers is not None:  # the others keep their entries
            keep = ~writers.view(-1, 1, 1, 1)
            k = torch.where(keep, self._read(plan, cache_k, k.shape[2]), k)
            v = torch.where(keep, self._read(plan, cache_v, v.shape[2]), v)
        if isinstance(start, Tensor):  # static: one token per row at a device-side index
            index = start.view(-1)  # one index for all rows, or one per row of `rows`
            if rows is None:
                cache_k.index_copy_(2, index, k)
                cache_v.index_copy_(2, index, v)
                return cache_k, cache_v
            if isinstance(rows, slice):  # consecutive rows: views, no gather
                cache_k, cache_v = cache_k[rows], cache_v[rows]
            entries = plan.entries
            if entries is None:
                picked = rows if isinstance(rows, Tensor) else torch.arange(cache_k.shape[0], device=index.device)
                entries = self._entries(cache_k.shape[1], cache_k.shape[2], picked, index)
            self._put(cache_k, entries, k)
            self._put(cache_v, entries, v)
            if isinstance(rows, slice):
                return cache_k[:, :, :end], cache_v[:, :, :end]
            return first_entries(cache_k, end, rows), first_entries(cache_v, end, rows)
        stop = start + k.shape[2]
        if stop > self.max_length:
            raise ValueError(f"the cache holds {self.max_length} tokens; writing up to {stop} does not fit")
        read = stop if end is None else end  # (a call may read past its tokens: its mask hides those entries)
        if not stop <= read <= self.max_length:
            raise ValueError(f"a call writing up to buffer index {stop} cannot read up to {read}")
        if rows is None:
            cache_k[:, :, start:stop] = k
            cache_v[:, :, start:stop] = v
            return cache_k[:, :, :read], cache_v[:, :, :read]
        cache_k[rows, :, start:stop] = k
        cache_v[rows, :, start:stop] = v
        if start == 0 and isinstance(rows, Tensor):  # the rows hold just what was written: no gather of them
            if read == stop:
                return k, v
            pad = (0, 0, 0, read - stop)  # zeros past the tokens (masked)
            return torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        return cache_k[rows, :, :read], cache_v[rows, :, :read]

    @staticmethod
    def _entries(heads: int, length: int, rows: Tensor, index: Tensor) -> Tensor:
        """Where cache[rows[j], :, index[j]] lie among the flattened entries of a contiguous cache [N, heads,
        length, d]: [len(rows) * heads] (`_put` writes there)."""
        return ((rows.view(-1, 1) * heads + torch.arange(heads, device=rows.device)) * length + index.view(-1, 1)).view(
            -1
        )

    @staticmethod
    def _put(cache: Tensor, at: Tensor, new: Tensor) -> None:
        """new ([rows, heads, (1,) d]) into the flattened entries `at` of a contiguous cache: one index_copy_
        (on a CPU 3-6x faster than the equivalent advanced-indexing put). Under torch.compile, the same
        write as an opaque in-place op (`put_entries`)."""
        if torch.compiler.is_compiling():
            put_entries(cache, at, new)
        else:
            _put_entries(cache, at, new)

    @staticmethod
    def _read(plan: CacheWrite, cache: Tensor, n: int) -> Tensor:
        """The entries this call's new tokens would overwrite (to keep them for non-writers)."""
        if isinstance(plan.start, Tensor) and plan.start.numel() > 1:
            # one entry per row, at its own index: an index_select of the flattened entries, not a gather of rows
            index = plan.start.view(-1)
            if isinstance(plan.rows, Tensor):
                rows, picked = cache, plan.rows
            else:
                rows = cache if plan.rows is None else cache[plan.rows]
                picked = torch.arange(rows.shape[0], device=index.device)
            at = plan.entries
            if at is None:
                at = RecurrentKVCache._entries(rows.shape[1], rows.shape[2], picked, index)
            return rows.reshape(-1, rows.shape[-1]).index_select(0, at).view(len(picked), rows.shape[1], 1, -1)
        rows = cache if plan.rows is None else cache[plan.rows]
        if isinstance(plan.start, Tensor):
            return rows.index_select(2, plan.start.view(-1))
        return rows[:, :, plan.start : plan.start + n]

    def fill_missing(
        self,
        steps: int | Tensor,
        start: int | Tensor,
        end: int | None = None,
        *,
        row: int | None = None,
        slots: int | None = None,
    ) -> None:
        """The tokens at buffer indices start..end-1 (or the one token at a device-side index `start`)
        ran `steps` core iterations (an int for all rows, or one per row): give their unwritten slots
        (slot >= steps) a copy of the last written slot, so later tokens read the latest entry.
        With an int `steps`, `row` fills that row only (the others are left alone) and `slots` bounds
        the slots its tokens use (a request's own budget in a shared cache; default all)."""
        static = isinstance(start, Tensor)
        if isinstance(start, Tensor):
            start = start.view(1)
        elif end is None:
            end = start + 1
        window = lambda c: c.index_select(4, start) if static else c[:, :, :, :, start:end]  # noqa: E731
        if isinstance(steps, int):  # uniform: a plain slice copy, no host sync
            slots = self.num_slots if slots is None else slots
            if steps >= slots:
                return
            which = slice(None) if row is None else row
            for cache in (self.core_k, self.core_v):
                filled = window(cache)
                filled[:, steps:slots, which] = filled[:, steps - 1 : steps, which]
                if isinstance(start, Tensor):  # static
                    cache.index_copy_(4, start, filled)
            return
        if row is not None or slots is not None:
            raise ValueError("row and slots go with an int number of steps")
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
            filled = window(cache)  # [l_R, slots, batch, H, n, d]
            latest = filled[:, last, rows].unsqueeze(1)  # [l_R, 1, batch, H, n, d]
            filled.copy_(torch.where(missing, latest, filled))
            if isinstance(start, Tensor):  # static
                cache.index_copy_(4, start, filled)

    def clear_rows(self, rows: int | Tensor | slice) -> None:
        """Zero every entry of `rows` (their masked entries still reach the attention's product, with weight 0:
        a NaN there would not stay hidden)."""
        for cache in (self.prelude_k, self.prelude_v, self.core_k, self.core_v, self.coda_k, self.coda_v):
            cache[..., rows, :, :, :] = 0

    @property
    def core_nbytes(self) -> int:
        return self.core_k.nbytes + self.core_v.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes held by all cache tensors."""
        return sum(
            t.nbytes for t in (self.prelude_k, self.prelude_v, self.core_k, self.core_v, self.coda_k, self.coda_v)
        )


def _put_entries(cache: Tensor, at: Tensor, new: Tensor) -> None:
    d = cache.shape[-1]
    cache.view(-1, d).index_copy_(0, at, new.reshape(-1, d).to(cache.dtype))


# The cache write as an op the compiler keeps whole and in place. Traced as index_copy_ into a view of
# the whole cache, inductor's functionalization copies every layer's cache at every call (on the CPU, the
# `small` preset at r = 32 decoded 3x slower compiled than eager for it; rdlm.inference.execution.cpu_compile).
@torch.library.custom_op("rdlm::put_entries", mutates_args=("cache",))
def put_entries(cache: Tensor, at: Tensor, new: Tensor) -> None:
    """`_put_entries` as a custom op that mutates `cache` in place."""
    _put_entries(cache, at, new)


@put_entries.register_fake
def _put_entries_fake(cache: Tensor, at: Tensor, new: Tensor) -> None:
    return None


def first_entries(buffer: Tensor, end: int | None, rows: Tensor | None = None) -> Tensor:
    """The first `end` entries (None: all) along the length axis of `rows` of `buffer` ([batch, length] or
    [batch, heads, length, d]; rows None: all of them), as a new tensor. One gather of flat indices, not a slice:
    compiled with `end` a dynamic size (the CPU's static step), a view's layout would tell whether `end` is the
    full length, and the code compiled for one case would not take the other."""
    if end is None:
        return buffer if rows is None else buffer.index_select(0, rows)
    rows = torch.arange(buffer.shape[0], device=buffer.device) if rows is None else rows
    inner = buffer.shape[1:-1] if buffer.dim() == 4 else ()  # (heads,)
    length, last = (buffer.shape[-2], buffer.shape[-1]) if buffer.dim() == 4 else (buffer.shape[-1], 1)
    heads = inner[0] if inner else 1
    index = (rows.view(-1, 1, 1) * heads + torch.arange(heads, device=buffer.device).view(1, -1, 1)) * length
    index = (index + torch.arange(end, device=buffer.device).view(1, 1, -1)).flatten()
    out = buffer.reshape(-1, last).index_select(0, index)
    return out.view(rows.shape[0], heads, end, last) if inner else out.view(rows.shape[0], end)
