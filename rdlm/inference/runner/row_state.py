"""The step runner's record of the request in one of its rows (rdlm.inference.runner.step_runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.params import GenerationConfig


@dataclass
class RowState:
    """What the step runner keeps of the request in one of its rows to run it, copied from its `Admission` (and
    its generator and s_0 table, made there): the runner's own record, never the scheduler's `Request`. Where
    the request stands (its length, its tokens, its iterations) is the scheduler's alone: a plan says it."""

    id: int
    row: int
    prompt: list[int]
    config: GenerationConfig
    criterion: ExitCriterion | None
    budget: int
    generator: torch.Generator
    noise: torch.Tensor | None  # s_0 table [positions, h]
