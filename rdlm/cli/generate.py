"""`rdlm generate`: sample token ids from a model (the inference issue replaces this with the full
generation API; this is a plain greedy loop that recomputes the whole sequence per token)."""

from __future__ import annotations

import argparse

import torch

from rdlm import load_model


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="greedy generation from a model")
    p.add_argument("--model", required=True, help="a preset name or a model directory")
    p.add_argument("--prompt-ids", default="1,2,3", help="comma-separated token ids")
    p.add_argument("--num-steps", type=int, default=4, help="core iterations r per token")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


@torch.inference_mode()
def greedy(model, ids: torch.Tensor, num_steps: int, max_new_tokens: int) -> torch.Tensor:
    for _ in range(max_new_tokens):
        logits = model(ids, num_steps=num_steps, init_scale=0.0).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model = load_model(args.model).eval()
    ids = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])
    out = greedy(model, ids, args.num_steps, args.max_new_tokens)
    print(",".join(str(t) for t in out[0].tolist()))
    return 0
