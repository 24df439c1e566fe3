"""`rdlm analyze MODEL --prompt TEXT`: latent trajectories, convergence, dynamics, path independence and
exit-step pictures for a model, gathered in a self-contained HTML report (see `rdlm.analysis`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rdlm.checks import is_int
from rdlm.cli import CLIError, add_model_argument, add_quantize_arguments, add_threads_argument, check_exit_threshold
from rdlm.fileio import claim_output_dir, new_dirs_removed_on_failure, read_jsonl
from rdlm.model.resolve import ACCEPTED, resolve_model_source
from rdlm.resources import use_threads


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="pictures of the latent dynamics (trajectories, convergence, "
        "path independence, exit steps) in an HTML report",
    )
    add_model_argument(p, ACCEPTED)
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt as text (needs the model's tokenizer.json); repeatable",
    )
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="ID,ID,...",
        help="a prompt as comma-separated token ids; repeatable",
    )
    p.add_argument(
        "--prompts-file",
        metavar="FILE.jsonl",
        help='one JSON object per line: {"text": ...} or {"ids": [...]}, optional "category" '
        '(groups the exit-step histogram) and "name"',
    )
    p.add_argument("--out", default="analysis", help="output directory (default: analysis)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier analysis in --out (its report, summary, figures and states)",
    )
    p.add_argument("--num-steps", "-r", type=int, default=32, help="iterations r to record (default 32)")
    p.add_argument("--limit-steps", type=int, default=None, help="iterations for the limit state s* (default 4 r)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initial state s_0")
    p.add_argument("--init-scale", type=float, default=1.0, help="scale of s_0 (0: all-zero state)")
    p.add_argument("--tokens", type=int, default=6, help="tokens drawn in the trajectory figure")
    p.add_argument(
        "--positions", default=None, metavar="P,P,...", help="exactly these prompt positions in the trajectory figure"
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="record at most this many tokens per prompt, evenly spread (0: all)"
    )
    p.add_argument(
        "--iteration-stride",
        type=int,
        default=None,
        help="keep every k-th state (default: 1, larger if the record exceeds --max-memory-mb)",
    )
    p.add_argument(
        "--max-memory-mb",
        type=int,
        default=512,
        help="in-memory budget for one prompt's states before iterations are subsampled",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="stream all states to OUT/states/*.npy (numpy memmap) instead of subsampling",
    )
    p.add_argument("--runs", type=int, default=4, help="random initial states for path independence")
    p.add_argument(
        "--exit-criterion",
        default="kl",
        help="criterion for the exit-step histogram (rdlm.inference.exits.criteria; 'none' to skip)",
    )
    p.add_argument("--exit-threshold", type=float, default=None, help="its threshold (default: its own)")
    p.add_argument("--exit-max-steps", type=int, default=None, help="cap on exit steps (default r)")
    add_threads_argument(p)
    add_quantize_arguments(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as err:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from err


def _file_ids(ids, where: str) -> list[int]:
    if not isinstance(ids, list) or not all(map(is_int, ids)):
        raise ValueError(f'{where}: "ids" must be a list of integer token ids, got {json.dumps(ids)[:60]}')
    return ids


def load_tokenizer(tokenizer_dir: Path | None):
    """The model's tokenizer, or None (token ids are shown instead of text)."""
    if tokenizer_dir is None:
        return None
    try:
        from rdlm.data.tokenizer import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_dir(tokenizer_dir)


def read_prompts(args: argparse.Namespace, tokenizer):
    from rdlm.analysis import Prompt

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise ValueError(
                f"{where}: text prompts need a tokenizer.json in the model directory; "
                "give token ids (--prompt-ids) instead"
            )
        return tokenizer.encode(text)

    prompts = [Prompt(f"p{i}", encode(t, "--prompt"), text=t) for i, t in enumerate(args.prompt)]
    prompts += [Prompt(f"p{len(prompts) + i}", _ids(t)) for i, t in enumerate(args.prompt_ids)]
    if args.prompts_file:
        path = Path(args.prompts_file)
        for n, item in read_jsonl(path):
            if not isinstance(item, dict) or ("text" in item) == ("ids" in item):
                raise ValueError(f'{path}:{n}: expected an object with exactly one of "text" or "ids"')
            ids = encode(item["text"], f"{path}:{n}") if "text" in item else _file_ids(item["ids"], f"{path}:{n}")
            prompts.append(
                Prompt(
                    str(item.get("name", f"p{len(prompts)}")),
                    ids,
                    category=str(item.get("category", "")),
                    text=item.get("text"),
                )
            )
    if not prompts:
        raise ValueError("no prompt: give --prompt, --prompt-ids or --prompts-file")
    names = [p.name for p in prompts]
    if len(set(names)) != len(names):
        raise ValueError(f"prompt names must be unique, got {names}")
    for p in prompts:
        if not p.token_ids:
            raise ValueError(f"prompt {p.name} has no tokens")
    return prompts


def run(args: argparse.Namespace) -> int:
    from rdlm.analysis import AnalysisSettings, analyze
    from rdlm.analysis.run import is_analysis_file
    from rdlm.resources import check_device

    check_device(args.device)
    if args.max_memory_mb < 1:
        raise CLIError(
            f"--max-memory-mb must be >= 1, got {args.max_memory_mb} (--stream keeps every state on disk instead)"
        )
    found = resolve_model_source(args.model)
    tokenizer = load_tokenizer(found.tokenizer_dir)
    prompts = read_prompts(args, tokenizer)
    check_exit_threshold(None if args.exit_criterion == "none" else args.exit_criterion, args.exit_threshold)
    settings = AnalysisSettings(
        num_steps=args.num_steps,
        limit_steps=args.limit_steps,
        seed=args.seed,
        init_scale=args.init_scale,
        plot_tokens=args.tokens,
        plot_positions=_ids(args.positions) if args.positions else None,
        max_tokens=args.max_tokens or None,
        iteration_stride=args.iteration_stride,
        max_bytes=args.max_memory_mb * 2**20,
        stream=args.stream,
        num_runs=args.runs,
        exit_criterion=None if args.exit_criterion == "none" else args.exit_criterion,
        exit_threshold=args.exit_threshold,
        exit_max_steps=args.exit_max_steps,
    )
    out = claim_output_dir(args.out, is_analysis_file, args.overwrite, "an analysis")
    model = found.load(device=args.device, quantize=args.quantize, group_size=args.quantize_group_size)
    use_threads(model, args.threads)
    with torch.no_grad(), new_dirs_removed_on_failure(out):
        result = analyze(model, prompts, out, settings, tokenizer=tokenizer, model_name=args.model)
    for name, p in result.summary["prompts"].items():
        pi = p["path_independence"]
        print(
            f"{name}: {p['num_tokens']} tokens; dynamics {p['dynamics_counts']}; "
            f"distance to s* at r {p['convergence']['relative_distance_to_limit_at_r']['median']:.3g} "
            f"(median, relative); path spread final {pi['relative_spread_final']['median']:.3g}; "
            f"storage: {'; '.join(p['storage'])}"
        )
    if "exit_steps" in result.summary:
        e = result.summary["exit_steps"]
        for group, v in e["groups"].items():
            print(
                f"exit steps ({e['criterion']}) {group}: mean {v['mean']:.2f}, median {v['median']:.0f}, "
                f"never exited {v['never_exited']}/{v['tokens']}"
            )
    print(f"report: {result.report}")
    return 0
