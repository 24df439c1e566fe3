"""Where each token of an adaptive loop stands, and the one decision after an iteration (paper section 6.1;
the criteria themselves are rdlm.inference.exits.criteria).

Where each token stands lives in one place, an `ExitTrack` (iterations run, exited, the streak, the latest
logits, the gate's running sums, gate-exact's chosen state), and `ExitTrack.after_iteration` is its one
update after an iteration, reading the gate (`ExitTrack.read_gate`, the rule `gate_exits`) or the criterion
(`ExitTrack.read_criterion`, at the iterations of `exit_schedule`), min_steps held by both; `done_iterating`
is the one rule of a token done iterating (its criterion fired, or its cap). `iterate_with_exits` is the one
per-token exit loop around them: tokens decoded in lockstep (rdlm.inference.runner.lockstep, for the continuous
batch), gate-exact's teacher-forced logits (rdlm.inference.evaluate) and the exit-step analysis
(rdlm.analysis.exit_steps) run it. The continuous batch's rows, which sit at different iterations, keep an
`ExitTrack` over the rows and update it one iteration at a time (rdlm.inference.runner.row_exits); a prompt being
prefilled keeps one over its tokens for the gate (rdlm.inference.runner.prefill); the parallel sampler reads its
freeze criterion with one over its wave (rdlm.inference.runner.parallel); the vLLM plugin reads exits with one
(rdlm.integrations.vllm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor

from rdlm.inference.exits.criteria import ExitCriterion, gate_exits


def exit_schedule(iteration: int, num_steps: int, every: int) -> tuple[bool, bool]:
    """(evaluate, needs_logits_for_next): whether the exit criterion is read after 0-based iteration
    `iteration` of a token with at most `num_steps`, and whether the next iteration's reading needs
    this iteration's logits too. A reading compares iterations i - 1 and i: never at i = 0 (nothing to
    compare) nor at the last iteration (the token stops there anyway); every `every` iterations."""

    def reads(i: int) -> bool:
        return 0 < i < num_steps - 1 and (i + 1) % every == 0

    return reads(iteration), reads(iteration + 1)


@dataclass
class ExitTrack:
    """Where each token of an adaptive loop stands, over its tokens ([n] flat, e.g. [batch] for one decoded
    token per row or [seq] for a teacher-forced prompt; [g, n] for a prompt chunk's tokens). The one exit
    state of every caller: the per-token loop (`iterate_with_exits`), a prompt being prefilled
    (rdlm.inference.runner.prefill) and the continuous batch's rows (rdlm.inference.runner.row_exits). `after_iteration`
    is the one update; its two readings, `read_gate` and `read_criterion`, also serve the callers that count
    iterations or schedule readings themselves."""

    iterations: Tensor  # [n] iterations run before the token exited (the cap if it never did); unused where the
    # caller counts them (the continuous batch's rows, whose readings take the runner's counts)
    exited: Tensor  # [n] bool: the criterion fired (gate-exact: the exit state is chosen)
    streak: Tensor  # [n] consecutive passing readings
    logits: Tensor | None  # [n, V] the latest readout, kept when the criterion reads logits
    # The learned gate's running sums ([n] float32), when the criterion reads it: the probability of
    # not having exited yet, and the cumulative exit probability.
    remaining: Tensor | None = None
    cumulative: Tensor | None = None
    exit_state: Tensor | None = None  # [n, h] the state at each token's exit (gate-exact, not frozen)

    @classmethod
    def start(
        cls, n: int | tuple[int, ...], device: torch.device, vocab_size: int | None = None, gate: bool = False
    ) -> ExitTrack:
        """No iteration run yet over `n` tokens (a count, or a shape such as [g, n]); `vocab_size` when the
        criterion reads logits, `gate` when it reads a gate."""
        shape = (n,) if isinstance(n, int) else tuple(n)
        zeros = torch.zeros(shape, dtype=torch.long, device=device)
        logits = None if vocab_size is None else torch.zeros(*shape, vocab_size, device=device)
        ones = torch.ones(shape, device=device) if gate else None
        return cls(zeros, zeros.bool(), zeros.clone(), logits, ones, None if ones is None else ones * 0)

    def select(self, index: Tensor) -> ExitTrack:
        """The track of the tokens at `index` (of the first dimension)."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]

        return ExitTrack(
            **cast(dict[str, Any], {f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})
        )

    def count_iteration(self) -> ExitTrack:
        """One more iteration run: every token not exited counts it."""
        return replace(self, iterations=self.iterations + (~self.exited).long())

    def after_iteration(
        self,
        criterion: ExitCriterion,
        i: int,
        num_steps: int,
        prev_state: Tensor,
        state: Tensor,
        *,
        min_steps: int | Tensor,
        every: int = 1,
        readout: Callable[[Tensor], Tensor] | None = None,
        gate: Callable[[Tensor], Tensor] | None = None,
        threshold: float | Tensor | None = None,
        running: Tensor | None = None,
        reads: tuple[bool, bool] | None = None,
        counted: bool = False,
    ) -> ExitTrack:
        """The one update after 0-based iteration i of a loop capped at `num_steps`, whose states went from
        `prev_state` to `state` ([..., h], the track's tokens in order): every token still iterating counts
        it (`count_iteration`; `counted`: the caller counted them); a gate criterion then reads `gate(state)`
        (`read_gate`, against `threshold` when given: one per token or row), any other is read at the
        iterations of `exit_schedule` (`read_criterion`; `reads`: (evaluate, needs logits next) decided by a
        caller whose tokens sit at different iterations), `readout(state)` giving the logits when it reads
        them. A reading holds `min_steps`, and reads only the `running` tokens when given. Whether a token is
        then done iterating is `done_iterating`'s one rule. Returns a new track (this one is not modified)."""
        track = self if counted else self.count_iteration()
        tokens = track.exited.shape
        flat = state.reshape(*tokens, state.shape[-1])
        if criterion.uses_gate:
            assert gate is not None, f"exit criterion {criterion.name!r} reads the model's gate: give `gate`"
            return track.read_gate(
                gate(state).reshape(tokens),
                flat,
                criterion.threshold if threshold is None else threshold,
                min_steps,
                running,
            )
        evaluate, next_evaluates = exit_schedule(i, num_steps, every) if reads is None else reads
        prev_logits = track.logits
        if criterion.uses_logits and (evaluate or next_evaluates):
            assert readout is not None, f"exit criterion {criterion.name!r} reads logits: give `readout`"
            logits = readout(state)
            track = replace(track, logits=logits.reshape(*tokens, logits.shape[-1]))
        if evaluate:
            track = track.read_criterion(
                criterion,
                prev_logits,
                track.logits,
                prev_state.reshape(*tokens, state.shape[-1]),
                flat,
                min_steps,
                running,
            )
        return track

    def read_gate(
        self,
        lam: Tensor,
        state: Tensor,
        threshold: float | Tensor,
        min_steps: int | Tensor,
        running: Tensor | None = None,
    ) -> ExitTrack:
        """The learned gate read after an iteration that gave `lam` and `state` ([..., h]) per token: the gate
        rule (`gate_exits`) for each token not yet exited (and `running`, when given: elsewhere the running
        sums stay). A track with `exit_state` keeps the state of every token not yet exited, so it ends at
        the state of the iteration where the gate fired, or the last one."""
        assert self.remaining is not None and self.cumulative is not None, "a track started with gate=True"
        live = ~self.exited if running is None else running & ~self.exited
        exits, remaining, cumulative = gate_exits(
            lam, self.remaining, self.cumulative, threshold, self.iterations, min_steps, live
        )
        if running is not None:
            remaining = torch.where(running, remaining, self.remaining)
            cumulative = torch.where(running, cumulative, self.cumulative)
        exit_state = self.exit_state
        if exit_state is not None:
            exit_state = torch.where(live.unsqueeze(-1), state, exit_state)
        return replace(
            self, exited=self.exited | exits, remaining=remaining, cumulative=cumulative, exit_state=exit_state
        )

    def read_criterion(
        self,
        criterion: ExitCriterion,
        prev_logits: Tensor | None,
        logits: Tensor | None,
        prev_state: Tensor | None,
        state: Tensor | None,
        min_steps: int | Tensor,
        running: Tensor | None = None,
    ) -> ExitTrack:
        """One reading of `criterion` comparing two iterations: a token exits once it passed `patience`
        readings in a row and has run at least `min_steps` iterations (`running`, when given: only those
        tokens are read, the others keep their streak)."""
        exits, streak = criterion.update(self.streak, prev_logits, logits, prev_state, state)
        exits = exits & (self.iterations >= min_steps)
        if running is not None:
            exits, streak = exits & running, torch.where(running, streak, self.streak)
        return replace(self, exited=self.exited | exits, streak=streak)


def at_cap(iterations, cap):
    """Whether a token that ran `iterations` iterations reached its `cap` (host numbers or tensors alike): the
    cap half of `done_iterating`, and the one place the cap is compared, on the device and on the host (the
    scheduler's looks, fused iterations and codas, a prompt chunk's end, a parallel wave's final positions)."""
    return iterations >= cap


def done_iterating(exited: Tensor, iterations: Tensor, cap: int | Tensor, runs_on: Tensor | None = None) -> Tensor:
    """The one rule of whether a token is done iterating after an iteration: its criterion fired (a reading of
    `ExitTrack.after_iteration`, which holds min_steps), unless the criterion only chooses the state read out
    and the token runs on (`runs_on`: gate-exact), or it ran its `cap` iterations (`at_cap`). The continuous
    batch's rows read it after every iteration, eager and static (rdlm.inference.runner.step_runner,
    static_step); the per-token loop (`iterate_with_exits`: lockstep tokens, teacher-forced exits) freezes the
    tokens it says are done; the vLLM forward reads it over its decoded tokens."""
    fired = exited if runs_on is None else exited & ~runs_on
    return fired | at_cap(iterations, cap)


def iterate_with_exits(
    step: Callable[[Tensor, int, Tensor], Tensor],
    readout: Callable[[Tensor], Tensor] | None,
    state: Tensor,
    track: ExitTrack,
    criterion: ExitCriterion,
    first: int,
    n: int,
    num_steps: int,
    *,
    min_steps: int | Tensor = 2,
    every: int = 1,
    freeze: bool = True,
    gate: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, ExitTrack]:
    """Iterations first .. first + n - 1 (0-based) of a per-token adaptive loop capped at `num_steps`.

    step(state, i, exited) -> the state after iteration i; readout(state) -> next-token logits [..., V]
    (called only when the criterion reads logits, and only at iterations whose reading needs them).
    After each iteration the track takes its one update (`ExitTrack.after_iteration`). `freeze`: an exited
    token keeps its state (decoding: its exit state is its final one); otherwise it goes on iterating and
    only its step count stops (teacher-forced analysis, where every token runs to the same depth). No host
    sync: the caller decides when to look at `exited`. A gate criterion reads `gate(state)` (lambda per
    token) after every iteration instead; unfrozen, the track keeps each token's state at its exit
    (`exit_state`).
    Returns the new state and a new track (the given one is not modified)."""
    tokens = state.shape[:-1]
    if criterion.uses_gate:
        if gate is None or track.remaining is None:
            raise ValueError(
                f"exit criterion {criterion.name!r} needs the model's gate and a track started with gate=True"
            )
        if not freeze and track.exit_state is None:
            track = replace(track, exit_state=state.reshape(-1, state.shape[-1]).clone())
    for i in range(first, first + n):
        prev_state, new = state, step(state, i, track.exited)
        if freeze:  # a token done iterating keeps its state (its cap is this loop's bound: never reached inside)
            done = done_iterating(track.exited, track.iterations, num_steps)
            state = torch.where(done.view(*tokens, 1), prev_state, new)
        else:
            state = new
        track = track.after_iteration(
            criterion, i, num_steps, prev_state, state, min_steps=min_steps, every=every, readout=readout, gate=gate
        )
    return state, track
