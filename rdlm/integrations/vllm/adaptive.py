"""Per-token exits inside vLLM's forward (paper section 6.1): which tokens of a step are decoded, and the r core
iterations with an exit criterion read after each, as `rdlm generate` reads it (rdlm's one exit update,
`ExitTrack.after_iteration`).

- A decoded token that exits keeps its state, and at each later iteration writes into that iteration's cache
  the keys and values it holds there: the ones of its last computed iteration for a slot it has not written
  yet (rdlm's `fill_missing`), else the ones already in the slot (a shared cache of k slots, from iteration k
  on). It holds them by holding its fused q/k/v projection: the rest of a layer's projection is a function of
  that and the token's position.
- The host looks at the exit flags every `sync_every` iterations, never before a token can have exited: when
  every token of the step has exited, the loop stops there and the remaining slots are filled with a cache
  write (no attention, no MLP); when none has, the next iteration holds nothing. Between looks nothing waits
  for the device. With tensor parallelism the ranks agree on each look's answer with one all-reduce, so no
  rank leaves the loop (and its collectives) alone. A forward vLLM compiles has no looks: every iteration
  runs, exited tokens held (the same tokens; a fixed-shape computation a graph can hold), and the decoded
  tokens are read at run time by the `rdlm::vllm_decoding_tokens` operator.
- Prompt tokens run every iteration (with a learned gate the coda reads each one's state at the iteration
  where its gate fired, rdlm's gated prefill).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.forward_context import get_forward_context

from rdlm.inference.execution.graphs import resolve_sync_every
from rdlm.inference.exits.track import ExitTrack, done_iterating
from rdlm.integrations.vllm.layers import LayerWeights, write_cache
from rdlm.integrations.vllm.options import RecurrenceOptionError


@dataclasses.dataclass
class ExitStats:
    """What the forward ran since the model was loaded (read with `vllm.LLM.apply_model`; counted by the eager
    forward only: a compiled one runs no Python): `steps` forwards and the core iterations they ran
    (`step_iterations`, each over all of the step's tokens); with an exit criterion, the decoded tokens and the
    iterations each ran before it exited (`token_iterations`), and the host's looks at the exit flags."""

    steps: int = 0
    step_iterations: int = 0
    decoded_tokens: int = 0
    token_iterations: int = 0
    looks: int = 0

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


@torch.library.custom_op("rdlm::vllm_decoding_tokens", mutates_args=())
def decoding_tokens_op(positions: Tensor, layer_name: str) -> Tensor:
    """`decoding_tokens` as an operator a compiled forward calls at run time (what it reads is the step's
    forward context, which a graph traced once must not bake in); False everywhere without metadata."""
    decoding = decoding_tokens(positions, layer_name)
    return torch.zeros_like(positions, dtype=torch.bool) if decoding is None else decoding


@decoding_tokens_op.register_fake
def _(positions: Tensor, layer_name: str) -> Tensor:
    return torch.empty_like(positions, dtype=torch.bool)


class ExitLoop:
    """One forward's core iterations with an exit criterion (the module doc says what it keeps exact). With
    `looks` False (a forward vLLM compiles) the host never looks: every iteration runs, exited tokens held, a
    fixed-shape computation a graph can hold, whose tokens are the same."""

    def __init__(self, model: Any, positions: Tensor, decoding: Tensor, looks: bool) -> None:
        # `model`: the served RecurrentDepthForCausalLM (rdlm.integrations.vllm.model, which imports this module)
        self.model, self.positions, self.decoding, self.looks = model, positions, decoding, looks
        recurrence = model.recurrence
        self.r, self.slots = recurrence.num_steps, recurrence.core_caches
        # An exited token's held projection at iteration i: the one it wrote at i - k once its k slots have all
        # been written (a shared cache of k < r slots), else the one it wrote last. A ring of the last k.
        self.ring = self.slots if self.slots < self.r else 1
        self.core = cast("list[LayerWeights]", list(model.core))
        self.written: list[list[Tensor]] = [[] for _ in self.core]
        # The held projections are kept for the decoded tokens only (a prompt's tokens never exit); without
        # looks (no host reads), for every token.
        self.rows = None if not looks or bool(decoding.all()) else decoding.nonzero().squeeze(-1)
        self.sync_every = resolve_sync_every(recurrence.sync_every, positions.device)
        self.tp = get_tensor_model_parallel_world_size()

    def run(self, state: Tensor, embedded: Tensor) -> Tensor:
        model, recurrence = self.model, self.model.recurrence
        criterion, min_steps = recurrence.criterion, recurrence.min_steps
        assert criterion is not None  # (the model comes here only with one)
        gate: Callable[[Tensor], Tensor] | None = None
        track = ExitTrack.start(state.shape[0], state.device, gate=criterion.uses_gate)
        if criterion.uses_gate:
            track = dataclasses.replace(track, exit_state=state)
            exit_gate = model.exit_gate
            assert exit_gate is not None  # a criterion that reads a gate needs the model's (options.read)
            gate = lambda s: torch.sigmoid(exit_gate(s)[0].squeeze(-1).float())  # noqa: E731
        # The first iteration after which a token can have exited: a gate reads from the first, any other
        # criterion compares two iterations and holds min_steps.
        first_exit = min_steps - 1 if criterion.uses_gate else max(1, min_steps - 1)
        held: Tensor | None = None  # [T, 1] bool: decoded tokens that exited; None: none has (known at a look)
        run = self.r
        for i in range(self.r):
            if self.looks and i > first_exit and (i - first_exit - 1) % self.sync_every == 0:  # a look
                exited = done_iterating(track.exited, track.iterations, self.r) & self.decoding  # rdlm's one rule
                seen = self.look(exited)
                if seen == "all":
                    self.fill(i)
                    run = i
                    break
                held = None if seen == "none" else exited.unsqueeze(-1)
            prev, state = state, self.iteration(state, embedded, i, held)
            track = track.after_iteration(criterion, i, self.r, prev, state, min_steps=min_steps, gate=gate)
            if i >= first_exit:  # from here a token may have exited: until the next look, every exit holds
                held = (done_iterating(track.exited, track.iterations, self.r) & self.decoding).unsqueeze(-1)
        assert track.iterations is not None  # ExitTrack.start counts the iterations
        if self.looks:  # (a compiled forward runs no Python: nothing counts)
            model.stats.count(run, track.iterations[self.decoding])
        if criterion.uses_gate:
            assert track.exit_state is not None  # set above, kept by every update
            return track.exit_state
        return state

    def look(self, exited: Tensor) -> str:
        """The host's look at the exit flags: "all" tokens of the step have exited (the loop stops), "none"
        has (the next iteration holds nothing) or "some". Tensor-parallel ranks take the same answer: "all"
        and "none" only where every rank's flags say so (their counts are summed by one all-reduce)."""
        # (a float32 count: vLLM's shared-memory all-reduce on the CPU sums no integer tensors; exact below 2**24)
        count = exited.sum(dtype=torch.float32)
        if self.tp > 1:
            count = tensor_model_parallel_all_reduce(count)
        total = round(float(count))
        self.model.stats.looks += 1
        if total == self.tp * exited.shape[0]:
            return "all"
        return "none" if total == 0 else "some"

    def iteration(self, state: Tensor, embedded: Tensor, i: int, held: Tensor | None) -> Tensor:
        """s_{i+1} = R(e, s_i) for every token, the `held` ones writing the keys and values they hold (and
        keeping their state)."""
        model = self.model
        x = model.core_input(state, embedded)
        for layer, weights in enumerate(self.core):
            fused = weights.project(x)
            if held is not None:
                fused = self.hold(fused, self.held_projection(layer, i), held)
            self.remember(layer, i, fused)
            x = weights.attend(x, *weights.heads_of(self.positions, fused), model.core_cache(layer, i))
        new = model.final_norm(x) if model.config.final_norm == "loop" else x
        return new if held is None else torch.where(held, state, new)

    def hold(self, fused: Tensor, kept: Tensor, held: Tensor) -> Tensor:
        if self.rows is None:
            return torch.where(held, kept, fused)
        ours = torch.where(held.index_select(0, self.rows), kept, fused.index_select(0, self.rows))
        return fused.index_copy(0, self.rows, ours)

    def remember(self, layer: int, i: int, fused: Tensor) -> None:
        kept = fused if self.rows is None else fused.index_select(0, self.rows)
        ring = self.written[layer]
        if len(ring) < self.ring:
            ring.append(kept)
        else:
            ring[i % self.ring] = kept

    def held_projection(self, layer: int, i: int) -> Tensor:
        """What an exited token writes at iteration i (the module doc)."""
        behind = i - self.slots if i >= self.slots else i - 1
        return self.written[layer][behind % self.ring]

    def fill(self, first: int) -> None:
        """Every token exited before iteration `first`: the slots not yet written (first .. k-1; for
        per-iteration caches first .. r-1) get each token's last keys and values (rdlm's fill_missing); the
        later slots of a shared cache hold them already."""
        model = self.model
        for layer, weights in enumerate(self.core):
            if first >= self.slots:
                break
            _, k, v = weights.heads_of(self.positions, self.held_projection(layer, first))
            for i in range(first, self.slots):
                write_cache(model.core_cache(layer, i), k, v)
