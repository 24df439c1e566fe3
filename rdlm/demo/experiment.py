"""What the demo's experiments share (`rdlm demo --experiment retrofit|gate`, rdlm.demo.retrofit_demo and
rdlm.demo.gate_demo): their result, the training rows of each phase, the claims' arithmetic, and the
machine, load and time every report states."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdlm.demo import tasks as T
from rdlm.demo.config import MARGIN_EPS, DemoConfig

# Each phase of an experiment draws its own training rows (phase 0 from the seed's own stream, which the
# main demo's training takes too); the offset keeps the phases' streams apart.
PHASE_SEED_OFFSET = 7919


@dataclass
class ExperimentResult:
    out_dir: Path
    results: dict[str, Any]
    models: dict[str, Any]
    files: list[str] = field(default_factory=list)


def phase_rows(
    family: T.TaskFamily, cfg: DemoConfig, steps: int, phase: int, reserved: set[str], tokenizer: T.CharTokenizer
):
    """The training rows of one phase, `steps` batches of `cfg.batch_size`: with the word-length curriculum
    in order (the main demo's), none of them a prompt of an evaluation split."""
    from rdlm.demo.run import task_rows

    n = steps * cfg.batch_size
    order = (
        T.curriculum(family.train_difficulties, n, cfg.curriculum_fraction, cfg.curriculum_start)
        if cfg.curriculum_fraction > 0
        else None
    )
    examples = T.generate(
        family, n, cfg.seed + PHASE_SEED_OFFSET * phase, "train", difficulties=order, exclude=reserved
    )
    return task_rows(examples, tokenizer)


def check_rows(checks: Sequence[tuple[Any, ...]], op: str = ">=") -> list[dict[str, Any]]:
    """(claim, measured value, bound) -> the report's rows: the margin (how far the value is on the right
    side of the bound; negative: the claim fails) and whether it holds. `op` is ">=" or "<=", or per check
    a fourth element; a fifth, "ratio", marks a value that is not a fraction of examples (the row's unit)."""
    rows = []
    for check in checks:
        name, value, bound = check[:3]
        sign = check[3] if len(check) > 3 else op
        if sign not in (">=", "<="):
            raise ValueError(f"a claim's comparison is >= or <=, got {sign!r}")
        margin = value - bound if sign == ">=" else bound - value
        # Accuracies are counts / n: a value exactly at the bound holds, whatever the rounding.
        rows.append(
            {
                "claim": f"{name} {sign} {bound:g}",
                "value": value,
                "op": sign,
                "bound": bound,
                "margin": margin,
                "holds": margin >= -MARGIN_EPS,
                "unit": check[4] if len(check) > 4 else "fraction",
            }
        )
    return rows


@dataclass
class Environment:
    """The clock, CPU time and load at the start of a run; `finish` gives what the report states."""

    start: float
    cpu_start: float
    load_start: list[float] | None

    def finish(self, workers: int, threads: int) -> dict[str, Any]:
        from rdlm.demo.run import _cpu_seconds, _load, cpu_model

        return {
            "seconds": round(time.perf_counter() - self.start, 1),
            "cpu_seconds": round(_cpu_seconds() - self.cpu_start, 1),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "workers": workers, "threads_per_model": threads},
            "load_average": {"start": self.load_start, "end": _load()},
        }


def environment() -> Environment:
    from rdlm.demo.run import _cpu_seconds, _load

    return Environment(time.perf_counter(), _cpu_seconds(), _load())
