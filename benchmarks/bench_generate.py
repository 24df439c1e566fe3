"""Generation speed: prefill and decode tokens/s, achieved FLOP/s as a fraction of a matmul peak measured
in the same process, for presets with random weights, at several r and in every decoding mode.

    python benchmarks/bench_generate.py --presets small
    python benchmarks/bench_generate.py --presets huginn-0125 --steps 4 --modes fixed \
        --prompt-length 4 --new-tokens 3 --dtype bfloat16          # CPU: a few tokens only (7 GB of bf16)
    python benchmarks/bench_generate.py --presets huginn-0125 --device cuda --dtype bfloat16 \
        --batch 64 --prompt-length 512 --new-tokens 512           # the paper's throughput setting

Modes: fixed (r iterations per token), adaptive (KL exit, r as the maximum), shared (KV-cache sharing with
k = --cache-slots), speculative (draft with max(1, r/4) iterations, verify with r; batch 1).
"ms/tok early/late": mean decode time of the first and last quarter of the new tokens; equal numbers
mean a token's cost does not grow with the tokens before it (beyond attention itself).
FLOPs count matmuls only (2 per multiply-add, attention scores and values included), from the work the
mode actually did (iterations run per token, coda per iteration for the KL exit, draft and verify).
This is a script, not a test.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.generate import GenerationConfig, TokenEvent, generate
from rdlm.model import rope_tables

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_random(preset: str, dtype: torch.dtype, device: str) -> RecurrentDepthLM:
    """Random weights allocated directly in `dtype` (Huginn's 3.5B parameters in fp32 would take 14 GB)."""
    config = RDLMConfig.from_preset(preset)
    with torch.device("meta"):
        model = RecurrentDepthLM(config)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 or name.endswith("qk_bias"):
                param.fill_(1.0 if param.ndim == 1 else 0.0)
            else:  # normal instead of truncated normal: cheaper, and timing does not care
                param.normal_(0.0, model.init_std, generator=gen)
    cos, sin = rope_tables(config.head_dim, config.context_length, config.rope_base)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval()


def layer_flops(c: RDLMConfig, context: float) -> float:
    """Matmul FLOPs of one layer for one token attending to `context` keys."""
    h = c.hidden_size
    return 2 * (4 * h * h + 3 * h * c.intermediate_size) + 4 * h * context


def token_flops(c: RDLMConfig, core_iterations: float, coda_calls: float, context: float) -> float:
    h = c.hidden_size
    adapter = 2 * (2 * h) * h if c.injection == "concat" else 0
    core = c.core_layers * layer_flops(c, context) + adapter
    coda = c.coda_layers * layer_flops(c, context) + 2 * c.hidden_size * c.vocab_size
    return c.prelude_layers * layer_flops(c, context) + core_iterations * core + coda_calls * coda


def matmul_peak(dtype: torch.dtype, device: str, size: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_mode(model, mode: str, r: int, args) -> dict:
    c = model.config
    extra: dict = {}
    if mode == "adaptive":
        extra = dict(exit_criterion="kl", min_steps=2)
    elif mode == "shared":
        extra = dict(cache_strategy="shared", cache_slots=min(args.cache_slots, r))
    elif mode == "speculative":
        extra = dict(draft_steps=max(1, r // 4), draft_length=args.draft_length)
    batch = 1 if mode == "speculative" else args.batch
    config = GenerationConfig(num_steps=r, max_new_tokens=args.new_tokens, seed=0, **extra)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, c.vocab_size, (batch, args.prompt_length), generator=gen).tolist()
    times: list[float] = []

    def clock(event: TokenEvent) -> None:
        if event.row == 0:
            times.append(time.perf_counter())

    result = generate(model, prompts, config, on_token=clock)
    new = sum(len(t) for t in result.tokens)
    decoded = new - batch  # the first token of each row comes from the prefill
    mean_steps = sum(s for row in result.steps for s in row[1:]) / max(decoded, 1)
    context = args.prompt_length + args.new_tokens / 2
    prefill_flops = batch * args.prompt_length * token_flops(c, r, 1, args.prompt_length / 2)
    if mode == "speculative":
        # every drafted token: prelude, N iterations, coda; then verification: r - N iterations, coda
        n = config.draft_steps
        decode_flops = result.drafted * (token_flops(c, n, 1, context) + token_flops(c, r - n, 1, context)
                                         - c.prelude_layers * layer_flops(c, context))
    else:
        coda_calls = mean_steps if mode == "adaptive" else 1
        decode_flops = decoded * token_flops(c, mean_steps, coda_calls, context)
    gaps = [b - a for a, b in zip(times, times[1:])]
    quarter = max(1, len(gaps) // 4)
    return dict(
        prefill_tps=batch * args.prompt_length / result.prefill_seconds,
        decode_tps=decoded / result.decode_seconds if decoded else float("nan"),
        steps=mean_steps,
        flops=(prefill_flops + decode_flops) / (result.prefill_seconds + result.decode_seconds),
        early=1e3 * sum(gaps[:quarter]) / quarter if gaps else float("nan"),
        late=1e3 * sum(gaps[-quarter:]) / quarter if gaps else float("nan"),
        cache=result.cache_bytes / 2 ** 20,
        accept=result.acceptance_rate,
        batch=batch,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--steps", default="4,8,16,32", help="comma-separated r")
    p.add_argument("--modes", default="fixed,adaptive,shared,speculative")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cache-slots", type=int, default=4)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    peak = matmul_peak(dtype, args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"device {name} | {args.dtype} | matmul peak {peak / 1e9:.1f} GFLOP/s (1024^3, same process) | "
          f"prompt {args.prompt_length} | new tokens {args.new_tokens} | batch {args.batch}")
    header = (f"{'preset':<12} {'mode':<11} {'r':>3} {'B':>3} {'prefill tok/s':>13} {'decode tok/s':>12} "
              f"{'iters/tok':>9} {'GFLOP/s':>8} {'% peak':>6} {'ms/tok early/late':>17} {'cache MiB':>9} "
              f"{'accept':>6}")
    print(header)
    print("-" * len(header))
    for preset in args.presets.split(","):
        model = build_random(preset, dtype, args.device)
        for r in [int(s) for s in args.steps.split(",")]:
            for mode in args.modes.split(","):
                if mode == "speculative" and max(1, r // 4) >= r:
                    continue
                m = run_mode(model, mode, r, args)
                accept = f"{m['accept']:.2f}" if m["accept"] is not None else "-"
                print(f"{preset:<12} {mode:<11} {r:>3} {m['batch']:>3} {m['prefill_tps']:>13.1f} "
                      f"{m['decode_tps']:>12.1f} {m['steps']:>9.1f} {m['flops'] / 1e9:>8.2f} "
                      f"{100 * m['flops'] / peak:>6.1f} {m['early']:>8.2f}/{m['late']:<8.2f} "
                      f"{m['cache']:>9.2f} {accept:>6}", flush=True)
        del model


if __name__ == "__main__":
    main()
