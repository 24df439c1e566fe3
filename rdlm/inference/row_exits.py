"""The continuous batch's exit decisions on the device (rdlm.inference.batching, step 4): after each core
iteration, every running row's exit criterion (rdlm.inference.exits) marks the rows whose token is done,
without a host sync; the host reads the flags only when it looks.

`RowExits` keeps what the criteria carry from one iteration to the next in one `ExitTrack` over the batch's
rows (`track`: the latest logits, the streak of passing readings, a learned gate's running sums, whether the
criterion fired, gate-exact's chosen state), and updates it with the track's own readings
(`ExitTrack.read_gate`, `ExitTrack.read_criterion`), those of the per-token loop, for the call's rows. The
batch counts each row's iterations and owns the done flags; it passes them in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rdlm.inference.exits import ExitCriterion, ExitTrack, exit_schedule
from rdlm.inference.runner import Call, ModelRunner


class RowExits:
    """Per-row exit state of a batch of `max_batch` rows whose states are shaped like `state` ([b, 1, h])."""

    def __init__(self, runner: ModelRunner, max_batch: int, vocab_size: int, state: Tensor) -> None:
        self.runner = runner
        track = ExitTrack.start(max_batch, state.device, vocab_size, gate=True)
        # The batch counts the rows' iterations (`update` takes them); the gate-exact state is one per row.
        self.track = ExitTrack(None, track.exited, track.streak, track.logits, track.remaining, track.cumulative,
                               torch.zeros_like(state[:, -1]))

    @property
    def exit_state(self) -> Tensor:
        """[max_batch, 1, h]: gate-exact's chosen state per row (read out when the token is done)."""
        return self.track.exit_state.unsqueeze(1)

    def reset(self, rows: Tensor | slice) -> None:
        """Rows starting a token."""
        t = self.track
        t.streak[rows], t.exited[rows] = 0, False
        t.remaining[rows], t.cumulative[rows] = 1.0, 0.0

    def update(self, requests: list, rows: Tensor, call: Call, prev_state: Tensor, state: Tensor,
               running: Tensor, steps: Tensor, min_steps: Tensor, done: Tensor) -> None:
        """Each running row's exit decision after this iteration, into `done` (the batch's flags); `steps` and
        `min_steps` are the batch's per-row counts. `requests` (with `.criterion`, `.iteration`,
        `.cap`, `.config`) are the call's rows in order, at batch rows `rows`."""
        self._gate(requests, rows, state, running, steps, min_steps, done)
        evaluate, readout = [], []  # rows whose criterion is read now; rows that need this iteration's logits
        for j, q in enumerate(requests):
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
            groups.setdefault(requests[j].criterion, []).append(j)
        everyone = list(range(len(requests)))

        def where(members: list[int]) -> tuple[Tensor | slice, Tensor | slice]:
            """(positions in this call, rows of the batch) of `members`: views when they are every row."""
            if members == everyone:
                return slice(None), call.rows
            pick = self.runner.upload(members)
            return pick, rows[pick]

        # The previous reading's logits, before this iteration's readout replaces them.
        previous = {crit: self.track.logits[where(members)[1]].clone()
                    for crit, members in groups.items() if crit.uses_logits}
        if readout:
            pick, at = where(readout)
            self.track.logits[at] = self.runner.readout(state[pick], call.select(pick, at))[:, -1]
        for crit, members in groups.items():
            pick, at = where(members)
            logits = self.track.logits[at] if crit.uses_logits else None
            read = self._rows(at, steps).read_criterion(crit, previous.get(crit), logits, prev_state[pick, -1],
                                                        state[pick, -1], min_steps[at], running[pick])
            self.track.streak[at], self.track.exited[at] = read.streak, read.exited
            done[at] |= read.exited

    def _gate(self, requests: list, rows: Tensor, state: Tensor, running: Tensor, steps: Tensor,
              min_steps: Tensor, done: Tensor) -> None:
        """The learned exit gate after this iteration, for the rows that exit by it: `gate` is done once
        the gate fires; `gate-exact` runs to its cap and reads out the state of the iteration the gate chose
        (`exit_state`: kept while the gate has not fired, so the last one if it never does)."""
        members = [j for j, q in enumerate(requests) if q.criterion is not None and q.criterion.uses_gate]
        if not members:
            return
        pick = self.runner.upload(members)
        at = rows[pick]
        thresholds = self.runner.upload([requests[j].criterion.threshold for j in members])
        exact = self.runner.upload([requests[j].criterion.spec.exact for j in members])
        state = state[pick, -1]
        read = self._rows(at, steps, gate=True).read_gate(self.runner.exit_probability(state), state, thresholds,
                                                          min_steps[at], running[pick])
        t = self.track
        t.exited[at], t.remaining[at], t.cumulative[at], t.exit_state[at] = (
            read.exited, read.remaining, read.cumulative, read.exit_state)
        done[at] |= read.exited & ~exact

    def _rows(self, at: Tensor | slice, steps: Tensor, gate: bool = False) -> ExitTrack:
        """The track of batch rows `at`, their iterations `steps[at]` (the gate's sums and state with `gate`)."""
        t = self.track
        sums = (t.remaining[at], t.cumulative[at], t.exit_state[at]) if gate else ()
        return ExitTrack(steps[at], t.exited[at], t.streak[at], None, *sums)
