"""The continuous batch's exit readings on the device (rdlm.inference.batching, step 4): after each core
iteration, every running row's exit criterion (rdlm.inference.exits.criteria) is read without a host sync; the host
reads the outcome only when it looks.

`RowExits` keeps what the criteria carry from one iteration to the next in one `ExitTrack` over the batch's
rows (`track`: the latest logits, the streak of passing readings, a learned gate's running sums, whether the
criterion fired, gate-exact's chosen state), and updates it with the track's one update
(`ExitTrack.after_iteration`) for each group of the call's rows that read alike: the rows sit at different
iterations, so each group's reading schedule is given. The step runner counts each row's iterations and
decides, with `exit_track.done_iterating`, whether a row is done: `exited` and `runs_on` are what it reads here.

A criterion that compares the latent states alone (latent-diff, cosine: `CriterionSpec.state_only`) needs nothing
from the host to be read, so the static step reads it itself after each iteration it runs (`read`,
from each row's criterion, threshold, patience and reading interval, kept on the device when the request is
admitted): several iterations can then run in one call, a row that exits among them frozen at its exit. The host's
reading (`update`) leaves those rows to it when the step is static.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rdlm.inference.execution.model_calls import Call, ModelCalls
from rdlm.inference.exits.criteria import CRITERIA, ExitCriterion
from rdlm.inference.exits.track import ExitTrack, exit_schedule

STATE_ONLY = tuple(name for name, spec in CRITERIA.items() if spec.state_only)  # read by the static step itself


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
        # The state-only criteria the static step reads (`read`), per row: which (0: none, else 1 + its
        # place in STATE_ONLY), its threshold, patience and reading interval (`exit_every`).
        self.kind = torch.zeros_like(self.streak)
        self.threshold = torch.zeros(max_batch, dtype=torch.float32, device=state.device)
        self.patience, self.every = torch.ones_like(self.streak), torch.ones_like(self.streak)
        self.in_step: tuple[str, ...] = ()  # the names among them of the rows admitted so far, in STATE_ONLY's order

    @property
    def exit_state(self) -> Tensor:
        """[max_batch, 1, h]: gate-exact's chosen state per row (read out when the token is done)."""
        return self.chosen.unsqueeze(1)

    def admit(self, row: int, criterion: ExitCriterion | None, every: int) -> None:
        """A request enters `row` with `criterion` read every `every` iterations: what the static step reads of
        it (`read`), if it compares the states alone."""
        if criterion is None or not criterion.spec.state_only:
            self.kind[row] = 0
            return
        self.kind[row] = STATE_ONLY.index(criterion.name) + 1
        self.threshold[row], self.patience[row], self.every[row] = criterion.threshold, criterion.patience, every
        if criterion.name not in self.in_step:
            self.in_step = tuple(name for name in STATE_ONLY if name in self.in_step or name == criterion.name)

    def read(
        self,
        names: tuple[str, ...],
        prev_state: Tensor,
        state: Tensor,
        running: Tensor,
        iterations: Tensor,
        cap: Tensor,
        min_steps: Tensor,
    ) -> tuple[Tensor, Tensor] | None:
        """The readings of the state-only criteria `names` after an iteration of the batch's first k rows, on the
        device (no host number: a static step reads them between the iterations it runs): the rows' new streaks
        and exited flags [k], or None for no names. The states went from `prev_state` to `state` ([k, 1, h]);
        `running`: the rows that ran it, `iterations` [k] counting it, `cap` and `min_steps` theirs. The rule of
        `update` (`ExitTrack.read_criterion` at the iterations of `exit_schedule`), row by row; a row whose
        criterion is not among `names` keeps its streak and flag."""
        if not names:
            return None
        k = state.shape[0]
        kind, streak, exited = self.kind.narrow(0, 0, k), self.streak.narrow(0, 0, k), self.exited.narrow(0, 0, k)
        done = iterations - 1  # the 0-based iteration just run
        reads = running & (done > 0) & (done < cap - 1) & (iterations % self.every.narrow(0, 0, k) == 0)
        score, known = torch.zeros_like(self.threshold.narrow(0, 0, k)), torch.zeros_like(reads)
        for name in names:
            mine = kind == STATE_ONLY.index(name) + 1
            score = torch.where(mine, CRITERIA[name].score(None, None, prev_state[:, -1], state[:, -1]), score)
            known = known | mine
        reads = reads & known
        passing = torch.where(score < self.threshold.narrow(0, 0, k), streak + 1, 0)  # the streak if read now
        fired = reads & (passing >= self.patience.narrow(0, 0, k)) & (iterations >= min_steps)
        return torch.where(reads, passing, streak), exited | fired

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
        static: bool = False,
    ) -> None:
        """Each running row's exit reading after this iteration (`ExitTrack.after_iteration`, the runner having
        counted it in `iterations`); `min_steps` are the rows' own. `members` (with `.criterion`, `.iteration`:
        iterations run with this one, `.cap`, `.config`) are the call's rows in order, at batch rows `rows`.
        `static`: the iteration ran as the static step, which read the state-only criteria (`read`)."""
        self._gate(members, rows, prev_state, state, running, iterations, min_steps)
        evaluate, readout = [], []  # rows whose criterion is read now; rows that need this iteration's logits
        for j, q in enumerate(members):
            if q.criterion is None or q.criterion.uses_gate or (static and q.criterion.spec.state_only):
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
