"""The server's batch in this process, without HTTP: a closed loop of clients against `ContinuousBatch`, the
eager step against the static one, and offline `generate` on the same prompts.

    python benchmarks/bench_batch.py --preset huginn-0125 --device cuda --dtype bfloat16 --batch 16,64 --seconds 8
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_batch.py --preset small --batch 8 --seconds 10 --profile

Every row is a client: when its request finishes, its next one arrives 0 to --stagger steps later (as
requests over HTTP do), so prompts keep joining a busy batch. A quarter of --seconds warms up (CUDA graph
captures included), the rest is measured. Printed per batch size and step (eager, static): tokens/s,
milliseconds per step, model calls per step by kind (on CUDA a static call replays a graph and is not
counted), the iterations run several to a call, and with --profile the seconds per phase of a step (the
device synchronized around each phase, and around the prompts' own core calls). Random weights in
--dtype (no checkpoint needed), r fixed: this measures the engine, not exits. This is a script, not a test.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import build_random  # noqa: E402  (this folder's: random weights in the dtype)

from rdlm.inference.batching import ContinuousBatch  # noqa: E402
from rdlm.inference.generate import GenerationConfig, generate  # noqa: E402
from rdlm.inference.execution.graphs import sync  # noqa: E402
from rdlm.model import dtypes  # noqa: E402

CALLS = ("embed", "step", "step_packed", "readout")


def counted(batch: ContinuousBatch, profile: bool) -> tuple[collections.Counter, list[float]]:
    """Count the batch's model calls by kind; with `profile`, time the prompts' own core calls."""
    calls, packed = collections.Counter(), [0.0]
    runner = batch.calls
    for name in CALLS:
        call = getattr(runner, name)

        def wrapped(*args, _call=call, _name=name, **kwargs):
            calls[_name] += 1
            if not (profile and _name == "step_packed"):
                return _call(*args, **kwargs)
            sync(batch.device)
            t0 = time.perf_counter()
            out = _call(*args, **kwargs)
            sync(batch.device)
            packed[0] += time.perf_counter() - t0
            return out

        setattr(runner, name, wrapped)
    return calls, packed


def closed_loop(args, model, prompts: list[list[int]], config: GenerationConfig, rows: int, static: bool,
                profile: bool) -> None:
    batch = ContinuousBatch(model, rows, args.max_length, max(args.num_steps, 32), compile=static, profile=profile,
                            prefill_chunk=args.prefill_chunk, exit_sync_every=args.sync_every,
                            coda_every=args.coda_every)
    calls, packed = counted(batch, profile)
    rng, due, sent = random.Random(0), [], 0
    for _ in range(rows):
        batch.add(prompts[sent % len(prompts)], config)
        sent += 1
    tokens = steps = 0
    sync(batch.device)
    t0, mark = time.perf_counter(), None
    while time.perf_counter() - t0 < args.seconds:
        for event in batch.step():
            tokens += 1
            if event.finish_reason is not None:
                due.append(steps + rng.randint(0, args.stagger))
        for when in [d for d in due if d <= steps]:
            due.remove(when)
            batch.add(prompts[sent % len(prompts)], config)
            sent += 1
        steps += 1
        if mark is None and time.perf_counter() - t0 > args.seconds / 4:
            sync(batch.device)
            mark = (time.perf_counter(), tokens, steps, dict(calls), batch.step_runner.static_step.fused_iterations)
            batch.take_timings()
            packed[0] = 0.0
    sync(batch.device)
    if mark is None:
        raise SystemExit("--seconds is too short to measure anything after the warm-up")
    t1 = time.perf_counter()
    start, tokens0, steps0, calls0, fused0 = mark
    seconds, n = t1 - start, steps - steps0
    per_step = ", ".join(f"{name} {(calls[name] - calls0.get(name, 0)) / n:.2f}" for name in CALLS)
    print(f"  {'static' if static else 'eager '} step{', profiled' if profile else ''}: "
          f"{(tokens - tokens0) / seconds:.1f} tok/s, {seconds / n * 1e3:.2f} ms/step, calls per step: {per_step}; "
          f"iterations run several to a call: {batch.step_runner.static_step.fused_iterations - fused0}", flush=True)
    phases = batch.take_timings()
    for phase, spent in sorted(phases.items(), key=lambda item: -item[1]):
        print(f"      {phase:30s} {spent:7.2f} s  {spent / seconds:6.1%}")
    if phases:
        print(f"      {'host bookkeeping (the rest)':30s} {seconds - sum(phases.values()):7.2f} s; "
              f"the prompts' own core calls {packed[0]:.2f} s of the core iteration")


def timed_generate(model, ids: list[list[int]], config: GenerationConfig, seconds: float = 0.0, engine=None):
    """(tokens/s, result) of offline `generate` on `ids`, after one warm-up run (on CUDA the graphs' capture):
    the same batch generated again until `seconds` have passed (at least once), its tokens over the time.
    `engine`: the engine's settings (EngineArgs)."""
    device = next(model.parameters()).device
    generate(model, ids, config, engine=engine)
    sync(device)
    tokens, t0 = 0, time.perf_counter()
    while True:
        result = generate(model, ids, config, engine=engine)
        sync(device)
        tokens += sum(len(t) for t in result.tokens)
        if time.perf_counter() - t0 >= seconds:
            return tokens / (time.perf_counter() - t0), result


def offline(model, prompts: list[list[int]], config: GenerationConfig, rows: int) -> None:
    tps, _ = timed_generate(model, [prompts[k % len(prompts)] for k in range(rows)], config)
    print(f"  offline generate: {tps:.1f} tok/s (one batch of {rows})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model shape, random weights (default small)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=dtypes.CHOICES)
    p.add_argument("--batch", default="8", help="rows = clients; comma-separated for several")
    p.add_argument("--num-steps", "-r", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-length", type=int, default=96)
    p.add_argument("--seconds", type=float, default=8.0, help="per measurement, a quarter of it warm-up")
    p.add_argument("--stagger", type=int, default=4, help="steps a client may take to send its next request")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--coda-every", type=int, default=8)
    p.add_argument("--steps", choices=("eager", "static", "both"), default="both")
    p.add_argument("--profile", action="store_true", help="also a profiled run of the static step")
    args = p.parse_args()
    model = build_random(args.preset, dtypes.resolve_dtype(args.dtype), args.device)
    vocab = model.config.vocab_size
    prompts = [[1 + (7 * k + j) % (vocab - 10) for j in range(5 + k % 4)] for k in range(64)]
    config = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens)
    statics = {"eager": [False], "static": [True], "both": [False, True]}[args.steps]
    for rows in (int(b) for b in args.batch.split(",")):
        print(f"{args.preset} {args.device} {args.dtype} | batch {rows} | r {args.num_steps} | {args.new_tokens} new "
              f"tokens | prefill chunk {args.prefill_chunk} | load {os.getloadavg()[0]:.2f}", flush=True)
        offline(model, prompts, config, rows)
        for static in statics:
            closed_loop(args, model, prompts, config, rows, static, profile=False)
        if args.profile:
            closed_loop(args, model, prompts, config, rows, True, profile=True)
        print(f"  load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
