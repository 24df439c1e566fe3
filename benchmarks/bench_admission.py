"""How long prompts admitted together take to reach their first tokens in the continuous batch (the step that
admits them into an idle batch runs their prefill through to the first tokens), split into chunks by length
(`length_groups` with the scheduler's CHUNK_COST, the default) against one chunk padded to the longest prompt
(the behaviour before issue #64's chunking). The two take turns, round after round, in one process on one
compiled engine; each round draws its prompts afresh from the seed, and both policies get the same prompts.

    python benchmarks/bench_admission.py                          # 8 prompts of 3-60 tokens, r = 8, `small`
    python benchmarks/bench_admission.py --prompts 16 --lengths 3-120 -r 32 --seed 12

`--compare prompts` compares instead the prompts' compiled iteration (`CompiledPrompts`, the CPU's compiled
engine) against the eager prompt calls, in the same engine (its other compiled parts unchanged), split by length
in both.

Prints the median admission step of each policy, their ratio (the first over the second: below 1 is faster), whether
every request's greedy tokens were equal under both, the load average and the CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ONE_CHUNK = 10**9  # a chunk cost no split can pay back: every prompt in one chunk


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="random weights of this preset")
    p.add_argument("--prompts", type=int, default=8, help="prompts admitted together (also the batch's rows)")
    p.add_argument("--lengths", default="3-60", help="prompt lengths, drawn uniformly from LO-HI")
    p.add_argument("-r", "--num-steps", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6, help="turns of each policy")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--compile", choices=("on", "off"), default="on", help="the CPU's compiled step, as rdlm serve")
    p.add_argument("--compare", choices=("chunks", "prompts"), default="chunks",
                   help="chunks: split by length against one chunk; prompts: the prompts' iteration compiled "
                        "against eager (needs --compile on)")
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.lengths.split("-"))
    if not 1 <= lo <= hi:
        p.error(f"--lengths must be LO-HI with 1 <= LO <= HI, got {args.lengths!r}")

    import torch

    import rdlm
    from rdlm.demo.run import cpu_model
    from rdlm.inference.batching import ContinuousBatch
    from rdlm.inference.params import GenerationConfig
    from rdlm.inference.scheduling import scheduler

    CHUNK_COST = scheduler.CHUNK_COST

    torch.manual_seed(0)
    model = rdlm.build_model(args.preset).eval()
    if hi + args.new_tokens > model.config.context_length:
        p.error(f"prompts of up to {hi} tokens do not fit the context of {model.config.context_length}")
    batch = ContinuousBatch(
        model, max_batch=args.prompts, max_length=model.config.context_length, compile=args.compile == "on"
    )
    compile_seconds = batch.warm_up()
    config = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens)
    calls = batch.step_runner.calls
    compiled_prompts = calls.compiled_prompts
    if args.compare == "prompts" and compiled_prompts is None:
        p.error("--compare prompts needs the compiled engine (--compile on, RDLM_COMPILE not 0)")
    policies: dict = (
        {"compiled prompts": compiled_prompts, "eager prompts": None}
        if args.compare == "prompts"
        else {"split by length": scheduler.CHUNK_COST, "one chunk": ONE_CHUNK}
    )
    times: dict[str, list[float]] = {name: [] for name in policies}
    tokens: dict[str, list[list[list[int]]]] = {name: [] for name in policies}
    rng = random.Random(args.seed)
    load_before = os.getloadavg()
    for k in range(args.rounds + 1):  # round 0 warms both policies up and is not counted
        prompts = [
            [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(args.prompts)
        ]
        order = list(policies) if k % 2 == 0 else list(policies)[::-1]
        for name in order:
            if args.compare == "prompts":
                calls.compiled_prompts = policies[name]
            else:
                scheduler.CHUNK_COST = policies[name]
            ids = [batch.add(prompt, config) for prompt in prompts]
            start = time.perf_counter()
            events = batch.step()
            seconds = time.perf_counter() - start
            while batch.busy:
                events += batch.step()
            by_request = {i: [e.token for e in events if e.request == i] for i in ids}
            if k:
                times[name].append(seconds)
                tokens[name].append([by_request[i] for i in ids])
    scheduler.CHUNK_COST = CHUNK_COST
    calls.compiled_prompts = compiled_prompts
    first, second = (statistics.median(times[name]) for name in policies)
    print(
        f"# {args.preset}, float32, {args.prompts} prompts of {lo}-{hi} tokens, r = {args.num_steps}, seed "
        f"{args.seed}, compiled {args.compile} (warm-up {compile_seconds:.1f} s), {torch.get_num_threads()} threads"
    )
    print(f"# {cpu_model()}; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    for name in policies:
        print(
            f"{name:16} admission step median {statistics.median(times[name]) * 1e3:7.1f} ms "
            f"(rounds: {', '.join(f'{t * 1e3:.0f}' for t in times[name])})"
        )
    a, b = policies
    print(f"{a} / {b}: {first / second:.3f}; the same tokens: {tokens[a] == tokens[b]}")


if __name__ == "__main__":
    main()
