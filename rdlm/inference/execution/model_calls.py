"""The model's calls: the one place the inference engines call the model (issue #29).

Every engine runs the same three parts of the model (paper section 3, docs/inference.md): the prelude
over new tokens (`embed`), core iterations on the latent state (`iterate_once`, `iterate`), the coda and the head
(`readout`), each with the RoPE of the tokens' positions, an attention mask over the cache's valid
entries, and the cache with a write plan. `ModelCalls` owns the model, the `RecurrentKVCache`, which
buffer entries hold a token (`key_valid`, the keys of every mask) and the s_0 noise table; a caller
says which rows and buffer indices a call covers (a `Call`, from `block`, `tokens` or `prompt`) and at
which iterations, and `ModelCalls` builds the positions and the mask and calls the model. The engines
above it (the continuous batch's `StepRunner` with its lockstep tokens, `PromptChunk`s, speculative rounds
and `ParallelSampler` waves; `Sequences` for a transformers forward) decide what runs when and hold no
model call of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rdlm.inference.execution.cache import CacheCall, PackedCall, RecurrentKVCache, Segment, Strategy, first_entries
from rdlm.inference.execution.cpu_linear import OneDnnLinears
from rdlm.inference.execution.noise import NoiseBlocks, noise_table
from rdlm.model.layers import Rope, padded_causal_mask
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters
from rdlm.model.lora_serving import active_adapter, routed

# A prompt chunk of several tokens on the CPU that reads fewer than KEY_PADDED_BELOW keys reads them in multiples
# of KEY_MULTIPLE buffer entries (`prompt`): ATen's CPU attention (its flash kernel, like its softmax) runs the
# last partial vector of each query's keys in scalar code, so such chunks paid up to 2.8x for it (13 keys against
# 16; 31 against 32: 2.0x; with AVX2 kernels 1.2-1.45x), where at 84-100 keys the padding cost 2-6% and a decoded
# token (one query) gained nothing (one thread of an AMD EPYC Zen 5, docs/generation.md).
KEY_MULTIPLE = 16
KEY_PADDED_BELOW = 64


class PromptCompiler(Protocol):
    """The prompts' packed iteration compiled (rdlm.inference.execution.cpu_compile.CompiledPrompts), as
    `ModelCalls` and the engine use it."""

    seconds: float
    failed: bool
    threads: int  # calls of at least `wide_from` tokens run on this many threads, on `cpus` (None: its own)
    wide_from: int | None  # (None: every call runs on the caller's threads)
    cpus: set[int] | None

    def __call__(self, states: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor, packed: PackedCall) -> Tensor: ...

    def refresh(self, stamp: int | None = None) -> None: ...

    def measure_threads(self, threads: int, call: Callable[[int], Any]) -> None: ...


def packed_iteration(
    model: RecurrentDepthLM, states: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor, hook
) -> Tensor:
    """One core iteration of a packed call's tokens [1, T, h] (`ModelCalls.iterate_packed`) with `hook` as its
    attention layers' cache: a `PackedCall`, or what the CPU's compiled prompts give it
    (rdlm.inference.execution.cpu_compile compiles this function whole)."""
    return model.step(states, embedded, 0, (cos, sin), None, hook)


@dataclass(frozen=True)
class Call:
    """What model calls over one block of tokens take besides the tokens or states: the RoPE of the
    tokens' positions, the attention mask ([rows | 1, 1, n, keys] boolean), the cache with its write
    plan (`CacheWrite`: start, rows, slots, ...) and, on a model with LoRA adapters, each row's adapter."""

    rope: Rope
    mask: Tensor
    cache: CacheCall
    positions: Tensor  # [rows | 1, n]
    adapters: Tensor | None = None  # [rows, 1]: 0 the base, i adapter i of `ModelCalls.route`

    @property
    def start(self) -> int | Tensor:
        return self.cache.plan.start

    @property
    def rows(self) -> Tensor | slice | None:
        return self.cache.plan.rows

    def but(self, **changes) -> Call:
        """The same call with some fields of its cache plan changed (`CacheCall.but`)."""
        return dataclasses.replace(self, cache=self.cache.but(**changes))

    def keep_rows(self, keep: Tensor, rows: Tensor) -> Call:
        """The call of its rows at `keep` only, rows `rows` of the cache, where every row shares its RoPE and
        mask (a prompt chunk's: `select` for calls with a row's own)."""
        adapters = None if self.adapters is None else self.adapters[keep]
        return dataclasses.replace(self, cache=self.cache.but(rows=rows), adapters=adapters)

    def select(self, keep: Tensor | slice, rows: Tensor | slice) -> Call:
        """The call of its rows at `keep` only, rows `rows` of the cache (a per-row start goes with them)."""
        start = self.start
        if isinstance(start, Tensor) and start.ndim:
            start = start[keep]
        return Call(
            (self.rope[0][keep], self.rope[1][keep]),
            self.mask[keep],
            self.cache.but(start=start, rows=rows),
            self.positions[keep],
            None if self.adapters is None else self.adapters[keep],
        )


class Pack:
    """Core iterations of several calls run as one: their tokens form one sequence [1, T, h], and
    attention runs per segment against its own cache rows (`PackedCall`)."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.parts: list[list[Tensor]] = [[], [], [], []]  # states, e, cos, sin
        self.adapters: list[Tensor] = []  # each token's adapter, on a model with adapters

    def add(self, call: Call, state: Tensor, embedded: Tensor, iteration: int) -> slice:
        """Append g rows x n tokens (`state` [g, n, h]) at `iteration`; returns their tokens in the pack."""
        g, n, _h = state.shape
        at = self.segments[-1].tokens.stop if self.segments else 0
        tokens = slice(at, at + g * n)
        self.segments.append(Segment(tokens, g, call.cache.plan, call.mask, iteration))
        for part, value in zip(self.parts, (state, embedded, *call.rope), strict=True):
            part.append(value.expand(g, n, *value.shape[2:]).reshape(1, g * n, *value.shape[2:]))
        if call.adapters is not None:
            self.adapters.append(call.adapters.expand(g, n).reshape(1, g * n))
        return tokens


class ModelCalls:
    """The model, its KV cache, the valid buffer entries of each row and the s_0 table (see the module
    doc). Buffer index t of row b holds that row's token at position t - pad[b] (`Sequences` left-pads its
    prompts to a common length; without `pad`, every row starts at index 0)."""

    def __init__(
        self,
        model: RecurrentDepthLM,
        batch: int,
        max_length: int,
        num_slots: int,
        strategy: Strategy = "full",
        pad: Tensor | None = None,
        seed: int | None = None,
        init_scale: float = 1.0,
    ) -> None:
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        self.cache = RecurrentKVCache(model.config, batch, max_length, num_slots, strategy, self.dtype, self.device)
        self.key_valid = torch.zeros(batch, max_length, dtype=torch.bool, device=self.device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device) if pad is None else pad
        self.batch_rows = torch.arange(batch, device=self.device)
        self.noise_blocks = NoiseBlocks()  # the s_0 blocks drawn last (requests mostly share a seed)
        # s_0 of every position for `seed` (all rows), or None: a caller passes its own rows of a table
        self.noise = None if seed is None else self.noise_table(seed, init_scale, max_length)
        # LoRA adapters: their names (adapter i is names[i - 1]) and each row's, in place on the device (the static
        # step's graphs read it); a row runs the model as set (its active adapter, or the base) until routed
        self.adapter_names = loaded_adapters(model)
        # the prompts' packed iteration compiled (rdlm.inference.execution.cpu_compile.CompiledPrompts), where the
        # engine compiles on the CPU; None: `iterate_packed` calls the model eagerly
        self.compiled_prompts: PromptCompiler | None = None
        # eager float32 linear layers on the CPU through oneDNN where it measures faster (execution.cpu_linear)
        self.linears = OneDnnLinears(model)
        self.default_adapter = self.adapter_number(active_adapter(model))
        self.row_adapters: Tensor | None = None
        if self.adapter_names:
            self.row_adapters = torch.full((batch, 1), self.default_adapter, dtype=torch.long, device=self.device)

    def upload(self, values: list) -> Tensor:
        """Host values (a list, nested or not) as a tensor on the model's device. On CUDA through pinned
        memory and without waiting: a copy from pageable memory would first wait for all queued work, a host
        sync at every step that feeds the device a few indices."""
        host = torch.tensor(values)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    # ---- which adapter each row runs (rdlm.model.lora)

    def adapter_number(self, name: str | None) -> int:
        """0 for the base (None), i for adapter `name`, adapter i of these calls (a name the model has: the
        engine checked it)."""
        return 0 if name is None else self.adapter_names.index(name) + 1

    def route(self, row: int, adapter: str | None) -> None:
        """Row `row` runs adapter `adapter` from its next call on (None: the model as set, its active
        adapter or the base). A model without adapters has nothing to route."""
        if self.row_adapters is not None:
            self.row_adapters[row] = self.default_adapter if adapter is None else self.adapter_number(adapter)

    def _adapters(self, rows: Tensor | slice | None) -> Tensor | None:
        """The adapters of a call over `rows` (None: every row), [rows, 1]; None without adapters."""
        if self.row_adapters is None:
            return None
        return self.row_adapters if rows is None else self.row_adapters[rows]

    def _context(self, adapters: Tensor | None, rows: int) -> AbstractContextManager:
        """Where a model call of `rows` tokens runs: each token through its adapter (`adapters` shaped as the call's
        leading dimensions; the model as it is set where there are none), its linear layers' products on the kernel
        measured faster for that many rows (`OneDnnLinears`)."""
        linears = self.linears.over(rows)
        if adapters is None:
            return linears
        return _both(routed(self.model, self.adapter_names, adapters), linears)

    # ---- which entries hold a token

    def admit(self, start: int | Tensor, n: int = 1, rows: Tensor | slice | int = slice(None)) -> None:
        """Mark new tokens' buffer entries valid (later queries attend to them): indices start .. start +
        n - 1 of `rows`, or one per row at the index tensor `start`. A row's left padding never is."""
        if isinstance(start, Tensor):
            self.key_valid[rows, start] = True
            return
        self.key_valid[rows, start : start + n] = True
        if start == 0:
            self.key_valid[rows, :n] &= torch.arange(n, device=self.device) >= self.pad[rows].unsqueeze(-1)

    def rewind(self, position: int, rows: Tensor | slice | int = slice(None)) -> None:
        """Forget the entries of `rows` from buffer index `position` on (the mask hides them until rewritten)."""
        self.key_valid[rows, position:] = False

    # ---- the calls' inputs

    def positions(self, start: int | Tensor, n: int) -> Tensor:
        """[rows, n]: the positions of every row's tokens at buffer indices start .. start + n - 1."""
        index = start + torch.arange(n, device=self.device)
        return (index.unsqueeze(0) - self.pad.unsqueeze(1)).clamp_min(0)

    def block(self, start: int | Tensor, n: int = 1, row: int | None = None) -> Call:
        """n tokens of every row (or of `row` alone) at buffer indices start..: causal over the valid entries;
        a pad query sees itself only (so its softmax is defined; nobody attends to it). A 0-dim index tensor
        `start` (one token: the static decode step) sees the whole buffer, a fixed shape; the mask hides
        what is not written yet."""
        rows = slice(None) if row is None else slice(row, row + 1)
        positions = self.positions(start, n)[rows]
        if isinstance(start, Tensor):
            mask = self.key_valid[rows, None, None, :]
        else:
            valid = self.key_valid[rows, : start + n]
            mask = padded_causal_mask(valid, n) if n > 1 else valid[:, None, None, :]
        cache = self.cache.at(start) if row is None else self.cache.at(start, rows=rows)
        return Call(self.model.rope(positions, check=False), mask, cache, positions, self._adapters(rows))

    def tokens(self, rows: list[int], index: list[int]) -> tuple[Tensor, Call]:
        """One token per row, row rows[j] at its own buffer index index[j] (the continuous batch): (the rows
        as a tensor, the call). The call's cache rows are a slice where they are consecutive (views, no
        gather); it reads the cache up to the longest row's end."""
        numbers, uploaded = rows, self.upload(rows)
        consecutive = numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        select = slice(numbers[0], numbers[-1] + 1) if consecutive else uploaded
        positions = self.upload(index).view(-1, 1)
        end = max(index) + 1
        mask = self.key_valid[select, :end][:, None, None, :]
        cache = self.cache.at(positions.view(-1), rows=select, end=end)
        rope = self.model.rope(positions, check=False)
        return uploaded, Call(rope, mask, cache, positions, self._adapters(select))

    def every_row(self, index: Tensor, slots: Tensor | None, writers: Tensor, end: int | None = None) -> Call:
        """One token per row of the batch's first index.shape[0] rows, row b at buffer index index[b] and core
        slot slots[b] (device tensors; None for a call of the prelude or the coda), only the `writers` rows
        writing cache entries (the continuous batch's static step): every shape is fixed but the keys read, the
        buffer up to `end` (None: all of it; every row's index below it), and the mask hides what is not
        written."""
        rows = index.shape[0]  # (narrow, not a slice: a compiled step's dynamic sizes reach the full size too)
        positions = (index - self.pad.narrow(0, 0, rows)).clamp_min(0).view(-1, 1)
        batch_rows = self.batch_rows.narrow(0, 0, rows)
        cache = self.cache.at(index, rows=batch_rows, slots=slots, core_writers=writers, end=end, writers=writers)
        valid = self.key_valid.narrow(0, 0, rows)
        mask = (valid if end is None else first_entries(valid, end))[:, None, None, :]
        return Call(self.model.rope(positions, check=False), mask, cache, positions, self._adapters(None))

    def all_rows(self, index: Tensor, budget: int, writers: Tensor) -> Call:
        """One token per row of the whole batch, row b at buffer index index[b] (a device tensor), core
        iteration i at slot i mod `budget`, only the `writers` rows writing core entries (a lockstep token on
        the static path, rdlm.inference.runner.lockstep): every shape is fixed and the cache is read as views of the
        whole buffer (no gather); the mask hides what is not written."""
        positions = (index - self.pad).clamp_min(0).view(-1, 1)
        cache = self.cache.at(index, rows=slice(None), budget=budget, core_writers=writers)
        mask = self.key_valid[:, None, None, :]
        return Call(self.model.rope(positions, check=False), mask, cache, positions, self._adapters(None))

    def prompt(self, start: int, n: int, rows: Tensor, budget: int) -> Call:
        """Prompt tokens at buffer indices (= positions) start .. start + n - 1 of `rows`, right-padded to
        n, causal over the buffer (no real token attends to a pad); the core cycles through `budget` slots.
        On the CPU a chunk of several tokens and few keys reads them up to a multiple of KEY_MULTIPLE entries, the
        ones past its tokens masked (causal: they lie after every query), within the buffer: one whose length is
        a multiple of KEY_MULTIPLE (`generate`'s) reads as many as any longer one."""
        positions = torch.arange(start, start + n, device=self.device).view(1, -1)
        keys = start + n
        if n > 1 and keys < KEY_PADDED_BELOW and self.device.type == "cpu":
            keys = min(-(-keys // KEY_MULTIPLE) * KEY_MULTIPLE, self.cache.max_length)
        mask = torch.arange(keys, device=self.device).view(1, -1) <= positions.view(-1, 1)
        return Call(
            self.model.rope(positions, check=False),
            mask.view(1, 1, n, keys),
            self.cache.at(start, rows=rows, budget=budget, end=keys),
            positions,
            self._adapters(rows),
        )

    # ---- s_0 (docs/inference.md, "s0 at inference")

    def noise_table(self, seed: int, scale: float, length: int) -> Tensor | None:
        """s_0 of positions 0 .. length - 1 drawn from (seed, position) alone (rdlm.inference.execution.noise)."""
        return noise_table(self.model, seed, scale, length, self.dtype, self.device, self.noise_blocks)

    def start_state(self, embedded: Tensor, noise: Tensor | None) -> Tensor:
        """s_0 from rows of a noise table (None: zeros), or e itself for a model whose s_0 is its embedding."""
        return self.model.start_state(embedded, noise)

    def initial_state(self, embedded: Tensor, positions: Tensor) -> Tensor:
        """s_0 of tokens at `positions`: rows of this table."""
        return self.start_state(embedded, None if self.noise is None else self.noise[positions])

    def state_noise(self, like: Tensor, scale: float, generator: torch.Generator) -> Tensor:
        """A fresh draw from s_0's distribution, shaped like `like` (the parallel sampler's state mixing)."""
        return self.model.init_state(torch.zeros_like(like), scale, generator)

    # ---- the model

    def embed(self, ids: Tensor, call: Call) -> Tensor:
        """The prelude: e of the call's tokens."""
        with self._context(call.adapters, ids.numel()):
            return self.model.embed(ids, call.rope, call.mask, call.cache)

    def iterate_once(self, state: Tensor, embedded: Tensor, iteration: int, call: Call) -> Tensor:
        """Core iteration `iteration`."""
        with self._context(call.adapters, _rows(state)):
            return self.model.step(state, embedded, iteration, call.rope, call.mask, call.cache)

    def iterate(self, state: Tensor, embedded: Tensor, call: Call, iterations: range) -> Tensor:
        """Core iterations `iterations`, one after the other."""
        for i in iterations:
            state = self.iterate_once(state, embedded, i, call)
        return state

    def iterate_packed(self, pack: Pack) -> Tensor:
        """One core iteration of every call in `pack` in one model call: the new states, [1, T, h]."""
        states, embedded, cos, sin = (torch.cat(part, dim=1) for part in pack.parts)
        packed = PackedCall(self.cache, pack.segments)  # read through its `attend` (Attention.forward), not `update`
        adapters = torch.cat(pack.adapters, dim=1) if pack.adapters else None  # [1, T]: each token's
        if self.compiled_prompts is not None and adapters is None:
            return self.compiled_prompts(states, embedded, cos, sin, packed)
        with self._context(adapters, states.shape[1]):
            return packed_iteration(self.model, states, embedded, cos, sin, packed)

    def readout(self, state: Tensor, call: Call) -> Tensor:
        """The coda and the head: float32 logits of the call's tokens."""
        with self._context(call.adapters, _rows(state)):
            return self.model.readout(state, call.rope, call.mask, call.cache)

    def coda_output(self, state: Tensor, call: Call) -> Tensor:
        """The coda up to the head (its keys and values written): the head's input for the call's tokens."""
        with self._context(call.adapters, _rows(state)):
            return self.model.coda_output(state, call.rope, call.mask, call.cache)

    def head(self, x: Tensor, adapters: Tensor | None) -> Tensor:
        """Float32 logits of coda outputs x [m, 1, h] (`coda_output`), each row through its adapter (`adapters`
        [m, 1], None: the model as it is set)."""
        with self._context(adapters, _rows(x)):
            return self.model.head(x)

    def exit_probability(self, state: Tensor) -> Tensor:
        """A learned exit gate's probability of exiting at `state` (Ouro)."""
        return self.model.exit_probability(state)


def _rows(x: Tensor) -> int:
    """The tokens of a call's states or inputs [..., h]."""
    return x.numel() // x.shape[-1]


@contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield
