"""Serving throughput and latency: N concurrent streaming clients against `rdlm serve`, for a bounded
time, against offline batched `generate` on the same model and prompts.

    python benchmarks/bench_serve.py --model out/spec-tiny --clients 16 --max-batch 16 -r 32 --seconds 30
    python benchmarks/bench_serve.py --model out/spec-tiny --clients 16 --max-batch 16 -r 32 \\
        --exit-criterion latent-diff --exit-threshold 0.01             # adaptive exits at the same max r
    python benchmarks/bench_serve.py --random huginn-0125 --tokenizer tokenizer.json --device cuda \\
        --dtype bfloat16 --clients 16,64 --static both -r 32 --max-length 96   # Huginn's shape on a GPU

The server runs as a subprocess (`rdlm serve` on 127.0.0.1, a free port); each client thread sends
streamed completions back to back (plain HTTP, server-sent events) until the time is up. Printed:
served completion tokens/s; time to first token and time per output token (p50/p99); offline
`generate` tokens/s for one batch of `--max-batch` of the same prompts (generated again and again for a
quarter of `--seconds`); their ratio. With an exit
criterion the fixed-r run is measured too (unless --no-fixed), and the adaptive speed-up, served and
offline, is set against its ideal: r / the mean core iterations per token (from `usage.latent_iterations`),
and against the ideal that counts the prompts too: their tokens run r iterations in both runs, so with p
prompt tokens per new token the token-iterations fall from (p + 1) r to p r + mean. Two more references
say what is reachable at all: the FLOP ideal (time proportional to matmul FLOPs, so the prelude, coda and
head of every token and the prompts count too) and the depth ceiling, measured: offline `generate` at a
fixed depth equal to the adaptive run's mean iterations over its decoded tokens (prompts, and the first
token their last position gives, still at r; interpolated between the two whole depths around it)
against offline fixed r: the speed-up of an exit that gave every token the mean depth with no exit
overhead and no row waiting for another.
Prompts are cycled from --prompt-text ('|' between prompts) or --prompt-file (one per line).

`--clients 16,64` measures each client count in turn (the batch as large as the clients unless
--max-batch says otherwise); `--static both` alternates the server's eager step and its static core
step (`rdlm serve --compile`: one fixed-shape step over all rows, a CUDA graph on CUDA) for each count.
Offline `generate` runs with its own default (its static decode step in a CUDA graph on CUDA).
`--random PRESET` writes a model of that preset with random weights (in --dtype) and --tokenizer to a
temporary directory, so a large shape can be measured without a checkpoint; exits mean little on random
weights, so measure fixed r there.

`--count-reads` measures instead what a server's mixed batch pays the host per coda: 16 requests of the same
sampling settings (temperature 0.8, top-p 0.9) that differ in what a server's requests differ in (seed,
length, stop tokens, r, an exit criterion) run through the server's batch in this process (`--random PRESET`,
no tokenizer needed), and every device-to-host read (`Tensor.tolist`, `.item`) made inside a coda is counted.
It runs against any checkout (`PYTHONPATH=<other tree>`), for a before/after. This is a script, not a test.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def http_client():
    """The HTTP client the `openai` package uses: httpx2 in openai >= 3, httpx before."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx


def start_server(args, port: int, exit_criterion: str | None, clients: int, batch: int,
                 static: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rdlm", "serve", args.model, "--port", str(port), "--max-batch",
           str(batch), "--max-queue", str(4 * clients), "-r", str(args.num_steps),
           "--device", args.device, "--dtype", args.dtype, "--compile" if static else "--no-compile",
           "--model-name", "bench", "--max-length", str(args.max_length),
           "--coda-every", str(args.coda_every), "--prefill-chunk", str(args.prefill_chunk)]
    if args.sync_every is not None:
        cmd += ["--exit-sync-every", str(args.sync_every)]
    if args.profile:
        cmd += ["--profile"]
    if exit_criterion:
        cmd += ["--exit-criterion", exit_criterion]
        if args.exit_threshold is not None:
            cmd += ["--exit-threshold", str(args.exit_threshold)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env)
    wait_until_serving(proc, port, 300)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, port: int, seconds: float, log: Path | None = None,
                       name: str = "rdlm serve") -> None:
    """Until the server `proc` (`name`) answers /health on 127.0.0.1:`port`; SystemExit when it exits or
    `seconds` pass first (with the tail of its `log` when there is one)."""
    httpx = http_client()
    deadline = time.time() + seconds
    while True:
        if proc.poll() is not None or time.time() > deadline:
            tail = f":\n{log.read_text()[-3000:]}" if log is not None else ""
            raise SystemExit(f"{name} did not start within {seconds:g} s{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)


def serve(args, prompts: list[str], exit_criterion: str | None, clients: int, batch: int, static: bool) -> dict:
    import json

    httpx = http_client()  # raw SSE keeps the clients light

    port = free_port()
    proc = start_server(args, port, exit_criterion, clients, batch, static)
    ttft, tpot, tokens, iterations, prompted, lock = [], [], [0], [0], [0], threading.Lock()
    stop_at = time.perf_counter() + args.seconds
    url = f"http://127.0.0.1:{port}/v1/completions"

    def client(k: int) -> None:
        j = k
        with httpx.Client(timeout=300) as http:
            while time.perf_counter() < stop_at:
                body = {"model": "bench", "prompt": prompts[j % len(prompts)], "stream": True, "temperature": 0,
                        "max_tokens": args.new_tokens, "stream_options": {"include_usage": True}}
                t0, stamps, used, spent, prompt_tokens = time.perf_counter(), [], 0, 0, 0
                with http.stream("POST", url, json=body) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if '"usage"' in line and '"choices": []' in line:
                            usage = json.loads(line[6:])["usage"]
                            used, spent = usage["completion_tokens"], usage["latent_iterations"]
                            prompt_tokens = usage["prompt_tokens"]
                        else:
                            stamps.append(time.perf_counter())
                j += clients
                with lock:
                    tokens[0] += used
                    iterations[0] += spent
                    prompted[0] += prompt_tokens if used else 0
                    if stamps:
                        ttft.append(stamps[0] - t0)
                        if used > 1:
                            tpot.append((stamps[-1] - stamps[0]) / (used - 1))

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        clients_cpu, server_cpu = time.process_time(), cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.seconds + 600)
        elapsed = time.perf_counter() - t0
        clients_cpu, server_cpu = time.process_time() - clients_cpu, cpu_seconds(proc.pid) - server_cpu
        with httpx.Client(timeout=30) as http:
            exported = http.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    phases = {}
    for line in exported.splitlines():  # rdlm_batch_phase_seconds_total{phase="..."} 1.23
        if line.startswith("rdlm_batch_phase_seconds_total{"):
            phases[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("rdlm_batch_step_seconds_total "):
            phases["steps"] = float(line.rsplit(" ", 1)[1])
    (server_ttft,) = histogram_means(exported, ("rdlm_time_to_first_token_seconds",)).values()
    return dict(tps=tokens[0] / elapsed, ttft=ttft, tpot=tpot, requests=len(ttft), seconds=elapsed,
                server_ttft=server_ttft, mean_iterations=iterations[0] / max(tokens[0], 1), phases=phases,
                clients_cpu=clients_cpu, server_cpu=server_cpu, prompt_per_token=prompted[0] / max(tokens[0], 1))


def histogram_means(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The mean of each Prometheus histogram `names` in a /metrics exposition `text` (its series summed over their
    labels); nan for one the text lacks."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        series = key.split("{")[0]
        sums[series] = sums.get(series, 0.0) + float(value)
    return {name: sums.get(f"{name}_sum", float("nan")) / max(sums.get(f"{name}_count", 0.0), 1.0) for name in names}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of a process and the processes it started that are still running (the
    server's engine process; Linux /proc; nan elsewhere)."""
    stats: dict[int, list[str]] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(path.parent.name)] = path.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
    if pid not in stats:
        return float("nan")
    family, grew = {pid}, True
    while grew:
        children = {p for p, fields in stats.items() if int(fields[1]) in family} - family
        family |= children
        grew = bool(children)
    ticks = sum(int(stats[p][11]) + int(stats[p][12]) for p in family)
    return ticks / os.sysconf("SC_CLK_TCK")


@functools.cache
def load(model: str, dtype: str, device: str):
    """The model and tokenizer, loaded once per run of this script."""
    from rdlm.cli.generate import load_model_and_tokenizer

    return load_model_and_tokenizer(model, dtype, device, need_tokenizer=True)


def generation_config(args, tok, exit_criterion: str | None, num_steps: int | None = None):
    """The benchmark's request; `num_steps` (no exit criterion) decodes at that depth, the prompt still at r."""
    from rdlm.inference.generate import GenerationConfig

    return GenerationConfig(num_steps=num_steps or args.num_steps, prefill_steps=args.num_steps,
                            max_new_tokens=args.new_tokens, stop_tokens=(tok.eos_id,), exit_criterion=exit_criterion,
                            exit_threshold=args.exit_threshold if exit_criterion else None)


def offline_engine(args):
    """Offline `generate`'s engine settings (EngineArgs): its looks and its static step as asked."""
    from rdlm.inference.batching import EngineArgs

    compile = {"auto": None, "on": True, "off": False}[args.offline_compile]
    return EngineArgs(compile=compile, exit_sync_every=args.sync_every)


def offline(args, prompts: list[str], exit_criterion: str | None, batch: int, num_steps: int | None = None) -> dict:
    from bench_batch import timed_generate  # this folder's

    model, tok = load(args.model, args.dtype, args.device)
    ids = [tok.encode(prompts[k % len(prompts)], add_bos=True) for k in range(batch)]
    # repeated for a quarter of the served time: one batch of a few hundred tokens is too short to time alone
    config = generation_config(args, tok, exit_criterion, num_steps)
    tps, result = timed_generate(model, ids, config, args.seconds / 4, engine=offline_engine(args))
    tokens = sum(len(t) for t in result.tokens)
    # a request's first token comes from its prompt's last position, at r whatever the exit: the decode's
    # own depth is the mean over the others
    decoded = sum(max(len(t) - 1, 0) for t in result.tokens)
    return dict(tps=tps, mean_iterations=sum(map(sum, result.iterations)) / tokens,
                decode_iterations=sum(sum(s[1:]) for s in result.iterations) / max(decoded, 1),
                prompt_per_token=sum(map(len, ids)) / tokens, new_per_request=tokens / batch)


def offline_all(args, prompts: list[str], modes: list, batch: int) -> tuple[dict, dict | None]:
    """Offline `generate` of every mode and, with an exit criterion and fixed r both measured, the depth
    ceiling's two fixed depths around the adaptive run's mean iterations (prompts at r); all of them
    alternated over two rounds, the faster of each kept, so a drift of the machine's speed between them
    does not skew their ratios. (results per mode, {depth: result} or None)."""
    first = {mode: offline(args, prompts, mode, batch) for mode in modes}
    if not (args.exit_criterion and None in modes):
        return first, None
    low = max(1, int(first[args.exit_criterion]["decode_iterations"]))
    runs = {("mode", mode): (mode, None) for mode in modes}
    runs.update({("depth", k): (None, k) for k in (low, low + 1)})
    best = {("mode", mode): result for mode, result in first.items()}
    for rounds in range(2):
        for key, (mode, depth) in runs.items():
            if rounds == 0 and key in best:
                continue
            result = offline(args, prompts, mode, batch, num_steps=depth)
            if key not in best or result["tps"] > best[key]["tps"]:
                best[key] = result
    return ({mode: best["mode", mode] for mode in modes},
            {key[1]: result for key, result in best.items() if key[0] == "depth"})


def depth_ceiling(depths: dict, mean: float) -> float:
    """Offline tokens/s of fixed-depth decoding at `mean` iterations a token, the prompt still at r: what an
    exit that gave every token exactly the mean depth would reach with no exit overhead and no stragglers.
    Between the two whole depths measured the seconds per token are interpolated."""
    low, high = sorted(depths)
    seconds = {k: 1 / depths[k]["tps"] for k in (low, high)}
    return 1 / (seconds[low] + (mean - low) * (seconds[high] - seconds[low]))


def flop_ideal(args, mean: float, prompt_per_token: float, new_per_request: float) -> float:
    """The adaptive speed-up if time were proportional to matmul FLOPs: every new token runs the prelude, its
    core iterations, the coda and the head; a prompt token the prelude, r iterations and the coda (its head
    only once, ignored); attention over the mean context of a request."""
    from bench_generate import token_flops  # this folder's

    c = load(args.model, args.dtype, args.device)[0].config
    context = prompt_per_token * new_per_request + new_per_request / 2
    new = lambda iterations: token_flops(c, iterations, 1, context)  # noqa: E731
    prompts = prompt_per_token * (new(args.num_steps) - 2 * c.hidden_size * c.vocab_size)  # no head
    return (new(args.num_steps) + prompts) / (new(mean) + prompts)


def profile(args, prompts: list[str], exit_criterion: str | None, batch: int, static: bool) -> dict:
    """The server's batch in this process, without HTTP: 2 x `batch` requests run until idle, with the
    seconds of each phase of a step (ContinuousBatch(profile=True)) and what is left (host bookkeeping)."""
    from rdlm.inference.batching import ContinuousBatch
    from rdlm.inference.server.app import ServeConfig

    model, tok = load(args.model, args.dtype, args.device)
    config = generation_config(args, tok, exit_criterion)
    # the server's batch: its looks at the exit flags as `rdlm serve` makes them
    engine = ContinuousBatch(model, batch, args.max_length, max(args.num_steps, 32),
                             exit_sync_every=args.sync_every or ServeConfig.exit_sync_every,
                             coda_every=args.coda_every, prefill_chunk=args.prefill_chunk, profile=True,
                             compile=static)
    for k in range(2 * batch):
        engine.add(tok.encode(prompts[k % len(prompts)], add_bos=True), config)
    tokens = iterations = 0
    t0 = time.perf_counter()
    while engine.busy:
        for event in engine.step():
            tokens, iterations = tokens + 1, iterations + event.iterations
    total = time.perf_counter() - t0
    phases = engine.take_timings()
    phases["host bookkeeping (the rest)"] = total - sum(phases.values())
    return dict(tps=tokens / total, seconds=total, phases=phases, mean_iterations=iterations / tokens)


def write_random(args, directory: Path) -> None:
    """A model of preset `args.random` with random weights in --dtype, and --tokenizer, in `directory`."""
    import shutil

    from bench_generate import build_random  # this folder's: random weights allocated in the dtype

    from rdlm.data.tokenizer import Tokenizer
    from rdlm.model import dtypes
    from rdlm.model.huginn import save_pretrained

    if not args.tokenizer:
        raise SystemExit("--random needs --tokenizer (a tokenizer.json whose vocabulary fits the preset's)")
    size = len(Tokenizer.from_file(args.tokenizer))
    model = build_random(args.random, dtypes.resolve_dtype(args.dtype), args.device)
    if size > model.config.vocab_size:
        raise SystemExit(f"--tokenizer has {size} tokens, more than the {model.config.vocab_size} of {args.random}")
    save_pretrained(model, directory)
    shutil.copy(args.tokenizer, directory / "tokenizer.json")
    del model
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()


def counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def report(args, name: str, served: dict, off: dict, batch: int) -> None:
    print(f"{name}: served {served['tps']:.1f} tok/s over {served['requests']} requests, "
          f"{served['mean_iterations']:.2f} iterations/token | TTFT p50 "
          f"{percentile(served['ttft'], 0.5) * 1e3:.0f} ms p99 {percentile(served['ttft'], 0.99) * 1e3:.0f} ms | "
          f"per token p50 {percentile(served['tpot'], 0.5) * 1e3:.1f} ms p99 "
          f"{percentile(served['tpot'], 0.99) * 1e3:.1f} ms")
    ph, server_ttft = served["phases"], served["server_ttft"]
    print(f"{name}: {served['seconds']:.1f} s: the batch stepped {ph.get('steps', float('nan')):.1f} s; "
          f"CPU seconds: server {served['server_cpu']:.1f}, clients {served['clients_cpu']:.1f}; "
          f"TTFT in the server (from submission) mean {server_ttft * 1e3:.0f} ms")
    if args.profile:
        steps = ph.get("steps", 0.0)
        for phase, seconds in ph.items():
            if phase != "steps":
                print(f"    {phase:32s} {seconds:7.2f} s  {seconds / served['seconds']:6.1%}")
        rest = steps - sum(v for p, v in ph.items() if p != "steps")
        print(f"    {'host bookkeeping in steps':32s} {rest:7.2f} s  {rest / served['seconds']:6.1%}")
        print(f"    {'outside steps (idle, HTTP)':32s} {served['seconds'] - steps:7.2f} s  "
              f"{(served['seconds'] - steps) / served['seconds']:6.1%}")
    print(f"{name}: offline {off['tps']:.1f} tok/s (generate, one batch of {batch}), "
          f"{off['mean_iterations']:.2f} iterations/token | served / offline {served['tps'] / off['tps']:.2f}",
          flush=True)


def run_name(args, mode: str | None, static: bool) -> str:
    return (f"{mode} {args.exit_threshold}" if mode else "fixed r") + (", static step" if static else "")


def measure(args, prompts: list[str]) -> None:
    modes = [args.exit_criterion] if args.exit_criterion else [None]
    if args.exit_criterion and not args.no_fixed:
        modes.append(None)
    statics = {"off": [False], "on": [True], "both": [False, True]}[args.static]
    for clients in args.clients:
        batch = args.max_batch or clients
        load_start = os.getloadavg()[0]
        results = {}
        offline_runs, depths = offline_all(args, prompts, modes, batch)
        for mode in modes:
            for static in statics:
                results[mode, static] = (serve(args, prompts, mode, clients, batch, static), offline_runs[mode])
        print(f"model {args.random or args.model} | {args.device} {args.dtype} | r {args.num_steps} "
              f"| sync every {args.sync_every or 'default'} | coda every {args.coda_every} | prefill chunk {args.prefill_chunk} "
              f"| clients {clients} | max batch {batch} | {args.new_tokens} new tokens | {args.seconds:.0f} s "
              f"| load {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
        for (mode, static), (served, off) in results.items():
            report(args, run_name(args, mode, static), served, off, batch)
        if args.profile:
            for mode in modes:
                for static in statics:
                    name = run_name(args, mode, static)
                    prof = profile(args, prompts, mode, batch, static)  # every request queued at once, no HTTP
                    print(f"{name}: in-process batch {prof['tps']:.1f} tok/s ({prof['seconds']:.1f} s, "
                          f"{prof['mean_iterations']:.2f} iterations/token); per phase:")
                    for phase, seconds in prof["phases"].items():
                        print(f"    {phase:32s} {seconds:7.2f} s  {seconds / prof['seconds']:6.1%}")
        if args.exit_criterion and None in modes:
            adaptive_offline = offline_runs[args.exit_criterion]
            m = adaptive_offline["decode_iterations"]
            ceiling = depth_ceiling(depths, m) / offline_runs[None]["tps"]
            flops = flop_ideal(args, adaptive_offline["mean_iterations"], adaptive_offline["prompt_per_token"],
                               adaptive_offline["new_per_request"])
            measured = ", ".join(f"depth {k}: {v['tps']:.1f} tok/s" for k, v in sorted(depths.items()))
            print(f"depth ceiling: offline decoding at a fixed depth of {m:.2f} (the adaptive decode's mean; prompt "
                  f"and first token at r) is {ceiling:.2f}x offline fixed r ({measured}); FLOP ideal {flops:.2f}x",
                  flush=True)
            for static in statics:
                for where, k in (("served", 0), ("offline", 1)):
                    adaptive, fixed = results[args.exit_criterion, static][k], results[None, static][k]
                    r, m = args.num_steps, adaptive["mean_iterations"]
                    speedup = adaptive["tps"] / fixed["tps"]
                    # The prompt runs its r iterations whatever the exit criterion: p prompt tokens per new token
                    # cost p * r token-iterations in both runs.
                    p = adaptive["prompt_per_token"]
                    whole = (p * r + r) / (p * r + m)
                    print(f"adaptive speed-up, {where}{', static step' if static and k == 0 else ''}: "
                          f"{speedup:.2f}x of an ideal {r / m:.2f}x (r / mean iterations) = {speedup * m / r:.0%}; "
                          f"of {whole:.2f}x counting the prompts' iterations ({p:.2f} prompt tokens per new token) "
                          f"= {speedup / whole:.0%}; of the FLOP ideal {speedup / flops:.0%}; "
                          f"of the depth ceiling {speedup / ceiling:.0%}")


def count_reads(preset: str, rows: int = 8) -> None:
    """Host reads per coda of the server's batch over a mixed set of requests (see the module doc)."""
    from rdlm import RDLMConfig, RecurrentDepthLM
    from rdlm.inference.batching import ContinuousBatch
    from rdlm.inference.generate import GenerationConfig

    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset(preset)).eval()
    batch = ContinuousBatch(model, max_batch=rows, max_length=96, num_slots=32, exit_sync_every=4, coda_every=8)
    gen = torch.Generator().manual_seed(0)
    for k in range(2 * rows):
        prompt = torch.randint(0, model.config.vocab_size, (4 + k % 5,), generator=gen).tolist()
        depth = dict(num_steps=8 + 4 * (k % 3)) | (dict(exit_criterion="kl", exit_threshold=1e-3) if k % 4 == 1 else {})
        batch.add(prompt, GenerationConfig(max_new_tokens=12 + k % 7, temperature=0.8, top_p=0.9, seed=k,
                                           stop_tokens=(k % 50,), **depth))
    reads, codas, in_coda = [0], [0], [False]
    runner = type(batch.step_runner)
    real_coda, real_tolist, real_item = runner._coda, torch.Tensor.tolist, torch.Tensor.item

    def coda(self, *args, **kwargs):
        codas[0] += 1
        in_coda[0] = True
        try:
            return real_coda(self, *args, **kwargs)
        finally:
            in_coda[0] = False

    def counted(real):
        def read(self, *args):
            reads[0] += in_coda[0]
            return real(self, *args)
        return read

    runner._coda = coda
    torch.Tensor.tolist, torch.Tensor.item = counted(real_tolist), counted(real_item)
    try:
        rows_chosen = 0
        while batch.busy:
            events = batch.step()
            rows_chosen += len(events)
    finally:
        runner._coda, torch.Tensor.tolist, torch.Tensor.item = real_coda, real_tolist, real_item
    print(f"{codas[0]} codas over {rows_chosen} tokens of {2 * rows} requests in {rows} rows: "
          f"{reads[0] / codas[0]:.2f} host reads per coda", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a trained model directory with tokenizer.json")
    source.add_argument("--random", metavar="PRESET",
                        help="a model of this preset with random weights (e.g. huginn-0125), with --tokenizer")
    p.add_argument("--tokenizer", help="tokenizer.json for --random (its vocabulary must fit the preset's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (server and offline)")
    p.add_argument("--dtype", default="float32", help="weights and activations (server and offline)")
    p.add_argument("--clients", type=counts, default=[8],
                   help="concurrent clients; comma-separated for one measurement per count")
    p.add_argument("--max-batch", type=int,
                   help="rows of the server's batch and of offline generate (default: the client count)")
    p.add_argument("--offline-compile", choices=("auto", "on", "off"), default="auto",
                   help="offline generate's static step (auto: its default; on: compiled on the CPU, as a server "
                        "with --static on runs it)")
    p.add_argument("--static", choices=("off", "on", "both"), default="off",
                   help="the server's static core step (rdlm serve --compile); both: each count with and without")
    p.add_argument("--num-steps", "-r", type=int, default=32)
    p.add_argument("--exit-criterion")
    p.add_argument("--exit-threshold", type=float)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--prompt-text", default="the cat sat on|12 13 14 15|a dog looked at|the old man walked to")
    p.add_argument("--prompt-file", help="prompts, one per line (instead of --prompt-text)")
    p.add_argument("--no-fixed", action="store_true", help="with an exit criterion: skip the fixed-r run")
    p.add_argument("--sync-every", type=int,
                   help="the server's --exit-sync-every and offline generate's exit_sync_every (default: "
                        "theirs: the server looks every 4 steps; a token in lockstep, every iteration on the CPU "
                        "and every 4 on a GPU)")
    p.add_argument("--coda-every", type=int, default=8,
                   help="steps a done row may wait for others' codas (the server's --coda-every)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt token-iterations per step (the server's --prefill-chunk)")
    p.add_argument("--profile", action="store_true",
                   help="print the server's seconds per phase of its steps (rdlm serve --profile), then run the "
                        "batch in this process without HTTP and print the same")
    p.add_argument("--threads", type=int, help="torch threads of the offline run (the server takes torch's default)")
    p.add_argument("--count-reads", action="store_true",
                   help="host reads per coda of a mixed batch, in this process (with --random PRESET)")
    args = p.parse_args()
    if args.count_reads:
        if not args.random:
            p.error("--count-reads builds its model from --random PRESET")
        count_reads(args.random)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = (Path(args.prompt_file).read_text().splitlines() if args.prompt_file else args.prompt_text.split("|"))
    prompts = [p.replace("\\n", "\n") for p in prompts if p.strip()]
    if not args.random:
        measure(args, prompts)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as directory:
        args.model = str(Path(directory) / "model")
        t0 = time.perf_counter()
        write_random(args, Path(args.model))
        print(f"random {args.random} written in {time.perf_counter() - t0:.0f} s", flush=True)
        measure(args, prompts)


if __name__ == "__main__":
    main()
