"""The static engine: a `Session` (rdlm.inference.engine) behind the engine interface (`Engine`), for
what decodes a whole batch as one: self-speculative decoding (rdlm.inference.speculative), the parallel
sampler (rdlm.inference.parallel), and a prefill with no new tokens (`max_new_tokens=0`). Every other
generation runs on the continuous batch (rdlm.inference.batching).

Every request is added before the first step and they share one `GenerationConfig`; the first step
prefills all prompts at once, each later step runs one round of self-speculative decoding or takes one
token of the parallel sampler. A request's id is its row.
"""

from __future__ import annotations

import time
from typing import Iterator

from rdlm.inference.engine import Session
from rdlm.inference.graphs import sync
from rdlm.inference.parallel import ParallelSampler
from rdlm.inference.params import BatchEvent, Decode, Engine, GenerationConfig, check_request
from rdlm.inference.sampling import choose
from rdlm.inference.speculative import speculate
from rdlm.model.lm import RecurrentDepthLM


def decodes_as_one(config: GenerationConfig) -> bool:
    """Whether a generation is the static batch's: self-speculative decoding, the parallel sampler, or a
    prefill with no new tokens. Every other one decodes token by token on the continuous batch."""
    return config.draft_steps is not None or config.sampler != "sequential" or config.max_new_tokens == 0


class StaticBatch(Engine):
    """Requests decoded as one batch over one session (see the module doc)."""

    def __init__(self, model: RecurrentDepthLM, config: GenerationConfig, decode: Decode | None = None) -> None:
        self.model, self.config, self.decode = model, config, decode
        self.device = next(model.parameters()).device
        self.prompts: list[list[int]] = []
        self.tokens: list[list[int]] = []
        self.finished: list[bool] = []
        self.session: Session | None = None
        self.rounds = self._rounds()

    def add(self, prompt: list[int], config: GenerationConfig) -> int:
        if self.session is not None or config != self.config:
            raise ValueError("a static batch takes its requests, all with its own config, before its first step")
        check_request(self.model, prompt, config, self.decode)
        if not decodes_as_one(config):
            raise ValueError("a static batch runs self-speculative decoding, the parallel sampler or a prefill "
                             "alone; decode token by token on the continuous batch (rdlm.inference.batching)")
        self.prompts.append(list(prompt))
        self.tokens.append([])
        self.finished.append(config.max_new_tokens == 0)
        return len(self.prompts) - 1

    def cancel(self, request: int) -> None:
        self.finished[request] = True

    def take_failures(self) -> list[tuple[int, Exception]]:
        return []   # its requests decode as one: an error fails the step (it raises)

    @property
    def busy(self) -> bool:
        return self.session is None or not all(self.finished)

    @property
    def queued(self) -> int:
        return 0 if self.session is not None else len(self.prompts)

    @property
    def running(self) -> int:
        return 0 if self.session is None else self.finished.count(False)

    def take_timings(self) -> dict[str, float]:
        return {}

    def step(self) -> list[BatchEvent]:
        """The next round's tokens, each row's until it finishes (a speculative round may overshoot)."""
        events = []
        for row, token, steps, scored in next(self.rounds, None) or []:
            if self.finished[row]:
                continue
            self.tokens[row].append(token)
            reason = self.config.finish_reason(self.tokens[row], decode=self.decode)
            self.finished[row] = reason is not None
            events.append(BatchEvent(row, token, steps, reason, *((None, None) if scored is None else scored)))
        if not self.busy:
            # The rounds' suspended frame holds this batch: closing it leaves no cycle, so the session and
            # its cache go with the last reference instead of at a later garbage collection.
            self.rounds.close()
        return events

    def _rounds(self) -> Iterator[list[tuple[int, int, int, tuple | None]]]:
        """The prefill (a round of no tokens), then rounds of (row, token, iterations at the position that
        chose it, (log p, top) or None)."""
        c, model = self.config, self.model
        parallel = ParallelSampler(model, self.prompts, c) if c.sampler == "parallel" else None
        s = self.session = parallel.session if parallel else Session(
            model, self.prompts, c, extra_tokens=0 if c.draft_steps is None else c.draft_length)
        self.cache_bytes = s.cache.nbytes
        t0 = time.perf_counter()
        logits = s.prefill() if parallel is None or c.full_prefill else None
        sync(s.device)
        self.decode_start = time.perf_counter()
        self.prefill_seconds = self.decode_start - t0
        yield []
        if parallel is not None:
            for token, steps in parallel.run(logits):
                self.core_passes, self.wave_steps = parallel.core_passes, parallel.wave_steps
                yield [(0, token, steps, None)]
            self.core_passes, self.wave_steps = parallel.core_passes, parallel.wave_steps
            self.finished = [True]  # the wave ran out of room
            return
        chosen, scored = choose(model, logits, c, s.samplers, s.seen, 0)
        yield [(row, token, c.prefill_steps or c.num_steps, None if scored is None else scored[row])
               for row, token in enumerate(chosen)]
        while True:  # self-speculative decoding: from the token chosen last, a round per step
            chosen, drafted, accepted = speculate(s, chosen[-1], c.draft_steps, c.num_steps, c.draft_length)
            self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
            yield [(0, token, c.num_steps, None) for token in chosen]
