"""The continuous batch's exit decisions on the device (rdlm.inference.batching, step 4): after each core
iteration, every running row's exit criterion (rdlm.inference.exits) marks the rows whose token is done,
without a host sync; the host reads the flags only when it looks.

`RowExits` keeps what the criteria carry from one iteration to the next, per row of the batch: the latest
logits (for the criteria that compare two readings), the streak of passing evaluations, a learned gate's
running sums, and gate-exact's chosen state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rdlm.inference.exits import ExitCriterion, exit_decision, exit_schedule, gate_exits
from rdlm.inference.runner import Call, ModelRunner


class RowExits:
    """Per-row exit state of a batch of `max_batch` rows whose states are shaped like `state`."""

    def __init__(self, runner: ModelRunner, max_batch: int, vocab_size: int, state: Tensor) -> None:
        device = state.device
        self.runner = runner
        self.logits = torch.zeros(max_batch, vocab_size, device=device)  # the latest reading
        self.streak = torch.zeros(max_batch, dtype=torch.long, device=device)
        # A learned exit gate's running sums per row (rdlm.inference.exits.gate_exits), whether gate-exact's
        # gate fired already, and the state it chose (read out when the token is done).
        self.gate_remaining = torch.ones(max_batch, device=device)
        self.gate_cumulative = torch.zeros(max_batch, device=device)
        self.gate_fired = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.exit_state = torch.zeros_like(state)

    def reset(self, rows: Tensor | slice) -> None:
        """Rows starting a token."""
        self.streak[rows], self.gate_fired[rows] = 0, False
        self.gate_remaining[rows], self.gate_cumulative[rows] = 1.0, 0.0

    def update(self, requests: list, rows: Tensor, call: Call, prev_state: Tensor, state: Tensor,
               running: Tensor, steps: Tensor, min_steps: Tensor, cap: Tensor, done: Tensor) -> None:
        """Each running row's exit decision after this iteration, into `done` (the batch's flags); `steps`,
        `min_steps` and `cap` are the batch's per-row counts. `requests` (with `.criterion`, `.iteration`,
        `.cap`, `.config`) are the call's rows in order, at batch rows `rows`."""
        self._gate(requests, rows, state, running, steps, min_steps, cap, done)
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
        previous = {crit: self.logits[where(members)[1]].clone()
                    for crit, members in groups.items() if crit.uses_logits}
        if readout:
            pick, at = where(readout)
            self.logits[at] = self.runner.readout(state[pick], call.select(pick, at))[:, -1]
        for crit, members in groups.items():
            pick, at = where(members)
            logits = self.logits[at] if crit.uses_logits else None
            exited, streak = exit_decision(crit, self.streak[at], steps[at], min_steps[at],
                                           previous.get(crit), logits, prev_state[pick, -1], state[pick, -1])
            live = running[pick]
            self.streak[at] = torch.where(live, streak, self.streak[at])
            done[at] |= exited & live

    def _gate(self, requests: list, rows: Tensor, state: Tensor, running: Tensor, steps: Tensor,
              min_steps: Tensor, cap: Tensor, done: Tensor) -> None:
        """The learned exit gate after this iteration, for the rows that exit by it: `gate` is done once
        the gate fires; `gate-exact` runs to its cap and keeps the state of the iteration the gate chose
        (`exit_state`)."""
        members = [j for j, q in enumerate(requests) if q.criterion is not None and q.criterion.uses_gate]
        if not members:
            return
        pick = self.runner.upload(members)
        at = rows[pick]
        thresholds = self.runner.upload([requests[j].criterion.threshold for j in members])
        exact = self.runner.upload([requests[j].criterion.spec.exact for j in members])
        live = running[pick]
        fired, remaining, cumulative = gate_exits(
            self.runner.exit_probability(state[pick, -1]), self.gate_remaining[at], self.gate_cumulative[at],
            thresholds, steps[at], min_steps[at], live)
        self.gate_remaining[at] = torch.where(live, remaining, self.gate_remaining[at])
        self.gate_cumulative[at] = torch.where(live, cumulative, self.gate_cumulative[at])
        done[at] |= fired & ~exact
        # gate-exact: the state where the gate first fired, or the last one if it never does
        chosen = exact & live & ~self.gate_fired[at] & (fired | (steps[at] >= cap[at]))
        self.exit_state[at] = torch.where(chosen.view(-1, 1, 1), state[pick], self.exit_state[at])
        self.gate_fired[at] |= exact & fired
