"""Quantization that respects the loop (docs/quantization.md): what int8/int4 weights do to a recurrent-depth
model, measured where the recurrence could amplify the error, and what they buy in speed and memory.

    # quality, on a model trained here: a run/model directory with token shards, or the demo's model
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_quantize.py quality --model runs/small \
        --data runs/shards --out bench-quantize/small.json
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_quantize.py quality --model demo-report/model \
        --demo --out bench-quantize/demo.json
    # speed and memory at batch 1, a ~130M-parameter model with random weights (bandwidth-bound)
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_quantize.py speed --out bench-quantize/speed.json
    # the compiled decode step (rdlm.inference.execution.cpu_compile) quantized against compiled float32, `small`, b1 r32
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_quantize.py compiled --out bench-quantize/compiled.json
    # the tables of docs/quantization.md
    .venv/bin/python benchmarks/bench_quantize.py table bench-quantize/*.json

quality, for each setting against the unquantized model (same s_0 for both):
  - the latent state's relative error ||s_q,i - s_i|| / ||s_i|| after core iteration i (i up to 64): does
    the error the quantized core makes grow with r, settle, or shrink?
  - perplexity on the validation tokens (or, with --demo, test accuracy of greedy decoding) at
    r = 1, 4, 8, 16, 32, 64
  - agreement of greedy tokens at the training mean r: teacher-forced argmax (every position) and free
    generation (the fraction of generated tokens equal to the unquantized model's, position by position)
  - the mean core iterations per token of the default exit criterion (kl, its default threshold), capped
    at 64, and its shift
speed: decode tokens/s at batch 1 for each setting, alternated with the unquantized model in rounds (the
ratio is taken within a round), the bytes of weights read per core iteration and per token, and the
resident memory of a process that loads the saved quantized model and decodes (peak and after decoding).
compiled: decode tokens/s of the compiled static step (`compile=True`) at batch 1 on a preset's random
weights, each setting alternated with compiled float32 in rounds (the ratio taken within a round), after a
warm-up call that compiles each; and the compiled core iteration alone, the settings alternated in short
blocks (steadier on a shared CPU); with the load average and the CPU beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rdlm import load_model  # noqa: E402
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate  # noqa: E402
from rdlm.model.quantize import QuantizedLinear, describe, layers, quantize, weight_bytes  # noqa: E402

SETTINGS = ("int8", "int4", "int4,core=int8", "int8,core=int4", "core=int8", "core=int4", "int4,head=int8")
R_VALUES = (1, 4, 8, 16, 32, 64)
STATE_AT = (1, 2, 4, 8, 16, 32, 64)


def load() -> float:
    return round(os.getloadavg()[0], 2)


# ------------------------------------------------------------------------------------------------
# Quality


def validation_rows(data: str, rows: int) -> torch.Tensor:
    import numpy as np

    from rdlm.data.shards import TokenShards

    shards = TokenShards(data, "val")
    tokens, _ = shards.rows(np.arange(min(rows, len(shards))))
    return tokens.long()


def demo_data(model_dir: str, n: int):
    from rdlm.demo import tasks as T

    meta = json.loads((Path(model_dir) / "task_tokenizer.json").read_text())
    tokenizer = T.CharTokenizer(meta["alphabet"])
    splits = T.make_splits(meta["task"], 0, n, seed=0)
    return tokenizer, splits["test"]


def state_errors(model, quantized, ids: torch.Tensor, r: int) -> dict[int, float]:
    out = {}
    with torch.no_grad():
        torch.manual_seed(1)
        ref = model(ids, num_steps=r, return_trajectory=True, return_logits=False).trajectory
        torch.manual_seed(1)
        got = quantized(ids, num_steps=r, return_trajectory=True, return_logits=False).trajectory
    for i in STATE_AT:
        if i <= r:
            err = (got[i] - ref[i]).norm(dim=-1) / ref[i].norm(dim=-1).clamp(min=1e-12)
            out[i] = float(err.mean())
    return out


def perplexities(model, rows: torch.Tensor) -> dict[int, float]:
    ids, labels = rows[:, :-1], rows[:, 1:]
    out = {}
    with torch.no_grad():
        for r in R_VALUES:
            torch.manual_seed(1)
            loss = model(ids, num_steps=r, labels=labels, return_logits=False).loss
            out[r] = float(torch.exp(loss))
    return out


def argmax_agreement(model, quantized, ids: torch.Tensor, r: int) -> float:
    with torch.no_grad():
        torch.manual_seed(1)
        a = model(ids, num_steps=r).logits.argmax(-1)
        torch.manual_seed(1)
        b = quantized(ids, num_steps=r).logits.argmax(-1)
    return float((a == b).float().mean())


def decode(model, prompts, r: int, new: int, exit_criterion=None, stop=()):
    config = GenerationConfig(max_new_tokens=new, num_steps=r, temperature=0.0, seed=0, exit_criterion=exit_criterion,
                              stop_tokens=tuple(stop))
    return generate(model, prompts, config)


def token_agreement(a, b) -> float:
    same = total = 0
    for x, y in zip(a.tokens, b.tokens):
        total += max(len(x), len(y))
        same += sum(p == q for p, q in zip(x, y))
    return same / max(total, 1)


def quality(args) -> dict:
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    r_train = model.config.mean_recurrence
    if args.demo:
        from rdlm.demo.scoring import decode_answers

        tokenizer, examples = demo_data(args.model, args.examples)
        encoded = [tokenizer.encode(ex.prompt) for ex in examples]
        width = max(map(len, encoded))
        ids = torch.tensor([e + [tokenizer.pad_id] * (width - len(e)) for e in encoded[:64]])
        prompts = encoded[:32]

        def task_scores(m):
            return {r: decode_answers(m, examples, tokenizer, r).accuracy for r in R_VALUES}
        scores_name = "test_accuracy"
        scores = task_scores
        stop = (tokenizer.eos_id,)
    else:
        rows = validation_rows(args.data, args.rows)
        ids = rows[:, :-1]
        prompts = [row[:32].tolist() for row in rows[:16]]
        scores_name, scores, stop = "perplexity", lambda m: perplexities(m, rows), ()

    result = {"model": args.model, "parameters": model.num_parameters(), "mean_recurrence": r_train,
              "load_avg_start": load(), "settings": {}}
    base_scores = scores(model)
    base_greedy = decode(model, prompts, r_train, args.new_tokens, stop=stop)
    base_exit = decode(model, prompts, 64, args.new_tokens, exit_criterion="kl", stop=stop)
    result["none"] = {scores_name: base_scores, "exit_mean_steps": base_exit.mean_iterations,
                      "weight_bytes": weight_bytes(model)}
    print(f"none: {scores_name} {base_scores}; kl exits {base_exit.mean_iterations:.2f}", flush=True)
    for setting in args.settings:
        quantized = load_model(args.model, quantize=setting, group_size=args.group_size)
        greedy = decode(quantized, prompts, r_train, args.new_tokens, stop=stop)
        exits = decode(quantized, prompts, 64, args.new_tokens, exit_criterion="kl", stop=stop)
        row = {"describe": describe(quantized), "weight_bytes": weight_bytes(quantized),
               "state_relative_error": state_errors(model, quantized, ids, 64),
               scores_name: scores(quantized),
               "argmax_agreement": argmax_agreement(model, quantized, ids, r_train),
               "greedy_token_agreement": token_agreement(base_greedy, greedy),
               "exit_mean_steps": exits.mean_iterations, "exit_shift": exits.mean_iterations - base_exit.mean_iterations}
        result["settings"][setting] = row
        print(f"{setting}: {json.dumps(row)}", flush=True)
    result["load_avg_end"] = load()
    return result


# ------------------------------------------------------------------------------------------------
# Speed and memory


def speed_model(args):
    from rdlm import build_model

    prelude, core, coda = (int(x) for x in args.layers.split(","))
    return build_model("tiny", seed=0, hidden_size=args.hidden, num_heads=args.hidden // 64,
                       intermediate_size=args.intermediate, vocab_size=args.vocab, context_length=512,
                       prelude_layers=prelude, core_layers=core, coda_layers=coda, mean_recurrence=args.r).eval()


def bytes_read(model) -> dict[str, int]:
    """Weight bytes one decoded token reads per part (rdlm.model.quantize.layers: the prelude and coda once, the
    core and adapter r times, the head once)."""
    read = dict.fromkeys(("prelude", "core", "coda", "head"), 0)
    for part, _, module in layers(model):
        weight = None if isinstance(module, QuantizedLinear) else module.weight
        read[part] += module.nbytes() if weight is None else weight.numel() * weight.element_size()
    return read


def rss_child(args) -> None:
    """In a fresh process: load the saved model, decode, print peak and current resident memory (MiB)."""
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    decode(model, [[1, 2, 3, 4]], args.r, 8)
    # VmHWM, not getrusage's ru_maxrss: Linux carries the parent's peak into a forked and exec'd child's maxrss
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    print(json.dumps({"peak_mib": int(status["VmHWM"].split()[0]) / 1024,
                      "current_mib": int(status["VmRSS"].split()[0]) / 1024}))


def speed(args) -> dict:
    from rdlm.model.huginn import save_pretrained

    torch.set_num_threads(args.threads)
    base = speed_model(args)
    settings = ["none", *args.settings]
    models = {"none": base}
    for setting in args.settings:
        models[setting] = quantize(speed_model(args), setting, group_size=args.group_size)
    prompts = [list(range(1, 9))]
    result = {"parameters": base.num_parameters(), "r": args.r, "threads": args.threads, "new_tokens": args.new_tokens,
              "load_avg_start": load(), "settings": {}}
    for m in models.values():  # warm up
        decode(m, prompts, args.r, 4)
    tps, ratios = alternated(settings, args.rounds, args.new_tokens,
                             lambda s: decode(models[s], prompts, args.r, args.new_tokens), digits=2)
    with tempfile.TemporaryDirectory() as tmp:
        for s in settings:
            save_pretrained(models[s], Path(tmp) / "m")
            child = subprocess.run([sys.executable, __file__, "rss", "--model", str(Path(tmp) / "m"), "-r", str(args.r),
                                    "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            memory = json.loads(child.stdout.strip().splitlines()[-1])
            read = bytes_read(models[s])
            result["settings"][s] = {
                "describe": describe(models[s]) if s != "none" else "float32",
                "decode_tok_s_median": statistics.median(tps[s]), "decode_tok_s": tps[s],
                "speedup_median": statistics.median(ratios[s]), "weight_bytes": weight_bytes(models[s]),
                "bytes_per_token": read["prelude"] + args.r * read["core"] + read["coda"] + read["head"],
                "bytes_read": read, **memory}
            print(f"{s}: {json.dumps(result['settings'][s])}", flush=True)
    result["load_avg_end"] = load()
    return result


def iteration_times(models: dict, prompt: list[list[int]], args) -> dict[str, list[float]]:
    """Microseconds per call of each model's compiled core iteration alone (one decoding row, its prompt in
    a cache of the length `generate` gives it, one thread as the engine runs it), the settings alternated in short blocks, so that another
    process's load falls on each alike: a steadier ratio than whole generations under a shared CPU."""
    from rdlm.inference.batching import ContinuousBatch

    from rdlm.inference.execution.cpu_compile import LENGTH_BUCKET

    length = -(-(args.prompt_length + args.new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET  # as `generate` rounds it
    steps = {}
    for s, model in models.items():
        batch = ContinuousBatch(model, max_batch=1, max_length=length, compile=True)
        batch.add(prompt[0], GenerationConfig(max_new_tokens=args.new_tokens, num_steps=args.r, temperature=0.0))
        for _ in range(2):
            batch.step()  # the prompt prefilled, a token decoding
        steps[s] = batch.step_runner.static_step.compiled
    times: dict[str, list[float]] = {s: [] for s in models}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():  # as the engine calls it
            for block in range(args.blocks):
                for s in (list(models) if block % 2 == 0 else list(models)[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(50):
                        steps[s]()
                    times[s].append((time.perf_counter() - t0) / 50 * 1e6)
    finally:
        torch.set_num_threads(before)
    print("iteration us: " + ", ".join(f"{s} {statistics.median(t):.0f}" for s, t in times.items()) + f" (load {load()})")
    return times


def alternated(settings: list[str], rounds: int, new_tokens: int, run, digits: int):
    """Decode tokens/s of each setting (`run(setting)`: a GenerationResult) and its ratio to "none", per round,
    the settings taken in turn and in reverse order every other round, so that a change of the machine's load
    falls on all of them alike; each round printed with the load."""
    tps: dict[str, list[float]] = {s: [] for s in settings}
    ratios: dict[str, list[float]] = {s: [] for s in settings}
    for round_ in range(rounds):
        order = settings if round_ % 2 == 0 else settings[::-1]
        times = {}
        for s in order:
            times[s] = (new_tokens - 1) / run(s).decode_seconds
            tps[s].append(times[s])
        for s in settings:
            ratios[s].append(times[s] / times["none"])
        print(f"round {round_}: " + ", ".join(f"{s} {times[s]:.{digits}f} tok/s" for s in settings)
              + f" (load {load()})", flush=True)
    return tps, ratios


def compiled(args) -> dict:
    """Compiled quantized decoding against compiled float32 (the `small` preset, batch 1, r = `-r`)."""
    from rdlm import build_model
    from rdlm.demo.run import cpu_model

    from rdlm.inference.execution import cpu_compile

    torch.set_num_threads(args.threads)
    settings = ["none", *args.settings]
    # Every setting's compiled parts kept (four functions per model's weights), not compiled again at each round
    cpu_compile.KEEP_COMPILED = max(cpu_compile.KEEP_COMPILED, 4 * len(settings))
    models = {}
    for setting in settings:
        model = speed_model(args) if args.preset == "speed" else build_model(args.preset, seed=0).eval()
        models[setting] = quantize(model, setting, group_size=args.group_size) if setting != "none" else model
    prompt = [[(7 * i) % 1000 + 1 for i in range(args.prompt_length)]]
    config = GenerationConfig(max_new_tokens=args.new_tokens, num_steps=args.r, temperature=0.0)
    engine = EngineArgs(compile=True)
    result = {"preset": args.preset, "r": args.r, "threads": args.threads, "new_tokens": args.new_tokens,
              "group_size": args.group_size, "cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
              "load_avg_start": load(), "settings": {}}
    compile_seconds = {}
    for s in settings:  # warm up: compile each
        compile_seconds[s] = generate(models[s], prompt, config, engine=engine).compile_seconds
        print(f"{s}: compiled in {compile_seconds[s]:.1f} s", flush=True)
    tps, ratios = alternated(settings, args.rounds, args.new_tokens,
                             lambda s: generate(models[s], prompt, config, engine=engine), digits=1)
    iteration_us = iteration_times(models, prompt, args)
    for s in settings:
        result["settings"][s] = {
            "iteration_us_median": statistics.median(iteration_us[s]),
            "iteration_speedup_median": statistics.median(
                b / a for a, b in zip(iteration_us[s], iteration_us["none"], strict=True)),
            "describe": describe(models[s]) if s != "none" else "float32", "compile_seconds": compile_seconds[s],
            "decode_tok_s_median": statistics.median(tps[s]), "decode_tok_s": tps[s],
            "speedup_median": statistics.median(ratios[s]), "speedups": ratios[s],
            "weight_bytes": weight_bytes(models[s])}
    result["load_avg_end"] = load()
    return result


def table(paths: list[str]) -> str:
    """Markdown tables of result files (quality or speed)."""
    lines = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        lines.append(f"`{path}`: load {result['load_avg_start']} → {result['load_avg_end']}")
        lines.append("")
        if "preset" in result:  # compiled
            lines.append(f"`{result['preset']}`, r = {result['r']}, batch 1, compiled, {result['cpu']} "
                         f"({result['capability']}), {result['new_tokens']} new tokens, medians of alternated rounds")
            lines.append("")
            lines.append("| setting | decode tok/s | × compiled float32 (each round) | core iteration | × float32 | "
                         "weights | compile |")
            lines.append("|---|---|---|---|---|---|---|")
            for name, row in result["settings"].items():
                rounds = " / ".join(f"{x:.2f}" for x in row["speedups"])
                lines.append(f"| `{name}` | {row['decode_tok_s_median']:.1f} | {row['speedup_median']:.2f} ({rounds}) | "
                             f"{row['iteration_us_median']:.0f} µs | {row['iteration_speedup_median']:.2f} | "
                             f"{row['weight_bytes'] / 2**20:.1f} MiB | {row['compile_seconds']:.0f} s |")
        elif "mean_recurrence" in result:  # quality
            key = "test_accuracy" if "test_accuracy" in result["none"] else "perplexity"
            base = result["none"]
            r_train = result["mean_recurrence"]
            scores = list(base[key])
            lines.append(f"| setting | weights | state error at i = 1 / 8 / 64 | {key} at r = {' / '.join(scores)} | "
                         f"argmax agreement (r = {r_train}) | greedy tokens equal | KL exit: mean steps (shift) |")
            lines.append("|---|---|---|---|---|---|---|")
            fmt = (lambda v: f"{100 * v:.1f}") if key == "test_accuracy" else (lambda v: f"{v:.2f}")
            lines.append(f"| none | {base['weight_bytes'] / 2**20:.2f} MiB | – | "
                         f"{' / '.join(fmt(base[key][r]) for r in scores)} | – | – | {base['exit_mean_steps']:.2f} |")
            for name, row in result["settings"].items():
                err = row["state_relative_error"]
                lines.append(
                    f"| `{name}` | {row['weight_bytes'] / 2**20:.2f} MiB | "
                    f"{' / '.join(f'{100 * err[i]:.1f}%' for i in ('1', '8', '64'))} | "
                    f"{' / '.join(fmt(row[key][r]) for r in scores)} | {100 * row['argmax_agreement']:.1f}% | "
                    f"{100 * row['greedy_token_agreement']:.1f}% | {row['exit_mean_steps']:.2f} ({row['exit_shift']:+.2f}) |")
        else:
            lines.append(f"{result['parameters'] / 1e6:.0f}M parameters, r = {result['r']}, batch 1, "
                         f"{result['threads']} threads, {result['new_tokens']} new tokens, medians of alternated rounds")
            lines.append("")
            lines.append("| setting | decode tok/s | × float32 | weights | bytes read per token | peak / resident memory |")
            lines.append("|---|---|---|---|---|---|")
            for name, row in result["settings"].items():
                lines.append(f"| `{name}` | {row['decode_tok_s_median']:.2f} | {row['speedup_median']:.2f} | "
                             f"{row['weight_bytes'] / 2**20:.0f} MiB | {row['bytes_per_token'] / 2**20:.0f} MiB | "
                             f"{row['peak_mib']:.0f} / {row['current_mib']:.0f} MiB |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("quality", "speed", "compiled", "rss", "table"))
    parser.add_argument("files", nargs="*", help="table: result files to print as markdown")
    parser.add_argument("--model", help="quality: the trained model (a model, checkpoint or run directory)")
    parser.add_argument("--data", help="quality: token shards with a val split (not with --demo)")
    parser.add_argument("--demo", action="store_true", help="quality: the model is `rdlm demo`'s (task accuracy)")
    parser.add_argument("--settings", type=lambda s: s.split(";"), default=list(SETTINGS),
                        help="';'-separated quantization specs")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4 group size (default 128; compiled: 64, which holds `small`'s 704-wide layers)")
    parser.add_argument("--preset", default="small",
                        help="compiled: the preset (random weights), or `speed`: speed's model (--hidden etc.)")
    parser.add_argument("--prompt-length", type=int, default=64, help="compiled: prompt tokens")
    parser.add_argument("--rows", type=int, default=32, help="quality: validation rows")
    parser.add_argument("--examples", type=int, default=300, help="quality --demo: test examples")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024, help="speed: model width")
    parser.add_argument("--intermediate", type=int, default=2816, help="speed: MLP width")
    parser.add_argument("--layers", default="2,4,2", help="speed: prelude,core,coda layers")
    parser.add_argument("--vocab", type=int, default=32768, help="speed: vocabulary")
    parser.add_argument("-r", type=int, default=None, help="speed (default 4), compiled (32): core iterations per token")
    parser.add_argument("--rounds", type=int, default=3, help="speed, compiled: alternated rounds")
    parser.add_argument("--blocks", type=int, default=40, help="compiled: alternated blocks of 50 iteration calls")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", help="write the results here (JSON)")
    args = parser.parse_args()
    if args.r is None:
        args.r = 32 if args.mode == "compiled" else 4
    if args.group_size is None:
        args.group_size = 64 if args.mode == "compiled" else 128
    if args.mode == "compiled" and "--settings" not in sys.argv:
        args.settings = ["int8", "int4", "w8a8"]
    if args.mode == "rss":
        return rss_child(args)
    if args.mode == "table":
        return print(table(args.files))
    result = {"quality": quality, "speed": speed, "compiled": compiled}[args.mode](args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
