"""Per-token exits inside vLLM's forward (paper section 6.1): which tokens of a step are decoded, and the r core
iterations with an exit criterion read after each, as `rdlm generate` reads it (rdlm's one exit update,
`ExitTrack.after_iteration`).

- A decoded token that exits keeps its state, and at each later iteration writes into that iteration's cache
  the keys and values it holds there: the ones of its last computed iteration for a slot it has not written
  yet (rdlm's `fill_missing`), else the ones already in the slot (a shared cache of k slots, from iteration k
  on). It holds them by holding its fused q/k/v projection: the rest of a layer's projection is a function of
  that and the token's position.
- The loop looks at the exit flags every `sync_every` iterations, never before a token can have exited: when
  every token of the step has exited, the loop stops there and the remaining slots are filled with a cache
  write (no attention, no MLP). The eager loop looks from the host, and when no token has exited the next
  iteration holds nothing; between looks nothing waits for the device. A forward vLLM compiles has no Python to
  look with: each stretch of iterations between two looks is one `torch.cond`, which fills the stretch's slots
  when every token has exited and otherwise runs it with exited tokens held (the same tokens; the decoded tokens
  are read at run time by the `rdlm::vllm_decoding_tokens` operator). With tensor parallelism the ranks agree on
  each look's answer with one all-reduce, so no rank leaves the loop (and its collectives) alone.
- Prompt tokens run every iteration (with a learned gate the coda reads each one's state at the iteration
  where its gate fired, rdlm's gated prefill).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.library import Library
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.utils.torch_utils import direct_register_custom_op

from rdlm.inference.execution.graphs import resolve_sync_every
from rdlm.inference.exits.track import ExitTrack, done_iterating
from rdlm.integrations.vllm.layers import LayerWeights, write_cache
from rdlm.integrations.vllm.options import RecurrenceOptionError


@dataclasses.dataclass
class ExitStats:
    """What the forward ran since the model was loaded (read with `vllm.LLM.apply_model`). The eager forward counts
    `steps` forwards and the core iterations they ran (`step_iterations`, each over all of the step's tokens); with
    an exit criterion, the decoded tokens and the iterations each ran before it exited (`token_iterations`), and
    the host's looks at the exit flags. A compiled forward runs no Python and counts none of these; what it counts
    is `compiled_fills`: the core caches' slots it filled without attending, in the iterations it skipped because
    every token of its step had exited (one per core layer and skipped iteration, below the k slots of a shared
    cache: the later slots hold the tokens' keys and values already)."""

    steps: int = 0
    step_iterations: int = 0
    decoded_tokens: int = 0
    token_iterations: int = 0
    looks: int = 0
    compiled_fills: int = 0

    def count(self, iterations: int, token_steps: Tensor | None = None) -> None:
        self.steps += 1
        self.step_iterations += iterations
        if token_steps is not None:
            self.decoded_tokens += token_steps.numel()
            self.token_iterations += int(token_steps.sum())


def decoding_tokens(positions: Tensor, layer_name: str) -> Tensor | None:
    """[T] bool: the tokens vLLM decodes in this step (a request's only new token after earlier ones), which an
    exit criterion reads; prompt tokens run every iteration. None where the step has no attention metadata
    (vLLM's profiling and warm-up runs, whose outputs and caches nobody reads). Metadata that does not say where
    each request's new tokens start and how long it is (`query_start_loc`, `seq_lens`) is refused by name:
    without them every token would silently run to r."""
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    if isinstance(metadata, list):
        metadata = metadata[0]
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    starts = getattr(metadata, "query_start_loc", None)
    lengths = getattr(metadata, "seq_lens", None)
    if starts is None or lengths is None:
        raise RecurrenceOptionError(
            f"rdlm_exit_criterion tells decoded tokens from prompt tokens by the attention metadata's "
            f"query_start_loc and seq_lens, and this attention backend's {type(metadata).__name__} lacks them: "
            "serve without an exit criterion, or with an attention backend that has them (vLLM's CPU, "
            "FlashAttention and Triton backends do)"
        )
    starts = starts.to(positions.device)
    queries = starts[1:] - starts[:-1]
    one = (queries == 1) & (lengths.to(positions.device)[: queries.shape[0]] > 1)
    decoding = torch.zeros(positions.shape[0], dtype=torch.bool, device=positions.device)
    decoding[starts[:-1][one]] = True
    return decoding


# rdlm's operators for a compiled forward, registered as vLLM registers its own (`direct_register_custom_op`):
# straight into the dispatcher, which costs a few microseconds a call where `torch.library.custom_op`'s wrapper
# cost about 15 more on the CPU, once per core layer and iteration for the attention below.
_LIBRARY = Library("rdlm", "FRAGMENT")  # (must live as long as the operators)


def _operator(name: str, function: Callable[..., Any], fake: Callable[..., Any]) -> None:
    direct_register_custom_op(name, function, fake_impl=fake, target_lib=_LIBRARY)


def decoding_tokens_op(positions: Tensor, layer_name: str) -> Tensor:
    """`decoding_tokens` as an operator a compiled forward calls at run time (`rdlm::vllm_decoding_tokens`: what
    it reads is the step's forward context, which a graph traced once must not bake in); False everywhere
    without metadata."""
    decoding = decoding_tokens(positions, layer_name)
    return torch.zeros_like(positions, dtype=torch.bool) if decoding is None else decoding


def _decoding_tokens_fake(positions: Tensor, layer_name: str) -> Tensor:
    return torch.empty_like(positions, dtype=torch.bool)


_operator("vllm_decoding_tokens", decoding_tokens_op, _decoding_tokens_fake)


# Per core layer, the fused q/k/v projections a token wrote at its last iterations (the last k of a shared cache of
# k < r slots, else the last one): what an exited token holds. Immutable, so that a block of iterations under
# torch.cond is a function of its operands.
Ring = tuple[tuple[Tensor, ...], ...]


def attention_op(q: Tensor, k: Tensor, v: Tensor, layer_name: str) -> Tensor:
    """A vLLM `Attention` layer's forward (this step's keys and values written into its cache, attention over
    it) as an operator that takes the layer by its name as a string (`rdlm::vllm_attention`): what a branch of
    torch.cond can call. vLLM's own attention operators take the name as an opaque object, which torch.cond does
    not pass into its branches."""
    return get_forward_context().no_compile_layers[layer_name](q.contiguous(), k.contiguous(), v.contiguous())


def _attention_fake(q: Tensor, k: Tensor, v: Tensor, layer_name: str) -> Tensor:
    return q.new_empty(q.shape)


def write_cache_op(k: Tensor, v: Tensor, layer_name: str) -> None:
    """`write_cache` (keys and values into a layer's cache, no attention) as an operator
    (`rdlm::vllm_write_cache`), for the same reason; counted in the model's `ExitStats.compiled_fills` (the
    model gives each of its Attentions its stats)."""
    attention = get_forward_context().no_compile_layers[layer_name]
    write_cache(attention, k, v)
    stats = getattr(attention, "rdlm_stats", None)
    if stats is not None:
        stats.compiled_fills += 1


def _write_cache_fake(k: Tensor, v: Tensor, layer_name: str) -> None:
    return None


def fixed_layout(x: Tensor) -> Tensor:
    """A contiguous copy of x whose layout the compiler cannot change (`rdlm::vllm_fixed_layout`). Inductor
    (torch 2.13) lowers torch.cond's operands without holding them to the strides its branches were compiled
    for: an operand it lays out as a view into a wider buffer (as it does with a tensor it also concatenates)
    would be read with the wrong strides in the branch, silently. The operands of a forward's first torch.cond
    and the tensors its branches read from the forward go through this; later ones are torch.cond's own
    outputs, whose strides it fixes."""
    return x.clone(memory_format=torch.contiguous_format)


def _fixed_layout_fake(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_operator("vllm_attention", attention_op, _attention_fake)
_operator("vllm_write_cache", write_cache_op, _write_cache_fake)
_operator("vllm_fixed_layout", fixed_layout, _fixed_layout_fake)


# Iterations between two looks of a compiled forward, unless rdlm_exit_sync_every says otherwise: each look is a
# torch.cond (a host read of its condition and a boundary the compiler does not fuse across), so looking every
# iteration cost more than the iterations it skipped once a step held tens of tokens (docs/vllm.md, "Measured").
COMPILED_SYNC_EVERY = 8

# Both write into a KV cache the graph does not see: never dropped for an unused output, never merged.
torch.fx.node.has_side_effect(torch.ops.rdlm.vllm_attention.default)
torch.fx.node.has_side_effect(torch.ops.rdlm.vllm_write_cache.default)


class ExitLoop:
    """One forward's core iterations with an exit criterion (the module doc says what it keeps exact). With
    `looks` False (a forward vLLM compiles) the host never looks: each stretch of iterations between two looks
    is one `torch.cond`, which fills the slots and skips the stretch when every token of the step has exited,
    else runs it with exited tokens held; the same tokens, with no Python between the graph's kernels."""

    def __init__(self, model: Any, positions: Tensor, decoding: Tensor, looks: bool) -> None:
        # `model`: the served RecurrentDepthForCausalLM (rdlm.integrations.vllm.model, which imports this module)
        self.model, self.positions, self.decoding, self.looks = model, positions, decoding, looks
        recurrence = model.recurrence
        self.r, self.slots = recurrence.num_steps, recurrence.core_caches
        self.ring = self.slots if self.slots < self.r else 1  # how many projections a Ring keeps per layer
        self.core = cast("list[LayerWeights]", list(model.core))
        # The held projections are kept for the decoded tokens only (a prompt's tokens never exit); without
        # looks (no host reads), for every token.
        self.rows = None if not looks or bool(decoding.all()) else decoding.nonzero().squeeze(-1)
        self.sync_every = (
            resolve_sync_every(recurrence.sync_every, positions.device)
            if looks or recurrence.sync_every is not None
            else COMPILED_SYNC_EVERY
        )
        self.tp = get_tensor_model_parallel_world_size()
        criterion = recurrence.criterion
        assert criterion is not None  # (the model comes here only with one)
        self.criterion, self.min_steps = criterion, recurrence.min_steps
        self.gate: Callable[[Tensor], Tensor] | None = None
        if criterion.uses_gate:
            exit_gate = model.exit_gate
            assert exit_gate is not None  # a criterion that reads a gate needs the model's (options.read)
            self.gate = lambda s: torch.sigmoid(exit_gate(s)[0].squeeze(-1).float())
        # The first iteration after which a token can have exited: a gate reads from the first, any other
        # criterion compares two iterations and holds min_steps.
        self.first_exit = self.min_steps - 1 if criterion.uses_gate else max(1, self.min_steps - 1)

    def run(self, state: Tensor, embedded: Tensor) -> Tensor:
        track = ExitTrack.start(state.shape[0], state.device, gate=self.criterion.uses_gate)
        if self.criterion.uses_gate:
            track = dataclasses.replace(track, exit_state=state)
        held: Tensor | None = None  # [T, 1] bool: decoded tokens that exited; None: none has (known at a look)
        ring: Ring = tuple(() for _ in self.core)
        # The looks: from the first iteration after which a token can have exited, every sync_every iterations.
        looks = range(self.first_exit + 1, self.r, self.sync_every)
        run = self.r
        if not self.looks and looks:  # (the module doc of fixed_layout says why)
            embedded = torch.ops.rdlm.vllm_fixed_layout(embedded)
        for start, end in zip([0, *looks], [*looks, self.r], strict=True):
            if start in looks:
                exited = self.exited(track)
                if not self.looks:
                    state, track, held, ring = self.stretch_unless_all_exited(
                        start, end, embedded, exited, state, track, held, ring
                    )
                    continue
                seen = self.look(exited)
                if seen == "all":
                    self.fill(start, ring)
                    run = start
                    break
                held = None if seen == "none" else exited.unsqueeze(-1)
            state, track, held, ring = self.stretch(start, end, embedded, state, track, held, ring)
        assert track.iterations is not None  # ExitTrack.start counts the iterations
        if self.looks:  # (a compiled forward runs no Python: nothing counts)
            self.model.stats.count(run, track.iterations[self.decoding])
        if self.criterion.uses_gate:
            assert track.exit_state is not None  # set above, kept by every update
            return track.exit_state
        return state

    def exited(self, track: ExitTrack) -> Tensor:
        """[T] bool: the decoded tokens done iterating (rdlm's one rule)."""
        return done_iterating(track.exited, track.iterations, self.r) & self.decoding

    def stretch(
        self, start: int, end: int, embedded: Tensor, state: Tensor, track: ExitTrack, held: Tensor | None, ring: Ring
    ) -> tuple[Tensor, ExitTrack, Tensor | None, Ring]:
        """Iterations start .. end-1 for every token, the exited ones held: from the first after which a token
        can have exited, every exit holds until the next look."""
        for i in range(start, end):
            prev = state
            state, ring = self.iteration(state, embedded, i, held, ring)
            track = track.after_iteration(
                self.criterion, i, self.r, prev, state, min_steps=self.min_steps, gate=self.gate
            )
            if i >= self.first_exit:
                held = self.exited(track).unsqueeze(-1)
        return state, track, held, ring

    def stretch_unless_all_exited(
        self,
        start: int,
        end: int,
        embedded: Tensor,
        exited: Tensor,
        state: Tensor,
        track: ExitTrack,
        held: Tensor | None,
        ring: Ring,
    ) -> tuple[Tensor, ExitTrack, Tensor | None, Ring]:
        """A compiled forward's look: one torch.cond on whether every token of the step has exited, which then
        writes each slot of the stretch its held keys and values (rdlm's fill rule, no attention, no MLP) and
        leaves the state, else runs the stretch. Tensor-parallel ranks agree through one all-reduce, as at the
        eager loop's looks."""
        assert held is not None  # (a look comes after the first iteration a token can exit at, which sets it)
        every_token = self.exited_count(exited) == self.tp * exited.shape[0]
        names = [f.name for f in dataclasses.fields(track) if getattr(track, f.name) is not None]
        lengths = [len(kept) for kept in ring]
        grown = [min(n + end - start, self.ring) for n in lengths]

        def flat(state: Tensor, track: ExitTrack, held: Tensor, ring: Ring) -> list[Tensor]:
            return [state, held, *(getattr(track, name) for name in names), *(t for kept in ring for t in kept)]

        def unflat(values: Sequence[Tensor], lengths: Sequence[int]) -> tuple[Tensor, ExitTrack, Tensor, Ring]:
            state, held, *rest = values
            fields = dict(zip(names, rest[: len(names)], strict=True))
            kept, ring = rest[len(names) :], []
            for n in lengths:
                ring.append(tuple(kept[:n]))
                kept = kept[n:]
            return state, dataclasses.replace(track, **fields), held, tuple(ring)

        def fresh(values: list[Tensor], operands: tuple[Tensor, ...]) -> list[Tensor]:
            # a branch of torch.cond may not return one of its operands
            return [t.clone() if any(t is o for o in operands) else t for t in values]

        def skip(*operands: Tensor) -> list[Tensor]:
            state, track, held, ring = unflat(operands, lengths)
            for i in range(start, end):
                ring = self.fill_iteration(i, ring)
            return fresh(flat(state, track, held, ring), operands)

        def go(*operands: Tensor) -> list[Tensor]:
            state, track, held, ring = unflat(operands, lengths)
            state, track, after, ring = self.stretch(start, end, embedded, state, track, held, ring)
            assert after is not None
            return fresh(flat(state, track, after, ring), operands)

        operands = flat(state, track, held, ring)
        if start == self.first_exit + 1:  # the first look's operands come from the forward (fixed_layout says why)
            operands = [torch.ops.rdlm.vllm_fixed_layout(t) for t in operands]
        out = torch.cond(every_token, skip, go, tuple(operands))
        return unflat(out, grown)

    def exited_count(self, exited: Tensor) -> Tensor:
        """The exited tokens of the step on every tensor-parallel rank, summed by one all-reduce, so that every
        rank takes the same answer at a look. (A float32 count: vLLM's shared-memory all-reduce on the CPU sums
        no integer tensors; exact below 2**24.)"""
        count = exited.sum(dtype=torch.float32)
        return tensor_model_parallel_all_reduce(count) if self.tp > 1 else count

    def look(self, exited: Tensor) -> str:
        """The host's look at the exit flags: "all" tokens of the step have exited (the loop stops), "none"
        has (the next iteration holds nothing) or "some". Tensor-parallel ranks take the same answer: "all"
        and "none" only where every rank's flags say so (their counts are summed by one all-reduce)."""
        total = round(float(self.exited_count(exited)))
        self.model.stats.looks += 1
        if total == self.tp * exited.shape[0]:
            return "all"
        return "none" if total == 0 else "some"

    def iteration(
        self, state: Tensor, embedded: Tensor, i: int, held: Tensor | None, ring: Ring
    ) -> tuple[Tensor, Ring]:
        """s_{i+1} = R(e, s_i) for every token, the `held` ones writing the keys and values they hold (and
        keeping their state)."""
        model = self.model
        x = model.core_input(state, embedded)
        for layer, weights in enumerate(self.core):
            fused = weights.project(x)
            if held is not None:
                fused = self.hold(fused, self.held_projection(ring, layer, i), held)
            ring = self.remember(ring, layer, i, fused)
            x = weights.attend(x, *weights.heads_of(self.positions, fused), self.cache(layer, i))
        new = model.final_norm(x) if model.config.final_norm == "loop" else x
        return (new if held is None else torch.where(held, state, new)), ring

    def cache(self, layer: int, i: int) -> Attention | Callable[[Tensor, Tensor, Tensor], Tensor]:
        """What core layer `layer` attends with at iteration i: its Attention, or, in a compiled forward (whose
        stretches are branches of torch.cond), the operator that calls it by name."""
        attention = self.model.core_cache(layer, i)
        if self.looks:
            return attention
        return functools.partial(torch.ops.rdlm.vllm_attention, layer_name=attention.layer_name)

    def hold(self, fused: Tensor, kept: Tensor, held: Tensor) -> Tensor:
        if self.rows is None:
            return torch.where(held, kept, fused)
        ours = torch.where(held.index_select(0, self.rows), kept, fused.index_select(0, self.rows))
        return fused.index_copy(0, self.rows, ours)

    def remember(self, ring: Ring, layer: int, i: int, fused: Tensor) -> Ring:
        kept = fused if self.rows is None else fused.index_select(0, self.rows)
        mine = ring[layer]
        mine = (
            (*mine, kept)
            if len(mine) < self.ring
            else tuple(kept if j == i % self.ring else t for j, t in enumerate(mine))
        )
        return tuple(mine if j == layer else other for j, other in enumerate(ring))

    def held_projection(self, ring: Ring, layer: int, i: int) -> Tensor:
        """What an exited token writes at iteration i (the module doc)."""
        behind = i - self.slots if i >= self.slots else i - 1
        return ring[layer][behind % self.ring]

    def fill_iteration(self, i: int, ring: Ring) -> Ring:
        """Iteration i when every token has exited: each slot not yet written gets the token's held keys and
        values (rdlm's fill_missing), and the ring goes on as a held iteration's would."""
        for layer, weights in enumerate(self.core):
            kept = self.held_projection(ring, layer, i)
            if i < self.slots:  # a later slot of a shared cache holds them already
                _, k, v = weights.heads_of(self.positions, kept)
                torch.ops.rdlm.vllm_write_cache(k, v, self.model.core_cache(layer, i).layer_name)
            ring = self.remember(ring, layer, i, kept)
        return ring

    def fill(self, first: int, ring: Ring) -> None:
        """Every token exited before iteration `first`: the slots not yet written (first .. k-1; for
        per-iteration caches first .. r-1) get each token's last keys and values (rdlm's fill_missing); the
        later slots of a shared cache hold them already."""
        model = self.model
        for layer, weights in enumerate(self.core):
            if first >= self.slots:
                break
            _, k, v = weights.heads_of(self.positions, self.held_projection(ring, layer, first))
            for i in range(first, self.slots):
                write_cache(model.core_cache(layer, i), k, v)
