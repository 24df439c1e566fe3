"""Generation speed against the number of CPU threads, on an idle machine and beside a CPU-burning
process: the measurement behind the inference commands' default `--threads` (rdlm.resources.default_threads).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_threads.py                 # the project's setting
    python benchmarks/bench_threads.py --policies PASSIVE,unset --threads 1,2,default,rdlm --repeats 2

Each cell is a fresh process (OpenMP reads its wait policy once, when torch loads it): the `small` preset
(or --preset) with random weights greedily decodes --new-tokens tokens at r = --steps for a batch of 1 and of
16 prompts; the cell is the decode tokens/s of the best of --repeats runs. "loaded" runs the same beside one
process that spins a core for the whole measurement, as other work on a shared machine would. `default`
is torch's own thread count (the number of cores), `rdlm` the inference commands' default
(rdlm.resources.default_threads). One policy's table takes about a minute on 2 cores.
This is a script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CELL = """
import json, sys, time, torch
from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.generate import GenerationConfig, generate
threads, batches, new, steps, repeats, preset, overrides = json.loads(sys.argv[1])
torch.manual_seed(0)
model = RecurrentDepthLM(RDLMConfig.from_preset(preset, **overrides)).eval()
if threads == "rdlm":
    from rdlm.resources import use_threads
    use_threads(model)
elif threads != "default":
    torch.set_num_threads(threads)
config = GenerationConfig(num_steps=steps, max_new_tokens=new, init_scale=0.0)
result = {"threads": torch.get_num_threads(), "parameters": model.num_parameters()}
for batch in batches:
    prompts = [[1 + (7 * row + j) % 500 for j in range(16)] for row in range(batch)]
    generate(model, prompts, GenerationConfig(num_steps=steps, max_new_tokens=2, init_scale=0.0))  # warm-up
    best = 0.0
    for _ in range(repeats):
        out = generate(model, prompts, config)
        best = max(best, batch * (new - 1) / out.decode_seconds)
    result[str(batch)] = best
print(json.dumps(result))
"""


def burner() -> subprocess.Popen:
    """A process that keeps one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def cell(threads: str, policy: str, loaded: bool, args) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if policy == "unset":
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = policy
    spec = [threads if threads in ("default", "rdlm") else int(threads), args.batch, args.new_tokens, args.steps,
            args.repeats, args.preset, dict(args.set)]
    competitor = burner() if loaded else None
    try:
        out = subprocess.run([sys.executable, "-c", CELL, json.dumps(spec)], env=env, check=True,
                             capture_output=True, text=True).stdout
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,default,rdlm",
                        help="thread counts; default: torch's own, rdlm: rdlm.resources.use_threads' choice")
    parser.add_argument("--policies", default=os.environ.get("OMP_WAIT_POLICY", "unset"),
                        help="OMP_WAIT_POLICY values to run (PASSIVE, ACTIVE, unset); default: this shell's")
    parser.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16],
                        help="batch sizes")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per prompt")
    parser.add_argument("--steps", type=int, default=4, help="core iterations r per token")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell; the best is kept")
    parser.add_argument("--preset", default="small", help="the model's preset (random weights)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        type=lambda s: (s.split("=")[0], json.loads(s.split("=")[1])),
                        help="override a preset field, e.g. --set hidden_size=768")
    args = parser.parse_args()
    print(f"cores {os.cpu_count()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.preset} preset{' ' + str(dict(args.set)) if args.set else ''}, r = {args.steps}, "
          f"{args.new_tokens} new tokens; decode tok/s (best of {args.repeats})")
    header = f"{'policy':8} {'load':7} {'threads':>8}" + "".join(f" {'batch ' + str(b):>10}" for b in args.batch)
    print(header)
    start = time.perf_counter()
    for policy in args.policies.split(","):
        for loaded in (False, True):
            for threads in args.threads.split(","):
                row = cell(threads, policy, loaded, args)
                label = f"{threads}={row['threads']}" if threads in ("default", "rdlm") else threads
                print(f"{policy:8} {'loaded' if loaded else 'idle':7} {label:>8}"
                      + "".join(f" {row[str(b)]:10.1f}" for b in args.batch), flush=True)
    print(f"({row['parameters'] / 1e6:.1f}M parameters; {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
