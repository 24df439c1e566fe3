"""Which GEMM the eager linear layers run on this CPU (docs/generation.md, "Which GEMM runs the eager linear
layers"; rdlm.inference.execution.cpu_linear): ATen's (MKL) against oneDNN's, per call and in whole generations.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu_linear.py calls --rows 1,8,64 --threads 1,2
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu_linear.py generate --batches 64,32,16,1 --pairs 3

calls: µs a call of `F.linear` (ATen), of oneDNN's product on the plain weight (what rdlm runs) and on a weight
packed once for it (what rdlm does not keep), for each weight shape of `--preset` at each of `--rows` and `--threads`.

generate: an eager `generate` (random `--preset` weights, seed 0, with a LoRA adapter of `--lora-rank` if given;
`--batches` of prompts of 9-17 tokens drawn from `--seed`, r = `-r`, `--new-tokens` greedy tokens, the whole call
timed, prompt included) with RDLM_CPU_LINEAR=aten against the default measured choice, alternated in `--pairs` pairs
in one process after one run of each; prints each pair's times, the speed-up and whether the tokens were the same.

The CPU's name and the load average are printed beside every figure. This is a script, not a test.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from rdlm import build_model
from rdlm.demo.run import cpu_model
from rdlm.inference.execution import cpu_linear
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate
from rdlm.model.lora import LoraSpec, add_lora, lora_layers


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def per_call_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def calls(args) -> None:
    model = build_model(args.preset)
    shapes = sorted({tuple(layer.weight.shape) for layer in cpu_linear.plain_linears(model)})
    shapes.append((model.config.vocab_size, model.config.hidden_size))  # the head (tied or not)
    print(f"{cpu_model()}, {load()}; µs a call: ATen / oneDNN / oneDNN packed")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            cells = []
            for out_features, in_features in shapes:
                weight, x = torch.randn(out_features, in_features) * 0.05, torch.randn(rows, in_features)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                kernels = ((F.linear, weight), (cpu_linear.onednn_product, weight), (cpu_linear.onednn_product, packed))
                times = [per_call_us(lambda f=f, w=w, x=x: f(x, w, None)) for f, w in kernels]
                cells.append(f"{in_features}x{out_features} " + " / ".join(f"{t:.0f}" for t in times))
            print(f"threads {threads}, rows {rows}: " + "; ".join(cells) + f" ({load()})", flush=True)


def generations(args) -> None:
    torch.manual_seed(0)
    model = build_model(args.preset).eval()
    if args.lora_rank:
        model = add_lora(model, LoraSpec(rank=args.lora_rank))
        for _, layer in lora_layers(model):
            for module in layer.lora_B.values():
                torch.nn.init.normal_(module.weight, std=0.02)  # an adapter that does something (B starts at zero)
    torch.set_num_threads(args.threads)
    config = GenerationConfig(num_steps=args.r, max_new_tokens=args.new_tokens)
    lora = f", a LoRA adapter of rank {args.lora_rank} (never compiled)" if args.lora_rank else ""
    print(
        f"{cpu_model()}, {args.threads} threads, preset {args.preset}{lora}, r = {args.r}, {args.new_tokens} new tokens"
    )
    for batch in args.batches:
        torch.manual_seed(args.seed)
        prompts = [[1] + [int(t) for t in torch.randint(2, 500, (8 + k % 9,))] for k in range(batch)]

        def run(setting: str, prompts=prompts):
            os.environ[cpu_linear.ENV] = setting
            start = time.perf_counter()
            out = generate(model, prompts, config, engine=EngineArgs(compile=False))
            return out.tokens, time.perf_counter() - start

        settings = ("aten", "auto")
        for setting in settings:
            run(setting)  # the measurements of the kernels, and warm caches
        for k in range(args.pairs):
            order = settings if k % 2 == 0 else settings[::-1]
            results = dict(zip(order, (run(setting) for setting in order), strict=True))
            (tokens_a, a), (tokens_b, b) = results["aten"], results["auto"]
            print(
                f"batch {batch} pair {k}: aten {a * 1e3:.0f} ms, measured choice {b * 1e3:.0f} ms,"
                f" speed-up {a / b:.3f}x, the same tokens {tokens_a == tokens_b} ({load()})",
                flush=True,
            )
    os.environ.pop(cpu_linear.ENV, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    sub = parser.add_subparsers(dest="command", required=True)
    per_call = sub.add_parser("calls")
    per_call.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    per_call.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    whole = sub.add_parser("generate")
    whole.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[64, 32, 16, 1])
    whole.add_argument("--pairs", type=int, default=3)
    whole.add_argument("--seed", type=int, default=0, help="of the prompts")
    whole.add_argument("-r", type=int, default=32)
    whole.add_argument("--new-tokens", type=int, default=16)
    whole.add_argument("--threads", type=int, default=2)
    whole.add_argument("--lora-rank", type=int, default=0, help="decode with a LoRA adapter of this rank (0: none)")
    args = parser.parse_args()
    if not cpu_linear.available():
        raise SystemExit("this PyTorch has no oneDNN (mkldnn): nothing to compare")
    calls(args) if args.command == "calls" else generations(args)


if __name__ == "__main__":
    main()
