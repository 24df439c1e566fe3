"""`rdlm info MODEL`: config, parameter counts and (optionally) forward-pass timing of a model."""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch

from rdlm.cli import add_model_argument, add_threads_argument
from rdlm.model.config import RDLMConfig
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.resolve import ACCEPTED, resolve_model_source
from rdlm.resources import use_threads


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="show a model's config and parameter counts")
    add_model_argument(p, ACCEPTED)
    p.add_argument(
        "--time-forward",
        metavar="R,R,...",
        default=None,
        help="time one forward pass (batch 1, full context) at these iteration counts",
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for --time-forward")
    add_threads_argument(p)
    p.set_defaults(func=run)


def describe(model: RecurrentDepthLM) -> dict:
    groups = model.parameter_groups()
    return {"config": model.config.to_dict(), "parameters": {**groups, "total": sum(groups.values())}}


def time_forward(
    model: RecurrentDepthLM, num_steps: int, seq_len: int, repeats: int = 3, on_pass: Callable[[], object] | None = None
) -> float:
    """Median wall time in seconds of one no-grad forward pass on random tokens (after a warm-up pass);
    `on_pass` is called after each pass."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    times = []
    with torch.inference_mode():
        model(ids, num_steps=num_steps)  # warm-up
        if on_pass is not None:
            on_pass()
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, num_steps=num_steps)
            times.append(time.perf_counter() - start)
            if on_pass is not None:
                on_pass()
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> int:
    found = resolve_model_source(args.model)
    if found.kind == "preset":  # no weights to read: on the meta device unless it has to run
        assert found.preset is not None  # a preset's name, by its kind
        config = RDLMConfig.from_preset(found.preset)
        device = "meta" if args.time_forward is None else "cpu"
        with torch.device(device):
            model = RecurrentDepthLM(config)
    else:
        model = found.load()
    info = describe(model)
    if args.time_forward:
        from tqdm.auto import tqdm

        try:
            steps = [int(r) for r in args.time_forward.split(",")]
        except ValueError:
            raise ValueError(f"--time-forward must be comma-separated integers, got {args.time_forward!r}") from None
        if not steps or min(steps) < 1:
            raise ValueError(f"--time-forward iteration counts must be >= 1, got {args.time_forward!r}")
        seq_len = model.config.context_length if args.seq_len is None else args.seq_len
        if not 1 <= seq_len <= model.config.context_length:
            raise ValueError(f"--seq-len must be in [1, {model.config.context_length}], got {seq_len}")
        use_threads(model, args.threads)
        repeats = 3
        # A bar over the passes, weighted by iterations: r = 64 takes 64 times as long as r = 1.
        with tqdm(
            total=sum(steps) * (repeats + 1), unit="it", desc="forward passes", leave=False, dynamic_ncols=True
        ) as bar:
            info["forward_seconds"] = {
                r: round(time_forward(model.eval(), r, seq_len, repeats, functools.partial(bar.update, r)), 4)
                for r in steps
            }
        info["forward_seq_len"] = seq_len
    print(json.dumps(info, indent=2))
    return 0
