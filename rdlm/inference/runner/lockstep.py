"""A token that every decoding row starts together, with one `GenerationConfig`: the continuous batch's
lockstep plan (rdlm.inference.scheduling.plan.StepPlan), the usual one for the offline batch of `generate`
(rdlm.inference.batching), where every row's prompt is prefilled at once and each token starts and ends on
every row at the same step. The batch's step runner (rdlm.inference.runner.step_runner) runs it here.

Such a token runs all its core iterations in one engine step instead of one per step, with no host
bookkeeping between them:

- fixed r: the r iterations in one call of the runner (on CUDA a static step: one CUDA graph);
- adaptive r (paper section 6.1): the exit criterion is evaluated on the device after each iteration
  (or every `exit_every`); a row that exited keeps its state and stops writing core cache entries. The
  host reads the exit flags every `exit_sync_every` iterations (by default every iteration on the CPU,
  where a look waits for nothing, and every 4 on a GPU, where it drains the queued work); the rows that
  exited then leave the calls (the core's matmuls run on the rows still iterating only), so a batch's
  tokens/s rises with the iterations its exits save. While no row has exited, chunks of
  `exit_sync_every` iterations run as static steps over the whole batch (CUDA graphs on CUDA). When to
  look changes no result, only the cost.

The prelude before and the coda after are the step runner's own (`StepRunner._start`, `_coda`), so a row
gives the same tokens whether its token ran in lockstep or one iteration per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rdlm.inference.execution.graphs import StaticSteps
from rdlm.inference.execution.model_calls import Call, ModelCalls
from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.exits.track import ExitTrack, iterate_with_exits
from rdlm.inference.params import GenerationConfig

TRACK_FIELDS = tuple(f.name for f in dataclasses.fields(ExitTrack))  # (a compiled step cannot ask the class)


@dataclass
class Rows:
    """The rows of one token still iterating (all rows, or those left after exits)."""

    index: Tensor  # [b] their places among the rows the token started with
    batch_rows: Tensor  # [b] their rows of the batch (and of the cache)
    state: Tensor  # [b, 1, h]
    embedded: Tensor  # [b, 1, h]
    call: Call  # these rows' RoPE, mask and cache rows
    track: ExitTrack  # where each row's token stands: iterations run, exited, the criterion's carry

    @classmethod
    def start(
        cls,
        batch_rows: Tensor,
        state: Tensor,
        embedded: Tensor,
        call: Call,
        idle: Tensor,
        criterion: ExitCriterion,
        vocab_size: int,
    ) -> Rows:
        """No iteration run yet; the `idle` rows (not decoding) count as exited from the start."""
        n, device = batch_rows.shape[0], batch_rows.device
        track = ExitTrack.start(n, device, vocab_size if criterion.uses_logits else None, gate=criterion.uses_gate)
        return cls(
            torch.arange(n, device=device),
            batch_rows,
            state.clone(),
            embedded,
            call,
            dataclasses.replace(track, exited=idle.clone()),
        )

    @property
    def iterations(self) -> Tensor:
        return self.track.iterations

    @property
    def exited(self) -> Tensor:
        return self.track.exited

    def select(self, keep: Tensor) -> Rows:
        batch_rows = self.batch_rows[keep]
        track = self.track.select(keep)
        return Rows(
            self.index[keep],
            batch_rows,
            self.state[keep],
            self.embedded[keep],
            self.call.select(keep, batch_rows),
            track,
        )


class Lockstep:
    """Runs the core iterations of lockstep tokens over a runner (see the module doc): as static steps when
    `static` (CUDA graphs on CUDA, kept in `static_steps`), else eagerly. The host looks at the exit flags
    every `sync_every` iterations (the engine's `exit_sync_every`, the same setting as the batch's looks)."""

    def __init__(self, calls: ModelCalls, static: bool, sync_every: int) -> None:
        self.calls, self.sync_every = calls, sync_every
        self.static_steps = StaticSteps(calls.device, static)

    def _run(self, key: tuple, body: Callable[[], tuple], idempotent: bool = True) -> tuple:
        return self.static_steps.run(key, body, idempotent) if self.static_steps.static else body()

    def fixed(self, config: GenerationConfig, state: Tensor, embedded: Tensor, call: Callable[[], Call]) -> Tensor:
        """All num_steps iterations of every row of `state` [b, 1, h] (`call()`: their call, built inside the
        static step): the final states."""
        r = config.num_steps
        return self._run(
            ("lockstep", r, config.core_slots), lambda: (self.calls.iterate(state, embedded, call(), range(r)),)
        )[0]

    def adaptive(
        self, config: GenerationConfig, criterion: ExitCriterion, start: Callable[[], Rows], idle: int
    ) -> tuple[Tensor, Tensor]:
        """Each row iterating until its exit criterion fires (between min_steps and num_steps). `start()`
        gives the token's `Rows` (a static step: its tensors are the graph's own), `idle` of them not
        decoding (exited from the start). Returns (final states [b, 1, h], iterations run [b]) of those
        rows, in their order.

        While no decoding row has exited, chunks of `exit_sync_every` iterations run as static steps over the
        rows, exited rows frozen on the device; at the end of a chunk the host looks at the exit flags, and
        once some rows have exited the others go on alone."""
        r = config.num_steps
        key = ("lockstep", r, config.core_slots, config.min_steps, config.exit_every, criterion)
        rows = self._run(key + ("start",), lambda: (start(),))[0]
        if criterion.spec.exact:  # every row runs every iteration: one chunk, the exit only selects
            return self.exact(config, criterion, rows)
        final, steps = rows.state.clone(), rows.iterations.clone()
        every = self.sync_every
        i, compact = 0, False
        while i < r:
            n = min(every, r - i)
            if compact:
                rows = self.iterate(config, criterion, rows, i, n, idle)
            else:
                self._run(key + (i, n), self._chunk(config, criterion, rows, i, n, idle), idempotent=False)
            i += n
            if i == r:
                break
            exited = rows.exited
            done = exited.cpu()  # the host looks: rows that exited leave the batch
            if int(done.sum()) > idle:
                final[rows.index[exited]] = rows.state[exited]
                steps[rows.index[exited]] = rows.iterations[exited]
                if bool(done.all()):
                    rows = rows.select(~exited)
                    break
                rows, compact, idle = rows.select(~exited), True, 0
        final[rows.index] = rows.state
        steps[rows.index] = rows.iterations
        return final, steps

    def _chunk(
        self, config: GenerationConfig, criterion: ExitCriterion, rows: Rows, first: int, n: int, idle: int
    ) -> Callable[[], tuple]:
        """The static body of iterations first .. first + n - 1 over `rows`, in place (`iterate`)."""
        return lambda: (self.iterate(config, criterion, rows, first, n, idle, in_place=True),)

    def exact(self, config: GenerationConfig, criterion: ExitCriterion, rows: Rows) -> tuple[Tensor, Tensor]:
        """`gate-exact`: all num_steps iterations for every row (every cache entry written, as the reference
        computes), each row's final state the one at its gate exit. Iterations reported: num_steps."""
        r = config.num_steps
        _, track = iterate_with_exits(
            lambda state, i, exited: self.calls.iterate_once(state, rows.embedded, i, rows.call),
            None,
            rows.state,
            rows.track,
            criterion,
            0,
            r,
            r,
            min_steps=_min_steps(config),
            freeze=False,
            gate=self.calls.exit_probability,
        )
        assert track.exit_state is not None  # (an unfrozen gate loop keeps each token's exit state)
        return track.exit_state.view_as(rows.state), torch.full_like(rows.iterations, r)

    def iterate(
        self,
        config: GenerationConfig,
        criterion: ExitCriterion,
        rows: Rows,
        first: int,
        n: int,
        idle: int,
        in_place: bool = False,
    ) -> Rows:
        """Iterations first .. first + n - 1 for `rows` (`iterate_with_exits`), deciding exits on the
        device. A row that exited keeps its state and stops writing core cache entries (`idle`: how many rows are
        not decoding, exited from the start). `in_place` writes
        the results into `rows`' own tensors (a static step's outputs are its inputs)."""

        def step(state: Tensor, i: int, exited: Tensor) -> Tensor:
            # At the first iteration only idle rows can have exited: every row writes when there are none (on
            # the static path the call's own writers, the decoding rows, say the same).
            call = rows.call.but(core_writers=~exited) if i or idle else rows.call
            return self.calls.iterate_once(state, rows.embedded, i, call)

        def readout(state: Tensor) -> Tensor:
            return self.calls.readout(state, rows.call)[:, -1]

        gate = self.calls.exit_probability if criterion.uses_gate else None
        state, track = iterate_with_exits(
            step,
            readout,
            rows.state,
            rows.track,
            criterion,
            first,
            n,
            config.num_steps,
            min_steps=_min_steps(config),
            every=config.exit_every,
            gate=gate,
        )
        if in_place:
            rows.state.copy_(state)
            for name in TRACK_FIELDS:
                target = getattr(rows.track, name)
                if target is not None:
                    target.copy_(getattr(track, name))
            return rows
        return dataclasses.replace(rows, state=state, track=track)


def _min_steps(config: GenerationConfig) -> int:
    """The config's min_steps (always set once it is built: `GenerationConfig.__post_init__`)."""
    assert config.min_steps is not None
    return config.min_steps
