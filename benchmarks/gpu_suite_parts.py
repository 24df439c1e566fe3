"""The parts of the GPU suite (benchmarks/gpu_suite.py): each is `part(ctx, figures)`, runs on `ctx.device`
(tiny shapes when `ctx.smoke`), calls `ctx.check()` between its cases (it raises once the part's budget is
spent) and appends its measured rows to `figures` as it goes, so a part stopped early keeps what it did.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import rdlm  # noqa: E402
from rdlm.inference.batching import ContinuousBatch  # noqa: E402
from rdlm.inference.exits.criteria import CRITERIA  # noqa: E402
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate  # noqa: E402
from rdlm.inference.execution.graphs import sync  # noqa: E402
from rdlm.model import quantize  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Thresholds loose enough that a random model's tokens exit at different iterations (the defaults are for
# trained models; on random weights most never fire), so the comparison covers exits that do fire.
# Chosen on the seeded `tiny` model: at r = 4 and 8 each leaves some tokens at 2 or 3 iterations, others at r.
LOOSE = {"kl": 0.1, "entropy-diff": 0.05, "latent-diff": 0.8, "minp-kl": 0.05, "argmax-stability": 1,
         "cosine": 0.4, "gate": 0.5, "gate-exact": 0.5}


def release(device: torch.device) -> None:
    """Free what a finished part left behind (its models, the compiled code that keeps them alive)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# correctness: the fast paths give the eager path's tokens and per-token steps

def tiny_model(preset: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    return rdlm.build_model(preset, seed=0).to(device=device, dtype=dtype).eval()


EAGER, STATIC = EngineArgs(compile=False), EngineArgs(compile=True)  # the static step: CUDA graphs on CUDA


def reference(model, prompts, config: GenerationConfig, engine: EngineArgs = EAGER) -> tuple:
    """(result, each row's events): the eager run, with the top-2 log-probabilities of each token (to tell
    a near-tie at a mismatch)."""
    events: list = []
    result = generate(model, prompts, dataclasses.replace(config, logprobs=2), on_token=events.append, engine=engine)
    rows = [[e for e in events if e.row == b] for b in range(len(prompts))]
    return result, rows


def first_mismatch(ref, ref_events, fast) -> str:
    for b, (t_ref, t_fast, s_ref, s_fast) in enumerate(zip(ref.tokens, fast.tokens, ref.iterations, fast.iterations)):
        for t, (a, c, sa, sc) in enumerate(itertools.zip_longest(t_ref, t_fast, s_ref, s_fast)):
            if (a, sa) != (c, sc):
                top = ref_events[b][t].top if t < len(ref_events[b]) else None
                gap = f", eager top-2 log-p gap {top[0][1] - top[1][1]:.3g}" if top and len(top) > 1 else ""
                return f"row {b} token {t}: eager {a} ({sa} steps) vs fast {c} ({sc} steps){gap}"
    return ""


def compare(rows: list, name: str, dtype: str, model, prompts, eager: GenerationConfig, fast: GenerationConfig,
            exact: bool = True, fast_engine: EngineArgs = EAGER, eager_engine: EngineArgs = EAGER) -> None:
    """One row: the fast run's tokens and steps against the eager reference's, exactly. `exact` False marks a
    comparison claimed only up to near-ties: in bf16 the two paths reduce over different shapes (the static
    step attends over the whole preallocated cache with a mask, the eager one over its written part;
    speculative verification scores several positions in one forward), and bf16 round-off then flips a
    greedy token or an exit decision where two candidates are within it. `fast_engine`: the fast run's engine
    settings (STATIC: the static decode step)."""
    ref, ref_events = reference(model, prompts, eager, eager_engine)
    got = generate(model, prompts, fast, engine=fast_engine)
    flat = [s for row in ref.iterations for s in row]
    rows.append({"case": name, "dtype": dtype, "match": ref.tokens == got.tokens and ref.iterations == got.iterations,
                 "tokens_equal": ref.tokens == got.tokens, "steps_equal": ref.iterations == got.iterations,
                 "exact_claim": exact, "steps_min_max": f"{min(flat)}-{max(flat)}" if flat else "-",
                 "tokens": sum(map(len, got.tokens)), "first_mismatch": first_mismatch(ref, ref_events, got)})


def correctness(ctx, figures: dict) -> None:
    """Greedy decoding with the fast paths on (the static step, CUDA graphs on CUDA; speculative decoding;
    the parallel sampler; quantized weights) against the eager path, fp32 and bf16, on seeded random models."""
    rows = figures.setdefault("cases", [])
    r, new = (4, 6) if ctx.smoke else (8, 16)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]  # two rows of different lengths: left padding, a real batch
    for dtype_name, dtype in DTYPES.items():
        exact = dtype_name == "fp32"  # bf16: up to near-ties (see `compare`)
        model = tiny_model("tiny", dtype, ctx.device)
        base = dict(num_steps=r, max_new_tokens=new, seed=0)

        def pair(name: str, sync_every: int | None = None, **extra) -> None:
            ctx.check()
            config = GenerationConfig(**base, **extra)
            compare(rows, name, dtype_name, model, prompts, config, config, exact,
                    EngineArgs(True, sync_every), EngineArgs(False, sync_every))

        pair(f"fixed r = {r}")
        for criterion in (c for c, spec in CRITERIA.items() if not spec.uses_gate):
            pair(f"exit {criterion} ({LOOSE[criterion]})", exit_criterion=criterion, exit_threshold=LOOSE[criterion])
        pair("exit kl (0.2), exit_every 2, sync every 3", exit_criterion="kl", exit_threshold=0.2, exit_every=2,
             sync_every=3)
        pair("shared cache k = 3", cache_strategy="shared", cache_slots=3)
        pair("continuous CoT", continuous_cot=True)
        pair("continuous CoT + exit latent-diff + shared k = 2", continuous_cot=True, exit_criterion="latent-diff",
             exit_threshold=LOOSE["latent-diff"], cache_strategy="shared", cache_slots=2)
        # Self-speculative decoding and the parallel sampler (batch 1) against plain greedy decoding: exact in
        # fp32; in bf16 up to near-ties (docs/generation.md#the-options).
        ctx.check()
        plain = GenerationConfig(**base)
        compare(rows, "speculative (draft 2 x 3)", dtype_name, model, prompts[:1], plain,
                GenerationConfig(**base, draft_steps=2, draft_length=3), exact)
        ctx.check()
        compare(rows, f"parallel sampler (wavefront 1, inner {r})", dtype_name, model, prompts[:1], plain,
                GenerationConfig(**base, sampler="parallel", max_wavefront=1, inner_recurrence=r), exact)
        for scheme in ("int8", "int4"):
            ctx.check()
            quantized = quantize.quantize(copy.deepcopy(model), scheme, group_size=32)
            config = GenerationConfig(**base)
            compare(rows, f"{scheme} weights", dtype_name, quantized, prompts, config, config, exact, STATIC)
            del quantized
        ouro = tiny_model("ouro-tiny", dtype, ctx.device)
        for criterion in (None, "gate", "gate-exact"):
            ctx.check()
            extra = {} if criterion is None else dict(exit_criterion=criterion, exit_threshold=LOOSE[criterion])
            config = GenerationConfig(**base, **extra)
            compare(rows, f"ouro-tiny {criterion or 'fixed r'}", dtype_name, ouro, prompts, config, config, exact,
                    STATIC)
        del model, ouro
    bad = [row["case"] + " " + row["dtype"] for row in rows if row["exact_claim"] and not row["match"]]
    figures["mismatches"] = ", ".join(bad) if bad else "none"
    near = [row for row in rows if not row["exact_claim"]]
    figures["identical_without_exact_claim"] = f"{sum(row['match'] for row in near)} of {len(near)}"


# --------------------------------------------------------------------------------------------------
# decode speed against the bandwidth roofline

def decode_case(model, name: str, batch: int, r: int, prompt_length: int, new: int, bandwidth: float,
                **extra) -> dict:
    """Decode tokens/s of one setting (after a short warm-up run that captures its graphs) beside its roofline:
    the bandwidth over the bytes a step reads (bench_generate.step_bytes), times the batch."""
    from bench_generate import step_bytes

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_length), generator=gen).tolist()
    config = GenerationConfig(num_steps=r, max_new_tokens=new, seed=0, **extra)
    generate(model, prompts, GenerationConfig(**{**vars(config), "max_new_tokens": 2}))  # warm-up, captures
    result = generate(model, prompts, config)
    decoded = sum(len(t) for t in result.tokens) - batch   # each row's first token comes from the prefill
    mean_steps = sum(s for row in result.iterations for s in row[1:]) / max(decoded, 1)
    uses_logits = config.criterion() is not None and config.criterion().spec.uses_logits
    coda_calls = 1 + (mean_steps / config.exit_every if uses_logits else 0)
    per_step = step_bytes(model, batch, mean_steps, coda_calls, prompt_length + new / 2)  # the mean context
    tps = decoded / result.decode_seconds if decoded else math.nan
    ceiling = bandwidth / per_step * batch
    return {"case": name, "batch": batch, "r": r, "decode_tok_s": round(tps, 2), "mean_steps": round(mean_steps, 2),
            "roofline_tok_s": round(ceiling, 2), "bw_pct": round(100 * tps / ceiling, 1),
            "mb_per_step": round(per_step / 2**20, 1), "capture_s": round(result.compile_seconds, 2)}


def random_model(preset: str, dtype: torch.dtype, device: torch.device, **overrides):
    """Random weights allocated in `dtype` on the device (bench_generate.build_random), config `overrides`."""
    from bench_generate import build_random

    return build_random(preset, dtype, str(device), **overrides)


def int4_group(config) -> int:
    """The largest int4 group size that divides both the hidden and the MLP width (else layers fall back to int8)."""
    return next((g for g in (256, 128, 64, 32) if config.hidden_size % g == 0 and config.intermediate_size % g == 0),
                32)


def kernel_check(model) -> dict:
    """Which kernel each quantized layer runs (rdlm.model.cuda_quant: tinygemm, int8pack, or dequantized: the
    dequantizing matmul; cpu: the CPU's kernels, in the smoke run) and, for every layer, its output on 4 random rows against the dequantized reference
    x W^T in float32: the largest error over the sum of the terms' magnitudes, and whether every layer is
    within bfloat16's 2^-7 of it (the bound cuda_quant.agrees checks on a layer's first rows, here on all)."""
    from rdlm.model.quantize import QuantizedLinear

    kernels, worst = {}, 0.0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                kernel = module.cuda_kernel or ("cpu" if module.on_cpu else "dequantized")
                kernels[kernel] = kernels.get(kernel, 0) + 1
                weight = module.weight.float()
                x = torch.randn(4, module.in_features, device=weight.device).to(torch.bfloat16).float()
                scale = x.abs() @ weight.abs().T + 1e-6
                worst = max(worst, float(((module.matmul(x).float() - x @ weight.T).abs() / scale).max()))
                del weight
    return {"kernels": ", ".join(f"{n} {k}" for k, n in sorted(kernels.items())),
            "max_error_vs_dequantized": f"{worst:.2e}", "matches_dequantized": worst <= 2**-7}


def decode_speed(ctx, figures: dict) -> None:
    """Decode tokens/s at the Huginn-0125 shape (random bf16 weights; smoke: `tiny`, fp32) against the
    bandwidth roofline: the bytes a decode step must read over a measured device-to-device copy bandwidth."""
    import bench_generate

    rows = figures.setdefault("cases", [])
    if ctx.smoke:
        preset, dtype, prompt, new, deep, batches = "tiny", torch.float32, 8, 6, 8, (1, 2, 4)
        shallow = 2
    else:
        preset, dtype, prompt, new, deep, batches = "huginn-0125", torch.bfloat16, 64, 32, 32, (1, 16, 64)
        shallow = 4
    overrides, note = {}, "full shape"
    if ctx.cuda:
        free = torch.cuda.mem_get_info(ctx.device)[0]
        if free < 40 * 2**30 and preset == "huginn-0125":  # 7 GB of weights, a batch-64 cache of ~25 GB
            overrides, note = dict(core_layers=2), f"core_layers 2 instead of 4 ({free / 2**30:.0f} GiB free)"
    bandwidth = bench_generate.bandwidth(str(ctx.device))
    figures["bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    figures["shape"] = f"{preset} ({note}), {str(dtype).removeprefix('torch.')}, prompt {prompt}, {new} new tokens"
    model = random_model(preset, dtype, ctx.device, **overrides)
    plan = [("fixed", 1, shallow, {}), ("fixed", 1, deep, {}),
            ("KL exit", 1, deep, dict(exit_criterion="kl")),
            ("shared cache k = 4", 1, deep, dict(cache_strategy="shared", cache_slots=4))]
    plan += [("fixed", b, deep, {}) for b in batches[1:]]
    for name, batch, r, extra in plan:
        ctx.check()
        rows.append(decode_case(model, name, batch, r, prompt, new, bandwidth, **extra))
    for scheme in ("int8", "int4"):
        ctx.check()
        group = int4_group(model.config)
        quantized = quantize.quantize(copy.deepcopy(model), scheme, group_size=group)
        schemes = sorted(set(quantized.quantized_layers.values()))
        row = decode_case(quantized, f"{scheme} weights (group {group})" if scheme == "int4" else f"{scheme} weights",
                          1, deep, prompt, max(2, new // 2), bandwidth)
        row["layers"] = "/".join(schemes)
        row.update(kernel_check(quantized))
        rows.append(row)
        del quantized
        release(ctx.device)
    del model


# --------------------------------------------------------------------------------------------------
# the server's batch in process, against offline generate

def closed_loop(model, prompts: list[list[int]], config: GenerationConfig, rows: int, static: bool,
                seconds: float) -> tuple[float, float]:
    """Rows kept full: a finished request is replaced at once, for `seconds` (a quarter warm-up, graph
    captures included). (tokens/s, ms per step) after the warm-up. The server's settings: the host looks at
    the exit flags every 4 steps, a done row waits at most 8 for its coda."""
    batch = ContinuousBatch(model, rows, len(max(prompts, key=len)) + config.max_new_tokens,
                            config.core_slots, compile=static, exit_sync_every=4, coda_every=8)
    sent = itertools.count()
    for _ in range(rows):
        batch.add(prompts[next(sent) % len(prompts)], config)
    tokens = steps = 0
    sync(batch.device)
    t0, mark = time.perf_counter(), None
    while time.perf_counter() - t0 < seconds:
        for event in batch.step():
            tokens += 1
            if event.finish_reason is not None:
                batch.add(prompts[next(sent) % len(prompts)], config)
        steps += 1
        if mark is None and time.perf_counter() - t0 > seconds / 4:
            sync(batch.device)
            mark = (time.perf_counter(), tokens, steps)
    sync(batch.device)
    if mark is None:
        raise RuntimeError("the measurement was too short to get past its warm-up")
    start, tokens0, steps0 = mark
    elapsed = time.perf_counter() - start
    return (tokens - tokens0) / elapsed, 1e3 * elapsed / max(steps - steps0, 1)


def serving_batch(ctx, figures: dict) -> None:
    """`ContinuousBatch` as `rdlm serve` runs it (no HTTP), the static step off and on, served tokens/s
    against offline `generate` on one batch of the same prompts (its default decode step)."""
    from bench_batch import timed_generate

    rows_out = figures.setdefault("cases", [])
    if ctx.smoke:
        preset, dtype, rows, r, new, seconds = "tiny", torch.float32, 4, 4, 6, 1.2
    else:
        preset, dtype, rows, r, new, seconds = "huginn-0125", torch.bfloat16, 16, 32, 32, 8.0
    model = random_model(preset, dtype, ctx.device)
    vocab = model.config.vocab_size
    prompts = [[1 + (7 * k + j) % (vocab - 10) for j in range(5 + k % 4)] for k in range(64)]
    config = GenerationConfig(num_steps=r, max_new_tokens=new)
    figures["shape"] = f"{preset}, {str(dtype).removeprefix('torch.')}, {rows} rows, r = {r}, {new} new tokens"
    offline, _ = timed_generate(model, [prompts[k % len(prompts)] for k in range(rows)], config, seconds / 2)
    figures["offline_tok_s"] = round(offline, 2)
    for static in (False, True):
        ctx.check()
        served, ms = closed_loop(model, prompts, config, rows, static, seconds)
        rows_out.append({"step": "static" if static else "eager", "rows": rows, "served_tok_s": round(served, 2),
                         "ms_per_step": round(ms, 2), "offline_tok_s": round(offline, 2),
                         "served_over_offline": round(served / offline, 3)})
    del model


# --------------------------------------------------------------------------------------------------
# training: MFU at the 0.55B shape, peak memory flat in r

def train_args(ctx, **overrides) -> argparse.Namespace:
    """bench_train.gpu_run's arguments: the 0.55B shape (`h2048`) on a GPU, `tiny` in smoke mode."""
    if ctx.smoke:
        shape = dict(preset="tiny", batch=2, seq_len=32, k=2, warmup=1, steps=2, compile=False)
    else:
        shape = dict(preset="h2048", batch=8, seq_len=1024, k=8, warmup=2, steps=3, compile=True)
    values = dict(device=ctx.device.type, activation_checkpointing=False, world=1, levers=False, strategy="single",
                  cpu_offload=False, ema_decay=0.999, seed=0, **shape)
    return argparse.Namespace(**{**values, **overrides})


def train_row(result: dict, extra: dict) -> dict:
    keep = ("preset", "mean_r", "sampler", "k", "tokens_per_s", "seconds_per_step", "mfu", "peak_memory_gib",
            "parameters", "compile", "micro_batch", "loss")
    return {**extra, **{key: result.get(key) for key in keep}}


def train_mfu(ctx, figures: dict) -> None:
    """Training throughput and MFU (against the GPU's dense bf16 peak; none on the CPU) at mean r = 32
    (smoke: 4), backprop depth k = 8, compiled on the GPU (bench_train.gpu_run)."""
    from bench_train import gpu_run

    rows = figures.setdefault("cases", [])
    args = train_args(ctx)
    mean = 4 if ctx.smoke else 32
    ctx.check()
    rows.append(train_row(gpu_run(args, mean=mean, label=f"mean r={mean}"), {"run": f"mean r = {mean}"}))


def train_memory(ctx, figures: dict) -> None:
    """Peak GPU memory (torch.cuda.max_memory_allocated) of training steps at fixed r = 8 and r = 64 with
    backprop depth k = 8 (eager, so that no compiled code of another run stays alive): flat in r."""
    from bench_train import gpu_run

    rows = figures.setdefault("cases", [])
    args = train_args(ctx, compile=False, warmup=1, steps=1)
    for r in (8, 64):
        ctx.check()
        rows.append(train_row(gpu_run(args, mean=r, sampler="fixed", label=f"fixed r={r}"), {"run": f"fixed r = {r}"}))
    if len(rows) == 2 and rows[0]["peak_memory_gib"]:
        figures["peak_ratio_r64_over_r8"] = round(rows[1]["peak_memory_gib"] / rows[0]["peak_memory_gib"], 3)
