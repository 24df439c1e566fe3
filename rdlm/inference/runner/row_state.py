"""The step runner's record of the request in one of its rows (rdlm.inference.runner.step_runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.params import GenerationConfig


@dataclass
class RowState:
    """What the step runner keeps of the request in one of its rows, copied from its `Admission` (and its
    generator and s_0 table, made there): the runner's own record, never the scheduler's `Request`."""

    id: int
    row: int
    prompt: list[int]
    config: GenerationConfig
    criterion: ExitCriterion | None
    budget: int
    generator: torch.Generator
    noise: torch.Tensor | None  # s_0 table [positions, h]
    length: int = 0  # buffer index of the token in progress (its pending token's, in rounds)
    next_token: int = -1  # the pending token a round starts from
    first_token: int | None = None  # the first new token, chosen after the prompt's prefill
    produced: int = 0  # tokens chosen so far (a failure names the token it happened at)
