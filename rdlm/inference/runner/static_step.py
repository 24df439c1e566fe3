"""The continuous batch's rows on the device (`RowTensors`) and their static step (`StaticStep`): n core
iterations of the decoding rows as one fixed-shape call over every row of the batch, whose per-row buffer
index, core slot and writers are device tensors, so the call is the same at every step and CUDA captures it
once per n (rdlm.inference.execution.graphs). The step runner (rdlm.inference.runner.step_runner) takes this path
where the engine's `static` setting is on (by default on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rdlm.inference.execution.cpu_compile import compiled_iteration, cpu_compiled
from rdlm.inference.execution.graphs import StaticSteps
from rdlm.inference.execution.model_calls import ModelCalls
from rdlm.inference.exits.track import done_iterating
from rdlm.inference.runner.row_exits import RowExits


@dataclass
class RowTensors:
    """Each row's token in progress, on the device: its latent state and prelude output [b, 1, h], its
    iterations run, cap and min_steps, whether it stopped iterating (exited or at its cap: frozen until the
    host looks), the tokens its request has seen [b, V] (the repetition penalty), its buffer index and core
    cache budget."""

    state: Tensor
    embedded: Tensor
    iterations: Tensor
    cap: Tensor
    min_steps: Tensor
    stopped: Tensor
    seen: Tensor
    write_index: Tensor
    budget: Tensor

    @classmethod
    def zeros(cls, calls: ModelCalls, max_batch: int) -> RowTensors:
        c, device = calls.model.config, calls.device
        state = torch.zeros(max_batch, 1, c.hidden_size, dtype=calls.dtype, device=device)

        def longs() -> Tensor:
            return torch.zeros(max_batch, dtype=torch.long, device=device)

        return cls(
            state,
            torch.zeros_like(state),
            longs(),
            longs(),
            longs(),
            torch.zeros(max_batch, dtype=torch.bool, device=device),
            torch.zeros(max_batch, c.vocab_size, dtype=torch.bool, device=device),
            longs(),
            longs() + 1,
        )


class StaticStep:
    """The decoding rows' static step over `rows` (see the module doc); `on`: the engine takes it. Holds its
    graph cache (`steps`) and which rows decode in it (`decoding`, a device mask read in place)."""

    def __init__(self, calls: ModelCalls, rows: RowTensors, exits: RowExits, max_batch: int, on: bool) -> None:
        self.calls, self.rows, self.exits, self.max_batch = calls, rows, exits, max_batch
        self.steps = StaticSteps(calls.device, on, shared_pool=True)
        self.decoding = torch.zeros_like(rows.stopped)
        self._decoding_rows: tuple[int, ...] = ()  # the rows `decoding` marks
        self.fused_iterations = 0  # core iterations run several to a call
        # compiled on the CPU (rdlm.inference.execution.cpu_compile); captured on CUDA
        self.compiled = compiled_iteration(self, calls.model) if cpu_compiled(on, calls.device, calls.model) else None

    @property
    def on(self) -> bool:
        return self.steps.static

    def mark_decoding(self, rows: list[int]) -> None:
        """`decoding`: these rows of the batch (copied to the device when they changed)."""
        decoding = tuple(rows)
        if decoding != self._decoding_rows:
            self._decoding_rows = decoding
            self.decoding.copy_(self.calls.upload([b in decoding for b in range(self.max_batch)]))

    def run(self, rows: list[int], n: int) -> None:
        """n core iterations of the decoding `rows` as one fixed-shape call over all `max_batch` rows (CUDA
        captures it once per n). A row that is not decoding (free, prefilling its prompt or waiting for its
        coda) or has stopped keeps its state and writes nothing; each iteration updates the rows' counts and
        stopped flags on the device (`done_iterating`)."""
        self.mark_decoding(rows)
        if self.compiled is not None:
            self.compiled.refresh()
        self.steps.run(("core iterations", n), lambda: self.iterations(n), idempotent=False)
        if n > 1:
            self.fused_iterations += n

    def warm_up(self) -> float:
        """Compile the CPU's compiled iteration now (a call with no row decoding changes nothing: every row
        keeps its state and its cache entries); the seconds it took."""
        if self.compiled is None:
            return 0.0
        self.mark_decoding([])
        before = self.compiled.seconds
        self.compiled()
        return self.compiled.seconds - before

    def iteration(self) -> tuple[Tensor, Tensor]:
        """The static body of one iteration: (every row's new state, the rows that iterated: decoding, not
        stopped)."""
        t = self.rows
        writers = self.decoding & ~t.stopped
        call = self.calls.every_row(t.write_index, t.iterations % t.budget, writers)
        out = self.calls.iterate_once(t.state, t.embedded, 0, call)
        return torch.where(writers.view(-1, 1, 1), out, t.state), writers

    def iterations(self, n: int) -> tuple:
        t = self.rows
        iteration = self.iteration if self.compiled is None else self.compiled
        for _ in range(n):
            state, writers = iteration()
            t.state.copy_(state)
            t.iterations += writers.long()
            t.stopped |= self.decoding & done_iterating(self.exits.exited, t.iterations, t.cap, self.exits.runs_on)
        return ()
