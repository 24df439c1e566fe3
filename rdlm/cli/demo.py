"""`rdlm demo`: train a recurrent-depth model and two non-recurrent baselines, write a report (rdlm.demo.run)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rdlm.cli import takes_effect
from rdlm.demo.gate_demo import GateSettings
from rdlm.demo.lora_demo import EVAL_NUM_STEPS as LORA_NUM_STEPS
from rdlm.demo.lora_demo import LoraSettings
from rdlm.demo.retrofit_demo import RetrofitSettings
from rdlm.demo.run import DemoConfig, run_demo
from rdlm.demo.tasks import TASKS
from rdlm.model.retrofit import ADAPTER_INITS, parse_layers

EXPERIMENTS = ("main", "retrofit", "gate", "lora")
# The options that only some experiments read (given to another, they are refused by name); every other
# option is read by all of them. The retrofit experiment trains its own Llama (--source-layers, --pretrain-steps,
# --retrofit-steps) and scores no adaptive exits; the lora experiment trains the demo's recurrent model
# (--layers) for --base-steps and adapts it for --adapt-steps, with no adaptive exits either.
READ_BY = {
    **dict.fromkeys(("pretrain_steps", "retrofit_steps", "source_layers", "split", "adapter_init"), ("retrofit",)),
    **dict.fromkeys(("loops", "loop_layers", "exit_loss_beta", "gate_thresholds", "no_kl"), ("gate",)),
    **dict.fromkeys(("base_steps", "adapt_steps", "lora_rank", "lora_alpha", "lora_lr", "fixed_r"), ("lora",)),
    **dict.fromkeys(("no_twin", "no_depth_matched"), ("main",)),
    **dict.fromkeys(
        ("steps", "exit_criterion", "exit_thresholds", "exit_tolerance", "exit_max_steps"), ("main", "gate")
    ),
    "layers": ("main", "gate", "lora"),
}


# `--full`: the models trained twice as long, and r swept twice as far.
FULL_STEPS = 2000
FULL_NUM_STEPS = (1, 2, 4, 8, 16, 32, 64, 128)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def register(subparsers) -> None:
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo",
        help="accuracy vs test-time iterations on a reasoning task, in minutes",
        description="Train a small recurrent-depth model, its parameter-matched twin and a "
        "depth-matched non-recurrent model on an embedded task; choose r and the "
        "exit threshold on a validation split; write a report (results.json, "
        "report.md, plots, the trained model).",
    )
    p.add_argument("--task", default=d.task, choices=[*TASKS, "code"], help="task family")
    p.add_argument("--out", default=d.out_dir, help="report directory (your other files there stay; docs/files.md)")
    p.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the data and of training")
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the longer, more thorough run: {FULL_STEPS} steps per model and r up to {max(FULL_NUM_STEPS)} "
        "(about twice the time; --steps and --num-steps still override it)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps per model (default {d.steps}, {FULL_STEPS} with --full)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training rows per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument(
        "--cooldown-fraction",
        type=float,
        default=d.cooldown_fraction,
        help="last fraction of the steps over which the learning rate decays linearly to 0 (0: constant)",
    )
    p.add_argument(
        "--optimizer",
        default=d.optimizer,
        choices=("adamw", "muon"),
        help="adamw, or muon: Muon for the blocks' weight matrices and AdamW for the rest",
    )
    p.add_argument("--muon-lr", type=float, default=d.muon_lr, help="peak learning rate of the Muon matrices")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up of the learning rate")
    p.add_argument(
        "--curriculum-fraction",
        type=float,
        default=d.curriculum_fraction,
        help="fraction of the steps over which training takes in harder problems, easiest first "
        "(0: every difficulty from the start)",
    )
    p.add_argument(
        "--curriculum-start",
        type=int,
        default=d.curriculum_start,
        help="how many of the easiest difficulties the curriculum starts with",
    )
    p.add_argument("--hidden-size", type=int, default=d.hidden_size, help="model width h")
    p.add_argument("--num-heads", type=int, default=d.num_heads, help="attention heads")
    p.add_argument("--layers", type=_ints, default=d.layers, help="prelude,core,coda layers")
    p.add_argument(
        "--mean-recurrence",
        type=int,
        default=d.mean_recurrence,
        help="mean r of training (the sampled r has mean this + 1)",
    )
    p.add_argument(
        "--recurrence-sigma",
        type=float,
        default=d.recurrence_sigma,
        help="spread of the sampled training r (the log-normal's sigma)",
    )
    p.add_argument("--backprop-depth", type=int, default=d.backprop_depth, help="k: iterations backpropagated through")
    p.add_argument(
        "--eval-examples",
        type=int,
        default=d.eval_examples,
        help="examples per evaluation split (validation, test, harder)",
    )
    p.add_argument(
        "--num-steps",
        type=_ints,
        default=None,
        help=f"r values to evaluate (default {','.join(map(str, d.eval_num_steps))}, "
        f"{','.join(map(str, FULL_NUM_STEPS))} with --full, {','.join(map(str, LORA_NUM_STEPS))} for the lora "
        "experiment)",
    )
    p.add_argument("--exit-criterion", default=d.exit_criterion, help="adaptive exit criterion evaluated")
    p.add_argument(
        "--exit-thresholds",
        type=_floats,
        default=d.exit_thresholds,
        help="exit thresholds to try on validation (the loosest within --exit-tolerance is used)",
    )
    p.add_argument(
        "--exit-tolerance",
        type=float,
        default=d.exit_tolerance,
        help="validation accuracy an exit threshold may lose against fixed r",
    )
    p.add_argument(
        "--exit-max-steps",
        type=int,
        default=d.exit_max_steps,
        help="the fixed r that adaptive exits are compared with (their maximum)",
    )
    p.add_argument("--no-twin", action="store_true", help="skip the parameter-matched twin")
    p.add_argument("--no-depth-matched", action="store_true", help="skip the depth-matched non-recurrent model")
    p.add_argument(
        "--threads", type=int, default=d.threads, help="CPU threads per model (1: the same numbers on every machine)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="processes the models train in side by side (0: one per model; the numbers do not depend on it)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    e = p.add_argument_group("experiments (--experiment retrofit, gate or lora; docs/experiments.md)")
    e.add_argument(
        "--experiment",
        default="main",
        choices=EXPERIMENTS,
        help="main: the recurrent model and its baselines; retrofit: a pretrained Llama retrofitted "
        "with recurrence against the same Llama trained on for the same FLOPs; gate: a looped "
        "model with Ouro's learned exit gate against the recurrent model's KL exits; lora: the recurrent "
        "model adapted to new moves with LoRA at randomized and at fixed depth, and fully fine-tuned",
    )
    r, g, lo = RetrofitSettings(), GateSettings(), LoraSettings()
    e.add_argument(
        "--pretrain-steps", type=int, default=r.pretrain_steps, help="retrofit: steps of the Llama's pretraining"
    )
    e.add_argument(
        "--retrofit-steps",
        type=int,
        default=r.steps,
        help="retrofit: steps of the retrofitted model (the control trains for the same FLOPs)",
    )
    e.add_argument("--source-layers", type=int, default=r.source_layers, help="retrofit: the Llama's layers")
    e.add_argument(
        "--split",
        type=_split,
        default=(None, None, None),
        help="retrofit: the Llama's layers of prelude, core and coda, e.g. 0/1/2 or 0/2-3/4 "
        "(default: the first layer, the ones between, the last)",
    )
    e.add_argument(
        "--adapter-init",
        default=r.adapter_init,
        choices=ADAPTER_INITS,
        help="retrofit: the adapter's initialisation (docs/retrofit.md)",
    )
    e.add_argument("--loops", type=int, default=g.loops, help="gate: loops the looped model trains at")
    e.add_argument("--loop-layers", type=int, default=g.layers, help="gate: layers in the looped stack")
    e.add_argument(
        "--exit-loss-beta",
        type=float,
        default=g.exit_loss_beta,
        help="gate: Ouro's entropy weight in the expected exit loss",
    )
    e.add_argument(
        "--gate-thresholds", type=_floats, default=g.thresholds, help="gate: exit thresholds q to try on validation"
    )
    e.add_argument(
        "--no-kl", action="store_true", help="gate: skip training the recurrent model whose KL exits are compared"
    )
    e.add_argument("--base-steps", type=int, default=lo.base_steps, help="lora: steps of the base's training")
    e.add_argument(
        "--adapt-steps", type=int, default=lo.steps, help="lora: steps of each adaptation (LoRA and full fine-tune)"
    )
    e.add_argument("--lora-rank", type=int, default=lo.rank, help="lora: the adapters' rank")
    e.add_argument("--lora-alpha", type=float, default=lo.alpha, help="lora: the adapters' alpha (scale alpha/rank)")
    e.add_argument(
        "--lora-lr",
        type=float,
        default=lo.lora_lr,
        help="lora: AdamW's learning rate for the adapters (the full fine-tune keeps --muon-lr and --lr)",
    )
    e.add_argument("--fixed-r", type=int, default=lo.fixed_r, help="lora: the depth of the fixed-depth LoRA arm")
    for action in p._actions:
        if action.dest in READ_BY:
            takes_effect(action, _read_by(READ_BY[action.dest]))
    p.set_defaults(func=run)


def _read_by(experiments: tuple[str, ...]):
    def why_not(args: argparse.Namespace) -> str | None:
        if args.experiment not in experiments:
            return (
                f"it is an option of --experiment {' and '.join(experiments)}, and this is --experiment "
                f"{args.experiment}"
            )
        return None

    return why_not


def _split(text: str) -> tuple[tuple[int, ...], ...]:
    parts = text.split("/")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected prelude/core/coda layers, e.g. 0/1/2 or 0/2-3/4, got {text!r}")
    try:
        return tuple(tuple(parse_layers(part)) for part in parts)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    # Every option is checked here (DemoConfig) and the report directory is proven writable (run_demo)
    # before any data is drawn or any model trained.
    d = DemoConfig()
    steps = args.steps if args.steps is not None else FULL_STEPS if args.full else d.steps
    num_steps = args.num_steps if args.num_steps is not None else FULL_NUM_STEPS if args.full else d.eval_num_steps
    cfg = DemoConfig(
        task=args.task,
        out_dir=args.out,
        seed=args.seed,
        steps=steps,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        muon_lr=args.muon_lr,
        warmup_steps=args.warmup_steps,
        cooldown_fraction=args.cooldown_fraction,
        curriculum_fraction=args.curriculum_fraction,
        curriculum_start=args.curriculum_start,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        layers=args.layers,
        mean_recurrence=args.mean_recurrence,
        recurrence_sigma=args.recurrence_sigma,
        backprop_depth=args.backprop_depth,
        eval_examples=args.eval_examples,
        eval_num_steps=num_steps,
        exit_criterion=args.exit_criterion,
        exit_thresholds=args.exit_thresholds,
        exit_tolerance=args.exit_tolerance,
        exit_max_steps=args.exit_max_steps,
        train_twin=not args.no_twin,
        train_depth_matched=not args.no_depth_matched,
        threads=args.threads,
        workers=args.workers,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    if cfg.threads > 1 and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        # torch's OpenMP workers busy-wait between parallel regions; on a shared CPU that can slow training
        # many times over. The policy is read when torch loads, so it has to come from the environment.
        print(
            "rdlm demo: note: with --threads > 1 on a shared CPU, run with OMP_WAIT_POLICY=PASSIVE "
            "(same results, no busy-waiting threads)",
            file=sys.stderr,
        )
    if args.experiment != "main":
        return _run_experiment(args, cfg)
    result = run_demo(cfg)
    summary = result.results.get("claims") or result.results.get("validation_perplexity")
    print(json.dumps(summary, indent=2))
    for check in result.results.get("checks", []):
        print(f"{'PASS' if check['holds'] else 'FAIL'}  {check['claim']}  (margin {check['margin']:+.3f})")
    print(
        f"report: {result.out_dir / 'report.md'}  model: {result.out_dir / 'model'}  "
        f"({result.results.get('seconds', 0):.0f} s)"
    )
    return 0


def _run_experiment(args: argparse.Namespace, cfg: DemoConfig) -> int:
    if cfg.task != "permutations" and args.experiment != "main":
        raise ValueError(f"--experiment {args.experiment} runs on the permutations task (got --task {cfg.task})")
    if args.experiment == "retrofit":
        from rdlm.demo.retrofit_demo import run_retrofit_experiment

        prelude, core, coda = args.split
        exp = RetrofitSettings(
            source_layers=args.source_layers,
            prelude=prelude,
            core=core,
            coda=coda,
            adapter_init=args.adapter_init,
            pretrain_steps=args.pretrain_steps,
            steps=args.retrofit_steps,
        )
        result = run_retrofit_experiment(cfg, exp)
    elif args.experiment == "lora":
        from rdlm.demo.lora_demo import run_lora_experiment

        lora = LoraSettings(
            base_steps=args.base_steps,
            steps=args.adapt_steps,
            rank=args.lora_rank,
            alpha=args.lora_alpha,
            lora_lr=args.lora_lr,
            fixed_r=args.fixed_r,
        )
        if args.num_steps is None and not args.full:
            cfg = dataclasses.replace(cfg, eval_num_steps=LORA_NUM_STEPS)
        result = run_lora_experiment(cfg, lora)
    else:
        from rdlm.demo.gate_demo import run_gate_experiment

        gate = GateSettings(
            loops=args.loops,
            layers=args.loop_layers,
            exit_loss_beta=args.exit_loss_beta,
            thresholds=args.gate_thresholds,
            compare_kl=not args.no_kl,
        )
        result = run_gate_experiment(cfg, gate)
    print(json.dumps(result.results["claims"], indent=2))
    for check in result.results["checks"]:
        print(f"{'PASS' if check['holds'] else 'FAIL'}  {check['claim']}  (margin {check['margin']:+.3f})")
    print(f"report: {result.out_dir / 'report.md'}  ({result.results['seconds']:.0f} s)")
    return 0
