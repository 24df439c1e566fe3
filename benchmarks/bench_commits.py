"""Decode and serving speed of two checkouts of rdlm, alternated in one run: is a change (a restructure, a
refactor) within noise? Each measurement is a fresh process that imports rdlm from one tree, so the two never
share a process or a warm cache; the trees take turns, round after round, and each workload reports the best
tokens/s of each tree and their ratio (this tree over the other).

    git worktree add /tmp/rdlm-base <commit>            # the other checkout
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_commits.py --base /tmp/rdlm-base --rounds 5

Workloads (random weights of a preset, float32 on the CPU):
- `decode b1 r4`, `decode b1 r32`, `decode b1 r32 kl`, `decode b16 r32`: `generate` (the offline batch:
  lockstep tokens), prompt 16, 32 new tokens;
- `serve mix`: a `ContinuousBatch` as `rdlm serve` configures it (looks every 4 steps, a coda waits up to 8),
  16 requests of mixed depth settings (fixed r, a KL exit, a shared cache, r 8..32) joining over the first
  steps, 4 rows; tokens/s over the whole run.
This is a script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, random, sys, time
import torch
torch.set_num_threads(THREADS)
from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.generate import GenerationConfig, generate

torch.manual_seed(0)
model = RecurrentDepthLM(RDLMConfig.from_preset(PRESET)).eval()
name, vocab = WORKLOAD, model.config.vocab_size
rng = random.Random(0)


def decode(batch, r, criterion):
    prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(batch)]
    config = GenerationConfig(num_steps=r, max_new_tokens=32, exit_criterion=criterion,
                              exit_threshold=5e-4 if criterion else None)
    def run():
        t0 = time.perf_counter()
        result = generate(model, prompts, config)
        return sum(len(t) for t in result.tokens), time.perf_counter() - t0
    return run


def serve():
    configs = [dict(num_steps=16), dict(num_steps=32, exit_criterion="kl", exit_threshold=5e-4),
               dict(num_steps=24, cache_strategy="shared", cache_slots=4), dict(num_steps=8)]
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(4, 24))],
                 GenerationConfig(max_new_tokens=24, seed=k, **configs[k % 4]), k // 2) for k in range(16)]
    def run():
        batch = ContinuousBatch(model, max_batch=4, max_length=64, num_slots=32, exit_sync_every=4, coda_every=8)
        pending, step, tokens = list(requests), 0, 0
        t0 = time.perf_counter()
        while pending or batch.busy:
            while pending and pending[0][2] <= step:
                prompt, config, _ = pending.pop(0)
                batch.add(prompt, config)
            tokens += len(batch.step())
            step += 1
        return tokens, time.perf_counter() - t0
    return run


run = {"decode b1 r4": lambda: decode(1, 4, None), "decode b1 r32": lambda: decode(1, 32, None),
       "decode b1 r32 kl": lambda: decode(1, 32, "kl"), "decode b16 r32": lambda: decode(16, 32, None),
       "serve mix": serve}[name]()
run()   # warm-up
best = 0.0
for _ in range(REPS):
    tokens, seconds = run()
    best = max(best, tokens / seconds)
print(json.dumps({"tokens_per_s": best}))
"""

WORKLOADS = ("decode b1 r4", "decode b1 r32", "decode b1 r32 kl", "decode b16 r32", "serve mix")


def measure(tree: Path, workload: str, preset: str, threads: int, reps: int) -> float:
    code = (CHILD.replace("THREADS", str(threads)).replace("PRESET", repr(preset))
            .replace("WORKLOAD", repr(workload)).replace("REPS", str(reps)))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{workload} failed in {tree}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--preset", default="small")
    p.add_argument("--rounds", type=int, default=3, help="turns of each tree per workload")
    p.add_argument("--reps", type=int, default=2, help="timed runs per process (after a warm-up); best kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args()
    trees = {"this": ROOT, "base": args.base.resolve()}
    print(f"# {args.preset}, float32, {args.threads} threads; load average before: {os.getloadavg()}", flush=True)
    print(f"# this: {trees['this']}   base: {trees['base']}", flush=True)
    print("| workload | this tok/s | base tok/s | this / base |\n|---|---|---|---|", flush=True)
    for workload in args.workloads.split(","):
        best = {"this": 0.0, "base": 0.0}
        for turn in range(args.rounds):
            for side in (("this", "base") if turn % 2 == 0 else ("base", "this")):
                best[side] = max(best[side], measure(trees[side], workload, args.preset, args.threads, args.reps))
        print(f"| {workload} | {best['this']:.1f} | {best['base']:.1f} | {best['this'] / best['base']:.3f} |",
              flush=True)
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
