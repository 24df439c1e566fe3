"""rdlm's CPU decode speed beside the paper authors' own research code, on the same weights (issue #56).

    python benchmarks/bench_authors.py                              # small, the six settings, 2 threads
    python benchmarks/bench_authors.py --settings b1r4,b1r32kl,b16r32 --new-tokens 4 --rounds 1 --reps 1

What it measures: decode tokens/s of greedy generation from random prompts (`--prompt-length` tokens,
batch rows different), fp32 on the CPU with `--threads` threads, on one set of random weights of
`--preset` (seeded) saved in the Huginn-0125 layout, which both sides load: rdlm with
`rdlm.load_pretrained`, the authors' `RavenForCausalLM.from_pretrained`. Decode tokens/s is
batch * (N - 1) / (t(N new tokens) - t(1 new token)), each time the best of `--reps` calls (the two
lengths alternating) after one warm-up call of each, so the prefill cancels on both sides alike. Each
measurement is a fresh process; the two sides alternate for `--rounds` rounds per setting and the best
of each side is reported, with the ratio rdlm / authors, the load average around the setting, and the
decode's matmul FLOP/s as a fraction of a large fp32 matmul's measured in the rdlm process (the same
FLOPs per token on both sides: r core iterations and one coda at the mean context prompt + N/2,
`bench_generate.token_flops`; for a KL exit that is the fixed-r work, so there it is an effective rate).

Settings are `b<batch>r<r>` with an optional suffix: `kl` (a KL exit with `--kl-threshold`, r the most
iterations) or `shared` (KV-cache sharing with `--cache-slots` slots), e.g. b1r32kl, b1r32shared.
How the authors' code is driven (raven_modeling_minimal.py, seal-rg/recurrent-pretraining):
- fixed r: `model.generate(ids, GenerationConfig(max_new_tokens=N, do_sample=False), num_steps=r)`, which
  their dispatcher hands to transformers' own `generate` (`--authors-loop minimal`: their
  `generate_minimal` loop instead, reached with `continuous_compute=False`);
- KL exit: the same call with `criterion="kl", exit_threshold=T, max_new_tokens=N`, which dispatches to
  `generate_with_adaptive_compute` (it reads the length from that keyword, not from the config). Its
  cache keeps the default lookup `full`: a later token skips an exited token's missing entries, where
  rdlm reads that token's latest one (their `latest-m4` hard-codes Huginn-0125's layer counts). It
  checks from the first iteration against a uniform distribution, rdlm from the second (min_steps 2),
  so exits can differ: the table shows each side's iterations per token. It runs batches, but a batch
  iterates until every row has exited (their docstring: benchmark adaptive compute at batch 1 only);
- shared cache: `cache_lookup_strategy="latest-m4-compress-s<k * core layers>"`. Their compression
  counts cache entries per layer and hard-codes Huginn-0125's two prelude layers, so on a preset with
  one prelude layer the first core layer of the first iteration keeps an entry of its own (k slots plus
  one layer entry): the same cost to within one layer's entries.

The authors' code is never a dependency of rdlm and is not in this repository: it runs only in a
scratch environment outside it, made once (CPU torch, the versions the conformance fixtures used):

    python3.11 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors
    mkdir -p /work/ref/raven && touch /work/ref/raven/__init__.py
    # from a clone of github.com/seal-rg/recurrent-pretraining:
    cp recpre/raven_modeling_minimal.py recpre/raven_config_minimal.py /work/ref/raven/

`--authors-python` and `--authors-code` name them (defaults above). This is a script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Only the standard library at the top: the authors' side runs this file in an environment with
# torch, transformers and safetensors and without rdlm; each side imports what it needs in its child.

HERE = Path(__file__).resolve()
DEFAULT_SETTINGS = "b1r4,b1r32,b1r32kl,b1r32shared,b16r32,b64r32"
SETTING = re.compile(r"b(\d+)r(\d+)(kl|shared)?")

SCRATCH_ENV = """make it once, outside the repository:
    python3.11 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors"""
AUTHORS_FILES = """put the authors' two files there (github.com/seal-rg/recurrent-pretraining, folder recpre/):
    mkdir -p {code}/raven && touch {code}/raven/__init__.py
    cp recpre/raven_modeling_minimal.py recpre/raven_config_minimal.py {code}/raven/"""


def parse_setting(name: str) -> dict:
    match = SETTING.fullmatch(name)
    if match is None:
        raise SystemExit(f"setting {name!r}: expected b<batch>r<r>, optionally followed by kl or shared")
    batch, steps, mode = match.groups()
    return {"name": name, "batch": int(batch), "steps": int(steps), "mode": mode or "fixed"}


# --------------------------------------------------------------------------------------------------
# The child: one side, one setting, one JSON line. The same timing on both sides.


def decode_rate(call, batch: int, new_tokens: int, reps: int) -> dict:
    """Decode tokens/s from the best times of 1 and N new tokens; one warm-up call of each length, then
    the two lengths alternate, so that a burst of load elsewhere does not fall on one length only."""
    call(1)
    call(new_tokens)
    one = many = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call(1)
        middle = time.perf_counter()
        call(new_tokens)
        one, many = min(one, middle - start), min(many, time.perf_counter() - middle)
    return {"tok_s": batch * (new_tokens - 1) / (many - one), "t_one_s": one, "t_many_s": many}


def random_prompts(vocab_size: int, batch: int, length: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)


def rdlm_child(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(HERE.parents[1]))  # this checkout's rdlm before any installed one
    sys.path.insert(0, str(HERE.parent))
    from bench_generate import matmul_peak, token_flops

    import rdlm
    from rdlm.inference.generate import EngineArgs, GenerationConfig, generate

    torch.set_num_threads(args.threads)
    model = rdlm.load_pretrained(args.weights, dtype=torch.float32).eval()
    prompts = random_prompts(model.config.vocab_size, args.batch, args.prompt_length, args.seed).tolist()
    options: dict = {"num_steps": args.steps}
    if args.mode == "kl":
        options.update(exit_criterion="kl", exit_threshold=args.kl_threshold)
    elif args.mode == "shared":
        options.update(cache_strategy="shared", cache_slots=args.cache_slots)
    engine = EngineArgs(compile=None if args.rdlm_compile == "auto" else args.rdlm_compile == "on")
    mean_steps: dict[int, float] = {}  # per new token, by the call's number of new tokens

    def call(new_tokens: int) -> None:
        with torch.no_grad():
            result = generate(model, prompts, GenerationConfig(max_new_tokens=new_tokens, **options), engine=engine)
        if any(len(row) != new_tokens for row in result.tokens):
            raise RuntimeError(f"rdlm generated {[len(r) for r in result.tokens]} tokens, not {new_tokens}")
        mean_steps[new_tokens] = result.mean_steps

    out = decode_rate(call, args.batch, args.new_tokens, args.reps)
    context = args.prompt_length + args.new_tokens / 2
    out.update(
        mean_steps=mean_steps[args.new_tokens],
        flops_per_token=token_flops(model.config, args.steps, 1, context),
        matmul_peak=matmul_peak(torch.float32, "cpu"),
        torch=torch.__version__,
    )
    return out


def authors_child(args: argparse.Namespace) -> dict:
    import torch
    from raven.raven_modeling_minimal import RavenForCausalLM
    from transformers import GenerationConfig

    torch.set_num_threads(args.threads)
    model = RavenForCausalLM.from_pretrained(args.weights, dtype=torch.float32).eval()
    ids = random_prompts(model.config.vocab_size, args.batch, args.prompt_length, args.seed)
    options: dict = {"num_steps": args.steps}
    if args.mode == "kl":
        options.update(criterion="kl", exit_threshold=args.kl_threshold)
    elif args.mode == "shared":
        slots = args.cache_slots * model.config.n_layers_in_recurrent_block
        options["cache_lookup_strategy"] = f"latest-m4-compress-s{slots}"
    if args.authors_loop == "minimal" and args.mode != "kl":
        options["continuous_compute"] = False  # the dispatcher's key for generate_minimal
    own_loop = args.mode == "kl" or args.authors_loop == "minimal"
    iterations = [0]
    step = model.iterate_one_step

    def counted_step(*a, **k):  # the adaptive loop's core iterations, to report the exits it took
        iterations[0] += 1
        return step(*a, **k)

    def call(new_tokens: int) -> None:
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, use_cache=True)
        length = {"max_new_tokens": new_tokens} if own_loop else {}  # their own loops read only this
        with torch.no_grad():
            out = model.generate(ids, config, **options, **length)
        if out.shape[1] != args.prompt_length + new_tokens:
            raise RuntimeError(f"the authors' code generated {out.shape[1] - args.prompt_length}, not {new_tokens}")

    rate = decode_rate(call, args.batch, args.new_tokens, args.reps)
    mean_steps = float(args.steps)
    if args.mode == "kl":  # one more call, uncounted in the timing, with the core iterations counted
        model.iterate_one_step = counted_step
        call(args.new_tokens)
        mean_steps = iterations[0] / args.new_tokens
    rate.update(mean_steps=mean_steps, torch=torch.__version__)
    return rate


def child_main(args: argparse.Namespace) -> None:
    result = rdlm_child(args) if args.side == "rdlm" else authors_child(args)
    print(json.dumps(result))


# --------------------------------------------------------------------------------------------------
# The parent: weights, alternated rounds, the table.


def child_env(threads: int, pythonpath: str | None) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def run_child(args: argparse.Namespace, side: str, setting: dict, weights: str) -> dict:
    python = sys.executable if side == "rdlm" else args.authors_python
    command = [python, str(HERE), "child", "--side", side, "--weights", weights]
    command += ["--batch", str(setting["batch"]), "--steps", str(setting["steps"]), "--mode", setting["mode"]]
    for name in ("prompt_length", "new_tokens", "threads", "reps", "seed", "kl_threshold", "cache_slots"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--rdlm-compile", args.rdlm_compile, "--authors-loop", args.authors_loop]
    env = child_env(args.threads, str(args.authors_code) if side == "authors" else None)
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} child failed on {setting['name']}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_authors_setup(args: argparse.Namespace) -> None:
    if not Path(args.authors_python).exists():
        raise SystemExit(f"the authors' python {args.authors_python} does not exist; {SCRATCH_ENV}")
    if not (Path(args.authors_code) / "raven" / "raven_modeling_minimal.py").exists():
        raise SystemExit(
            f"no raven/raven_modeling_minimal.py under {args.authors_code}; "
            + AUTHORS_FILES.format(code=args.authors_code)
        )


def make_weights(preset: str, seed: int, directory: str) -> None:
    """The preset's random weights (seeded), saved in the Huginn layout; rdlm's process only."""
    sys.path.insert(0, str(HERE.parents[1]))
    import torch

    from rdlm import RDLMConfig, RecurrentDepthLM
    from rdlm.model.huginn import save_pretrained

    torch.manual_seed(seed)
    save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset(preset)), directory)


def check_authors_load(args: argparse.Namespace, weights: str) -> int:
    """The authors' loader reads these weights: their parameter count."""
    code = (
        "import torch; from raven.raven_modeling_minimal import RavenForCausalLM; "
        f"m = RavenForCausalLM.from_pretrained({weights!r}, dtype=torch.float32); "
        "print(sum(p.numel() for p in m.parameters()))"
    )
    done = subprocess.run(
        [args.authors_python, "-c", code],
        check=False,
        env=child_env(args.threads, str(args.authors_code)),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the authors' RavenForCausalLM.from_pretrained({weights}) failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.split()[-1])


def measure_setting(args: argparse.Namespace, setting: dict, weights: str) -> dict:
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"rdlm": [], "authors": []}
    for _ in range(args.rounds):
        for side in ("rdlm", "authors"):
            runs[side].append(run_child(args, side, setting, weights))
    load_after = os.getloadavg()
    best = {side: max(results, key=lambda r: r["tok_s"]) for side, results in runs.items()}
    peak = max(r["matmul_peak"] for r in runs["rdlm"])
    flops = runs["rdlm"][0]["flops_per_token"]
    return {
        **setting,
        "rdlm_tok_s": best["rdlm"]["tok_s"],
        "authors_tok_s": best["authors"]["tok_s"],
        "ratio": best["rdlm"]["tok_s"] / best["authors"]["tok_s"],
        "rdlm_peak_fraction": best["rdlm"]["tok_s"] * flops / peak,
        "authors_peak_fraction": best["authors"]["tok_s"] * flops / peak,
        "rdlm_mean_steps": best["rdlm"]["mean_steps"],
        "authors_mean_steps": best["authors"]["mean_steps"],
        "flops_per_token": flops,
        "matmul_peak": peak,
        "load_before": load_before,
        "load_after": load_after,
        "runs": runs,
    }


def table(rows: list[dict]) -> str:
    header = (
        "| setting | rdlm tok/s | authors tok/s | rdlm / authors | % peak rdlm / authors "
        "| iterations per token rdlm / authors | load 1 min before / after |"
    )
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['rdlm_tok_s']:.1f} | {r['authors_tok_s']:.1f} | {r['ratio']:.2f} "
            f"| {100 * r['rdlm_peak_fraction']:.1f} / {100 * r['authors_peak_fraction']:.1f} "
            f"| {r['rdlm_mean_steps']:.1f} / {r['authors_mean_steps']:.1f} "
            f"| {r['load_before'][0]:.2f} / {r['load_after'][0]:.2f} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    from rdlm.demo.run import cpu_model  # (the parent runs in rdlm's environment; the children import no rdlm)

    check_authors_setup(args)
    settings = [parse_setting(name) for name in args.settings.split(",") if name]
    with tempfile.TemporaryDirectory(prefix="bench-authors-") as tmp:
        weights = args.weights or str(Path(tmp) / args.preset)
        if not (Path(weights) / "config.json").exists():
            make_weights(args.preset, args.seed, weights)
        authors_parameters = check_authors_load(args, weights)
        rows = []
        for setting in settings:
            rows.append(measure_setting(args, setting, weights))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    rdlm_run = rows[0]["runs"]["rdlm"][0] if rows else {}
    authors_run = rows[0]["runs"]["authors"][0] if rows else {}
    meta = {
        "preset": args.preset,
        "weights": args.weights or "(temporary)",
        "authors_parameters": authors_parameters,
        "cpu": cpu_model(),
        "threads": args.threads,
        "OMP_WAIT_POLICY": "PASSIVE",
        "torch_rdlm": rdlm_run.get("torch"),
        "torch_authors": authors_run.get("torch"),
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "reps": args.reps,
        "kl_threshold": args.kl_threshold,
        "cache_slots": args.cache_slots,
        "rdlm_compile": args.rdlm_compile,
        "authors_loop": args.authors_loop,
    }
    print(
        f"{meta['cpu']}, {args.threads} threads, fp32, OMP_WAIT_POLICY=PASSIVE, torch {meta['torch_rdlm']} (rdlm) / "
        f"{meta['torch_authors']} (authors), preset {args.preset}, prompt {args.prompt_length}, "
        f"{args.new_tokens} new tokens, best of {args.rounds} rounds x {args.reps} reps\n"
    )
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32, help="N (at least 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="timed calls per length, the best kept")
    parser.add_argument("--seed", type=int, default=0, help="of the weights and the prompts")
    parser.add_argument("--kl-threshold", type=float, default=5e-4, help="the KL exit's, on both sides")
    parser.add_argument("--cache-slots", type=int, default=4, help="k of the shared KV cache")
    parser.add_argument("--rdlm-compile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--authors-loop",
        choices=("hf", "minimal"),
        default="hf",
        help="fixed r: transformers' generate (their dispatcher's default) or their generate_minimal",
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["child"]:
        child = argparse.ArgumentParser(prog="bench_authors.py child")
        child.add_argument("--side", choices=("rdlm", "authors"), required=True)
        child.add_argument("--weights", required=True)
        child.add_argument("--batch", type=int, required=True)
        child.add_argument("--steps", type=int, required=True)
        child.add_argument("--mode", choices=("fixed", "kl", "shared"), default="fixed")
        common_arguments(child)
        args = child.parse_args(argv[1:])
        args.child = True
        return args
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", help="a Huginn-layout directory to use (made there if it has no config.json)")
    parser.add_argument("--authors-python", default="/work/refvenv/bin/python")
    parser.add_argument("--authors-code", default="/work/ref", help="the folder holding raven/")
    parser.add_argument("--out", help="write the results here as JSON")
    common_arguments(parser)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode speed is the difference of N and 1 tokens)")
    args.child = False
    return args


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    child_main(arguments) if arguments.child else main(arguments)
