"""The rounds of the requests that decode a round at a time in the continuous batch (`StepPlan.rounds`,
rdlm.inference.scheduling.plan): a self-speculative round (rdlm.inference.runner.speculative) or a step of a parallel
sampler's wave (rdlm.inference.runner.parallel), each in calls over the request's row alone. `Rounds` holds the waves
in flight, one per parallel request, and counts their work."""

from __future__ import annotations

from rdlm.inference.execution.model_calls import ModelCalls
from rdlm.inference.runner.parallel import ParallelSampler
from rdlm.inference.runner.row_state import RowState
from rdlm.inference.runner.sampling import NonFiniteLogitsError
from rdlm.inference.runner.speculative import speculate
from rdlm.inference.scheduling.plan import RoundOutput


class Rounds:
    """The waves of the parallel requests in flight (by request id) and the rounds' work, all requests
    together: the waves' core calls (`core_passes`) and steps (`wave_steps`)."""

    def __init__(self, calls: ModelCalls) -> None:
        self.calls = calls
        self.waves: dict[int, ParallelSampler] = {}
        self.core_passes = self.wave_steps = 0

    def run(self, row: RowState, position: int, token: int) -> RoundOutput:
        """A request's round from its pending token `token` (chosen, not yet fed) at buffer index `position`: a
        speculative one, or its wave's next step (the wave opens at its first round, from the first token when
        a full prefill chose one); a round whose logits are not finite fails the request alone (its wave goes
        with it)."""
        try:
            if row.config.draft_steps is not None:
                drafts, drafted, accepted = speculate(self.calls, row, position, token)
                return RoundOutput(row.id, [(t, row.config.num_steps) for t in drafts], drafted, accepted)
            wave = self.waves.get(row.id)
            if wave is None:
                wave = self.waves[row.id] = ParallelSampler(self.calls, row, None if token < 0 else token)
            passes, steps = wave.core_passes, wave.wave_steps
            tokens = wave.step()
            self.core_passes += wave.core_passes - passes
            self.wave_steps += wave.wave_steps - steps
            if wave.exhausted:
                self.forget(row.id)
            return RoundOutput(row.id, tokens, exhausted=wave.exhausted)
        except NonFiniteLogitsError as err:
            self.forget(row.id)
            return RoundOutput(row.id, error=err)

    def forget(self, request: int) -> None:
        """The request left its row: its wave goes."""
        self.waves.pop(request, None)
