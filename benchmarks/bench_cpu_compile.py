"""The CPU's compiled decode step, its two per-machine choices measured on the machine at hand
(docs/generation.md, "Compiled decoding on the CPU"): the intra-op threads of a small batch's compiled step
(rdlm.inference.execution.cpu_compile.SINGLE_THREAD_ROWS) and dynamo's guard check at each compiled call.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu_compile.py threads --batches 1,8 --rounds 3
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu_compile.py guards --rows 1,4,8 --batches 1,4 --rounds 8

threads: random `--preset` weights (seed 0) greedily decode 32 new tokens from 64-token prompts at r = `-r`,
compiled on one thread (at any batch; the policy up to SINGLE_THREAD_ROWS rows), compiled on all of `--threads`,
and eager, the three alternated in one process for `--rounds` rounds per batch size; prints the tokens/s of each
round and whether every mode gave the same tokens.

guards: the compiled step with dynamo's full guard check at every call against the differentiating guards only
(the default: `Compiled` takes `torch.compiler.set_stance(skip_guard_eval_unsafe=True)` for shapes it has run),
switched through the module's SKIP_GUARDS: the compiled core iteration alone in alternated blocks of 50 calls at
each of `--rows` decoding rows, then whole generations at each of `--batches`, alternated for `--rounds` rounds.

The CPU's name and the load average are printed beside every figure; compile time is left out (each shape is
compiled before the timed runs). This is a script, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rdlm import build_model
from rdlm.demo.run import cpu_model
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.execution import cpu_compile
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate

NEW_TOKENS = 32


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * j + 13 * i) % 1000 + 1 for j in range(64)] for i in range(batch)]


def alternated(modes: dict, batch: int, rounds: int) -> dict[str, list[float]]:
    """Decode tokens/s of each mode (`modes[name]()`: a GenerationResult) per round, in turn and in reverse order
    every other round; each mode run once first (compiles, and the tokens compared)."""
    first = {name: run() for name, run in modes.items()}
    same = len({str(result.tokens) for result in first.values()}) == 1
    print(f"batch {batch}: every mode gave the same tokens: {same}", flush=True)
    tps: dict[str, list[float]] = {name: [] for name in modes}
    for k in range(rounds):
        for name in list(modes) if k % 2 == 0 else list(modes)[::-1]:
            result = modes[name]()
            tps[name].append(batch * (NEW_TOKENS - 1) / result.decode_seconds)
        rates = ", ".join(f"{n} {t[-1]:.1f} tok/s" for n, t in tps.items())
        print(f"batch {batch} round {k}: {rates} ({load()})", flush=True)
    return tps


def with_setting(name: str, value, model, batch_prompts, config, compiled: bool = True):
    """A run for `alternated`: `generate` with cpu_compile's module setting `name` at `value` (restored after)."""
    def run():
        before = getattr(cpu_compile, name)
        setattr(cpu_compile, name, value)
        try:
            return generate(model, batch_prompts, config, engine=EngineArgs(compile=compiled))
        finally:
            setattr(cpu_compile, name, before)
    return run


def print_ratios(label: str, over: list[float], under: list[float]) -> None:
    ratios = [a / b for a, b in zip(over, under, strict=True)]
    print(f"{label} per round " + " / ".join(f"{x:.2f}" for x in ratios) + f", median {statistics.median(ratios):.2f}",
          flush=True)


def threads(model, args) -> None:
    torch.set_num_threads(args.threads)
    single, many = "compiled, 1 thread", f"compiled, {args.threads} threads"
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_steps=args.r, temperature=0.0)
    for batch in args.batches:
        batch_prompts = prompts(batch)
        rows = cpu_compile.SINGLE_THREAD_ROWS
        modes = {single: with_setting("SINGLE_THREAD_ROWS", max(rows, batch), model, batch_prompts, config),
                 many: with_setting("SINGLE_THREAD_ROWS", 0, model, batch_prompts, config),
                 "eager": with_setting("SINGLE_THREAD_ROWS", rows, model, batch_prompts, config, compiled=False)}
        tps = alternated(modes, batch, args.rounds)
        print_ratios(f"batch {batch}: 1 thread / {args.threads} threads", tps[single], tps[many])


def guards(model, args) -> None:
    torch.set_num_threads(args.threads)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_steps=args.r, temperature=0.0)
    for rows in args.rows:
        batch = ContinuousBatch(model, max_batch=rows, max_length=128, compile=True)
        for prompt in prompts(rows):
            batch.add(prompt, GenerationConfig(max_new_tokens=60, num_steps=args.r, temperature=0.0))
        for _ in range(3):
            batch.step()  # the prompts prefilled, every row decoding
        step = batch.step_runner.static_step
        keys, span = step.keys(96), step.span(rows)
        times: dict[bool, list[float]] = {True: [], False: []}
        torch.set_num_threads(1)  # as the engine runs a small batch's compiled step
        try:
            with torch.inference_mode():
                step.compiled(keys, span)  # (compiled here if it was not)
                for block in range(args.blocks):
                    for skip in (True, False) if block % 2 == 0 else (False, True):
                        cpu_compile.SKIP_GUARDS = skip
                        t0 = time.perf_counter()
                        for _ in range(50):
                            step.compiled(keys, span)
                        times[skip].append((time.perf_counter() - t0) / 50 * 1e6)
        finally:
            cpu_compile.SKIP_GUARDS = True
            torch.set_num_threads(args.threads)
        full, skipped = statistics.median(times[False]), statistics.median(times[True])
        print(f"core iteration, {rows} rows: full guard check {full:.0f} us, differentiating guards only {skipped:.0f} "
              f"us, {full / skipped:.3f}x ({load()})", flush=True)

    for batch in args.batches:
        batch_prompts = prompts(batch)
        modes = {"differentiating guards": with_setting("SKIP_GUARDS", True, model, batch_prompts, config),
                 "full check": with_setting("SKIP_GUARDS", False, model, batch_prompts, config)}
        tps = alternated(modes, batch, args.rounds)
        print_ratios(f"decode, batch {batch}: differentiating / full", tps["differentiating guards"], tps["full check"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("threads", "guards"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("-r", type=int, default=32, help="core iterations per token")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--rows", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4, 8],
                        help="guards: decoding rows of the core iteration alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=30, help="guards: alternated blocks of 50 calls")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    if not cpu_compile.compile_allowed():
        raise SystemExit(f"{cpu_compile.COMPILE_ENV}=0 turns compiling off: unset it to measure the compiled step")
    print(f"{cpu_model()}, torch {torch.__version__}, {args.preset}, r = {args.r}, {args.threads} threads ({load()})")
    model = build_model(args.preset, seed=0).eval()
    (threads if args.what == "threads" else guards)(model, args)


if __name__ == "__main__":
    main()
