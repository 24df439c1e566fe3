"""Generation speed: prefill and decode tokens/s against two ceilings measured in the same process (a
matmul peak and the memory bandwidth), for presets with random weights, at several r, batch sizes and
in every decoding mode.

    python benchmarks/bench_generate.py --presets small --threads 2
    python benchmarks/bench_generate.py --presets huginn-0125 --device cuda --dtype bfloat16 \
        --steps 4,32 --batch 1,64 --prompt-length 64 --new-tokens 64 --modes fixed,never  # the issue's table
    python benchmarks/bench_generate.py --presets small --compile both     # static step on and off

Modes: fixed (r iterations per token), adaptive (KL exit, r as the maximum), never (a KL exit that never
fires: the cost of evaluating the criterion), shared (KV-cache sharing with k = --cache-slots),
speculative (draft with max(1, r/4) iterations, verify with r; batch 1).

Columns: "bw %" is the fraction of the bandwidth roofline: the bytes a decode step must read (weights
of every layer call, the un-embedding, and the keys/values attended to) over the bandwidth measured by
a large copy, against the time the step took. "% peak" is achieved matmul FLOP/s (2 per multiply-add,
from the work the mode actually did) over a large matmul's. "compile s" is the time spent capturing the
static decode step (not part of decode tok/s). For adaptive modes "speed-up" is the realized decode
speed-up over fixed r in the same run and "ideal" is r / mean iterations per token.
This is a script, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import time
from pathlib import Path

import torch

import rdlm
from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate
from rdlm.model import dtypes
from rdlm.model.lm import rope_tables


def build_random(preset: str, dtype: torch.dtype, device: str, **overrides) -> RecurrentDepthLM:
    """Random weights allocated directly in `dtype` (Huginn's 3.5B parameters in fp32 would take 14 GB);
    `overrides`: config fields (fewer layers, say)."""
    config = RDLMConfig.from_preset(preset, **overrides)
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


def matmul_peak(dtype: torch.dtype, device: str, repeats: int = 5) -> float:
    size = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best


def bandwidth(device: str, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + write), the ceiling of a memory-bound decode step."""
    n = (1 << 30) if device.startswith("cuda") else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n / best


def step_bytes(model, batch: int, core_iterations: float, coda_calls: float, context: float) -> float:
    """Bytes one decode step must read: every layer call's weights once (shared by the batch; parameters and
    buffers, so a quantized model counts its integer weights and scales), the un-embedding per coda call,
    one embedding row per token, and the keys/values attended to (in the embedding's dtype)."""
    def size(module) -> int:
        return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))

    c = model.config
    element = model.embedding.weight.element_size()
    block = size(model.core[0])
    adapter = size(model.adapter) if model.adapter is not None else 0
    tied = model.lm_head is None  # the embedding read as the head (a quantized model has its own lm_head)
    head = c.vocab_size * c.hidden_size * element if tied else size(model.lm_head)
    weights = (c.prelude_layers * block + core_iterations * (c.core_layers * block + adapter)
               + coda_calls * (c.coda_layers * block + head) + batch * c.hidden_size * element)
    layer_calls = c.prelude_layers + core_iterations * c.core_layers + coda_calls * c.coda_layers
    kv = batch * layer_calls * 2 * c.kv_heads * c.head_dim * context * element
    return weights + kv


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mode_options(mode: str, r: int, args) -> dict:
    if mode == "adaptive":
        return dict(exit_criterion="kl", min_steps=2, exit_every=args.exit_every,
                    exit_sync_every=args.exit_sync_every)
    if mode == "never":  # a criterion evaluated as usual that never fires: its cost alone
        return dict(exit_criterion="kl", exit_threshold=0.0, exit_every=args.exit_every,
                    exit_sync_every=args.exit_sync_every)
    if mode == "shared":
        return dict(cache_strategy="shared", cache_slots=min(args.cache_slots, r))
    if mode == "speculative":
        return dict(draft_steps=max(1, r // 4), draft_length=args.draft_length)
    return {}


def run_mode(model, mode: str, r: int, batch: int, compile: bool | None, args) -> dict:
    c = model.config
    batch = 1 if mode == "speculative" else batch
    config = GenerationConfig(num_steps=r, max_new_tokens=args.new_tokens, seed=0, **mode_options(mode, r, args))
    engine = EngineArgs(compile=compile)
    if args.model and (Path(args.model) / "tokenizer.json").exists():  # text the model was trained on
        from rdlm.data.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(args.model)
        texts = args.prompt_text.split("|")
        prompts = [tok.encode(texts[b % len(texts)], add_bos=True)[-args.prompt_length:] for b in range(batch)]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, c.vocab_size, (batch, args.prompt_length), generator=gen).tolist()
    if args.warmup:  # a short run first: allocator, kernels, compiled code of this shape
        generate(model, prompts, dataclasses.replace(config, max_new_tokens=2), engine=engine)
    result = generate(model, prompts, config, engine=engine)
    new = sum(len(t) for t in result.tokens)
    decoded = new - batch  # the first token of each row comes from the prefill
    mean_steps = sum(s for row in result.iterations for s in row[1:]) / max(decoded, 1)
    context = args.prompt_length + args.new_tokens / 2
    prompt_tokens = sum(len(p) for p in prompts)
    uses_logits = mode in ("adaptive", "never")
    if mode == "speculative":
        # every drafted token: prelude, N iterations, coda; then verification: r - N iterations, coda
        n = config.draft_steps
        decode_flops = result.drafted * (token_flops(c, n, 1, context) + token_flops(c, r - n, 1, context)
                                         - c.prelude_layers * layer_flops(c, context))
        decode_bytes = math.nan
    else:
        coda_calls = 1 + (mean_steps / config.exit_every if uses_logits else 0)
        decode_flops = decoded * token_flops(c, mean_steps, coda_calls, context)
        steps_run = decoded / batch
        decode_bytes = steps_run * step_bytes(model, batch, mean_steps, 1, context)
    seconds = result.decode_seconds
    return dict(
        prefill_tps=prompt_tokens / result.prefill_seconds,
        decode_tps=decoded / seconds if decoded else float("nan"),
        steps=mean_steps,
        flops=decode_flops / seconds,
        bytes=decode_bytes / seconds,
        compile=result.compile_seconds,
        cache=result.cache_bytes / 2 ** 20,
        accept=result.acceptance_rate,
        batch=batch,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--prompt-text", default="the cat sat on|12 13 14 15|a dog looked at|the old man walked to",
                   help="with --model: prompts, separated by |, cycled over the batch")
    p.add_argument("--model", help="a trained model directory instead of random presets (adaptive exits "
                                   "only fire on a model that converges over iterations)")
    p.add_argument("--steps", default="4,8,16,32", help="comma-separated r")
    p.add_argument("--modes", default="fixed,adaptive,never,shared,speculative")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cache-slots", type=int, default=4)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--exit-every", type=int, default=1, help="GenerationConfig.exit_every for adaptive modes")
    p.add_argument("--exit-sync-every", type=int, help="GenerationConfig.exit_sync_every (default: 1 on the CPU, "
                   "4 on a GPU)")
    p.add_argument("--compile", choices=["auto", "on", "off", "both"], default="auto",
                   help="the static decode step (EngineArgs.compile); both: off then on, per row")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--dtype", choices=dtypes.CHOICES, default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = dtypes.resolve_dtype(args.dtype)
    peak, bw = matmul_peak(dtype, args.device), bandwidth(args.device)
    compiles = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.compile]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {name} | {args.dtype} | matmul peak {peak / 1e12:.2f} TFLOP/s | bandwidth {bw / 1e9:.0f} GB/s "
          f"(both measured here) | prompt {args.prompt_length} | new tokens {args.new_tokens} | load {load:.2f}")
    header = (f"{'preset':<12} {'mode':<11} {'r':>3} {'B':>3} {'static':>6} {'prefill tok/s':>13} "
              f"{'decode tok/s':>12} {'iters/tok':>9} {'bw %':>5} {'% peak':>6} {'compile s':>9} "
              f"{'speed-up':>8} {'ideal':>5} {'cache MiB':>9} {'accept':>6}")
    print(header)
    print("-" * len(header))
    for preset in [args.model] if args.model else args.presets.split(","):
        if args.model:
            model = rdlm.load_pretrained(args.model, dtype=dtype).to(args.device).eval()
            preset = Path(args.model).name[:12]
        else:
            model = build_random(preset, dtype, args.device)
        for batch in [int(b) for b in args.batch.split(",")]:
            for r in [int(s) for s in args.steps.split(",")]:
                for compile in compiles:
                    fixed_tps = None
                    for mode in args.modes.split(","):
                        if mode == "speculative" and (max(1, r // 4) >= r or batch != 1):
                            continue
                        m = run_mode(model, mode, r, batch, compile, args)
                        if mode == "fixed":
                            fixed_tps = m["decode_tps"]
                        adaptive = mode in ("adaptive", "never") and fixed_tps
                        speedup = f"{m['decode_tps'] / fixed_tps:.2f}" if adaptive else "-"
                        ideal = f"{r / m['steps']:.2f}" if adaptive else "-"
                        accept = f"{m['accept']:.2f}" if m["accept"] is not None else "-"
                        static = {None: "auto", True: "on", False: "off"}[compile]
                        print(f"{preset:<12} {mode:<11} {r:>3} {m['batch']:>3} {static:>6} "
                              f"{m['prefill_tps']:>13.1f} {m['decode_tps']:>12.1f} {m['steps']:>9.1f} "
                              f"{100 * m['bytes'] / bw:>5.1f} {100 * m['flops'] / peak:>6.1f} "
                              f"{m['compile']:>9.2f} {speedup:>8} {ideal:>5} {m['cache']:>9.2f} {accept:>6}",
                              flush=True)
        del model


if __name__ == "__main__":
    main()
