"""A request of the continuous batch as its scheduler sees it (rdlm.inference.scheduling.scheduler): what it asked
for and where it stands, in host numbers only (the step runner keeps its own copy of what it needs, with its
tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.params import GenerationConfig


class Status(enum.Enum):
    """Where a request stands (rdlm.inference.scheduling.scheduler: the states and their order)."""

    WAITING = "waiting"  # queued for a row
    PREFILLING = "prefilling"  # its prompt runs in chunks, until its first token is chosen
    STARTING = "starting"  # a token was chosen: its prelude and s_0 come next
    ITERATING = "iterating"  # the token's core iterations run
    AWAITING_CODA = "awaiting coda"  # the token stopped iterating (an exit, or its cap); its coda comes next


@dataclass
class Request:
    """A request in a `ContinuousBatch` (rdlm.inference.batching): its settings and where its token is."""

    id: int
    prompt: list[int]
    config: GenerationConfig
    criterion: ExitCriterion | None
    budget: int  # core cache slots this request cycles through
    row: int = -1
    length: int = 0  # tokens in the cache
    next_token: int = -1  # chosen, fed at the next start
    iteration: int = 0  # iterations run for the token in progress
    cap: int = 0  # iterations it may run (num_steps, or less under a depth budget)
    spent: int = 0  # iterations run by the tokens chosen so far
    status: Status = Status.WAITING
    stopped_at: int = 0  # the step at which the look found its token stopped iterating
    tokens: list[int] = field(default_factory=list)  # its new tokens: the one record of them
