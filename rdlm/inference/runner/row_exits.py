"""The continuous batch's exit readings on the device (rdlm.inference.batching, step 4): after each core
iteration, every running row's exit criterion (rdlm.inference.exits.criteria) is read without a host sync; the host
reads the outcome only when it looks.

`RowExits` keeps what the criteria carry from one iteration to the next in one `ExitTrack` over the batch's
rows (`track`: the latest logits, the streak of passing readings, a learned gate's running sums, whether the
criterion fired, gate-exact's chosen state), and updates it with the track's one update
(`ExitTrack.after_iteration`) for each group of the call's rows that read alike: the rows sit at different
iterations, so each group's reading schedule is given. The step runner counts each row's iterations and
decides, with `exit_track.done_iterating`, whether a row is done: `exited` and `runs_on` are what it reads here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rdlm.inference.execution.model_calls import Call, ModelCalls
from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.exits.track import ExitTrack, exit_schedule


class RowExits:
    """Per-row exit state of a batch of `max_batch` rows whose states are shaped like `state` ([b, 1, h])."""

    def __init__(self, calls: ModelCalls, max_batch: int, vocab_size: int, state: Tensor) -> None:
        self.calls = calls
        track = ExitTrack.start(max_batch, state.device, vocab_size, gate=True)
        assert track.logits is not None and track.remaining is not None and track.cumulative is not None
        # What the criteria carry per row (an `ExitTrack`'s fields, its iteration counts the runner's): whether
        # the criterion fired, the streak, the latest logits, the gate's running sums, gate-exact's chosen state.
        self.exited, self.streak, self.logits = track.exited, track.streak, track.logits
        self.remaining, self.cumulative = track.remaining, track.cumulative
        self.chosen = torch.zeros_like(state[:, -1])
        self.runs_on = torch.zeros_like(track.exited)  # gate-exact rows: their exit only chooses a state

    @property
    def exit_state(self) -> Tensor:
        """[max_batch, 1, h]: gate-exact's chosen state per row (read out when the token is done)."""
        return self.chosen.unsqueeze(1)

    def reset(self, rows: Tensor | slice, runs_on: Tensor | None = None) -> None:
        """Rows starting a token (`runs_on`: those whose criterion is gate-exact)."""
        self.streak[rows], self.exited[rows] = 0, False
        self.remaining[rows], self.cumulative[rows] = 1.0, 0.0
        self.runs_on[rows] = False if runs_on is None else runs_on

    def update(
        self,
        members: list,
        rows: Tensor,
        call: Call,
        prev_state: Tensor,
        state: Tensor,
        running: Tensor,
        iterations: Tensor,
        min_steps: Tensor,
    ) -> None:
        """Each running row's exit reading after this iteration (`ExitTrack.after_iteration`, the runner having
        counted it in `iterations`); `min_steps` are the rows' own. `members` (with `.criterion`, `.iteration`:
        iterations run with this one, `.cap`, `.config`) are the call's rows in order, at batch rows `rows`."""
        self._gate(members, rows, prev_state, state, running, iterations, min_steps)
        evaluate, readout = [], []  # rows whose criterion is read now; rows that need this iteration's logits
        for j, q in enumerate(members):
            if q.criterion is None or q.criterion.uses_gate:
                continue
            now, next_reads = exit_schedule(q.iteration - 1, q.cap, q.config.exit_every)
            if now:
                evaluate.append(j)
            if q.criterion.uses_logits and (now or next_reads):
                readout.append(j)
        if not evaluate and not readout:
            return
        groups: dict[ExitCriterion, list[int]] = {}
        for j in evaluate:
            groups.setdefault(members[j].criterion, []).append(j)
        everyone = list(range(len(members)))

        def where(group: list[int]) -> tuple[Tensor | slice, Tensor | slice]:
            """(positions in this call, rows of the batch) of `group`: views when they are every row."""
            if group == everyone:
                assert call.rows is not None  # (the call of the batch's rows names them)
                return slice(None), call.rows
            pick = self.calls.upload(group)
            return pick, rows[pick]

        # The previous reading's logits, before this iteration's readout replaces them.
        previous = {crit: self.logits[where(group)[1]].clone() for crit, group in groups.items() if crit.uses_logits}
        if readout:  # one readout for every row that needs one, whatever its criterion
            pick, at = where(readout)
            self.logits[at] = self.calls.readout(state[pick], call.select(pick, at))[:, -1]
        for crit, group in groups.items():
            pick, at = where(group)
            track = ExitTrack(iterations[at], self.exited[at], self.streak[at], previous.get(crit))
            logits = self.logits[at]
            read = track.after_iteration(
                crit,
                0,
                0,
                prev_state[pick, -1],
                state[pick, -1],
                min_steps=min_steps[at],
                readout=_given(logits),
                running=running[pick],
                reads=(True, False),
                counted=True,
            )
            self.streak[at], self.exited[at] = read.streak, read.exited

    def _gate(
        self,
        members: list,
        rows: Tensor,
        prev_state: Tensor,
        state: Tensor,
        running: Tensor,
        iterations: Tensor,
        min_steps: Tensor,
    ) -> None:
        """The learned exit gate after this iteration, for the rows that exit by it: `gate` is done once the gate
        fires; `gate-exact` runs on to its cap (`runs_on`) and reads out the state of the iteration the gate
        chose (`exit_state`: kept while the gate has not fired, so the last one if it never does)."""
        group = [j for j, q in enumerate(members) if q.criterion is not None and q.criterion.uses_gate]
        if not group:
            return
        pick = self.calls.upload(group)
        at = rows[pick]
        thresholds = self.calls.upload([members[j].criterion.threshold for j in group])
        track = ExitTrack(
            iterations[at],
            self.exited[at],
            self.streak[at],
            None,
            self.remaining[at],
            self.cumulative[at],
            self.chosen[at],
        )
        read = track.after_iteration(
            members[group[0]].criterion,
            0,
            0,
            prev_state[pick, -1],
            state[pick, -1],
            min_steps=min_steps[at],
            gate=self.calls.exit_probability,
            threshold=thresholds,
            running=running[pick],
            counted=True,
        )
        assert read.remaining is not None and read.cumulative is not None and read.exit_state is not None
        self.exited[at], self.remaining[at], self.cumulative[at], self.chosen[at] = (
            read.exited,
            read.remaining,
            read.cumulative,
            read.exit_state,
        )


def _given(logits: Tensor) -> Callable[[Tensor], Tensor]:
    """A readout that gives logits already read (a batch's rows are read out together, before their readings)."""
    return lambda _: logits
