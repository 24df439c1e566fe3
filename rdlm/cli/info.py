"""`rdlm info MODEL`: config, parameter counts and (optionally) forward-pass timing of a model."""

from __future__ import annotations

import argparse
import json
import time

import torch

from rdlm.cli import add_model_argument
from rdlm.model.config import RDLMConfig
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.resolve import ACCEPTED, resolve_model_source


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="show a model's config and parameter counts")
    add_model_argument(p, ACCEPTED)
    p.add_argument("--time-forward", metavar="R,R,...", default=None,
                   help="time one forward pass (batch 1, full context) at these iteration counts")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for --time-forward")
    p.set_defaults(func=run)


def describe(model: RecurrentDepthLM) -> dict:
    groups = model.parameter_groups()
    return {"config": model.config.to_dict(), "parameters": {**groups, "total": sum(groups.values())}}


def time_forward(model: RecurrentDepthLM, num_steps: int, seq_len: int, repeats: int = 3) -> float:
    """Median wall time in seconds of one no-grad forward pass on random tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    times = []
    with torch.inference_mode():
        model(ids, num_steps=num_steps)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, num_steps=num_steps)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> int:
    found = resolve_model_source(args.model)
    if found.kind == "preset":  # no weights to read: on the meta device unless it has to run
        config = RDLMConfig.from_preset(found.preset)
        device = "meta" if args.time_forward is None else "cpu"
        with torch.device(device):
            model = RecurrentDepthLM(config)
    else:
        model = found.load()
    info = describe(model)
    if args.time_forward:
        seq_len = model.config.context_length if args.seq_len is None else args.seq_len
        if not 1 <= seq_len <= model.config.context_length:
            raise ValueError(f"--seq-len must be in [1, {model.config.context_length}], got {seq_len}")
        info["forward_seconds"] = {
            int(r): round(time_forward(model.eval(), int(r), seq_len), 4)
            for r in args.time_forward.split(",")
        }
        info["forward_seq_len"] = seq_len
    print(json.dumps(info, indent=2))
    return 0
