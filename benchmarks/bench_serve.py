"""Serving throughput and latency: N concurrent streaming clients against `rdlm serve`, for a bounded
time, against offline batched `generate` on the same model and prompts.

    python benchmarks/bench_serve.py --model out/spec-tiny --clients 16 --max-batch 16 -r 32 --seconds 30
    python benchmarks/bench_serve.py --model out/spec-tiny --clients 16 --max-batch 16 -r 32 \\
        --exit-criterion latent-diff --exit-threshold 0.01             # adaptive exits at the same max r

The server runs as a subprocess (`rdlm serve` on 127.0.0.1, a free port); each client thread sends
streamed completions back to back (plain HTTP, server-sent events) until the time is up. Printed:
served completion tokens/s; time to first token and time per output token (p50/p99); offline
`generate` tokens/s for one batch of `--max-batch` of the same prompts; their ratio. With an exit
criterion the fixed-r run is measured too (unless --no-fixed), and the adaptive speed-up, served and
offline, is set against its ideal: r / the mean core iterations per token (from `usage.latent_iterations`).
Prompts are cycled from --prompt-text ('|' between prompts) or --prompt-file (one per line). This is a
script, not a test.
"""

from __future__ import annotations

import argparse
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


def start_server(args, port: int, exit_criterion: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rdlm", "serve", args.model, "--port", str(port), "--max-batch",
           str(args.max_batch), "--max-queue", str(4 * args.clients), "-r", str(args.num_steps),
           "--model-name", "bench", "--max-length", str(args.max_length), "--exit-sync-every", str(args.sync_every),
           "--coda-every", str(args.coda_every), "--prefill-chunk", str(args.prefill_chunk)]
    if args.profile:
        cmd += ["--profile"]
    if exit_criterion:
        cmd += ["--exit-criterion", exit_criterion]
        if args.exit_threshold is not None:
            cmd += ["--exit-threshold", str(args.exit_threshold)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env)
    httpx = http_client()
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("rdlm serve did not start")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)


def serve(args, prompts: list[str], exit_criterion: str | None) -> dict:
    import json

    httpx = http_client()  # raw SSE keeps the clients light

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(args, port, exit_criterion)
    ttft, tpot, tokens, iterations, lock = [], [], [0], [0], threading.Lock()
    stop_at = time.perf_counter() + args.seconds
    url = f"http://127.0.0.1:{port}/v1/completions"

    def client(k: int) -> None:
        j = k
        with httpx.Client(timeout=300) as http:
            while time.perf_counter() < stop_at:
                body = {"model": "bench", "prompt": prompts[j % len(prompts)], "stream": True, "temperature": 0,
                        "max_tokens": args.new_tokens, "stream_options": {"include_usage": True}}
                t0, stamps, used, spent = time.perf_counter(), [], 0, 0
                with http.stream("POST", url, json=body) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if '"usage"' in line and '"choices": []' in line:
                            usage = json.loads(line[6:])["usage"]
                            used, spent = usage["completion_tokens"], usage["latent_iterations"]
                        else:
                            stamps.append(time.perf_counter())
                j += args.clients
                with lock:
                    tokens[0] += used
                    iterations[0] += spent
                    if stamps:
                        ttft.append(stamps[0] - t0)
                        if used > 1:
                            tpot.append((stamps[-1] - stamps[0]) / (used - 1))

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
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
        elif line.startswith(("rdlm_time_to_first_token_seconds_sum ", "rdlm_time_to_first_token_seconds_count ")):
            phases[line.split()[0]] = float(line.rsplit(" ", 1)[1])
    return dict(tps=tokens[0] / elapsed, ttft=ttft, tpot=tpot, requests=len(ttft), seconds=elapsed,
                mean_iterations=iterations[0] / max(tokens[0], 1), phases=phases, clients_cpu=clients_cpu,
                server_cpu=server_cpu)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def offline(args, prompts: list[str], exit_criterion: str | None) -> dict:
    import rdlm
    from rdlm.inference.generate import GenerationConfig, generate
    from rdlm.data.tokenizer import Tokenizer

    model, tok = rdlm.load_pretrained(args.model).eval(), Tokenizer.from_dir(args.model)
    ids = [tok.encode(prompts[k % len(prompts)], add_bos=True) for k in range(args.max_batch)]
    config = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens, stop_tokens=(tok.eos_id,),
                              exit_criterion=exit_criterion, exit_threshold=args.exit_threshold if exit_criterion else None)
    generate(model, ids, config)  # warm-up
    t0 = time.perf_counter()
    result = generate(model, ids, config)
    tokens = sum(len(t) for t in result.tokens)
    return dict(tps=tokens / (time.perf_counter() - t0), mean_iterations=sum(map(sum, result.steps)) / tokens)


def profile(args, prompts: list[str], exit_criterion: str | None) -> dict:
    """The server's batch in this process, without HTTP: 2 x --max-batch requests run until idle, with the
    seconds of each phase of a step (ContinuousBatch(profile=True)) and what is left (host bookkeeping)."""
    import rdlm
    from rdlm.data.tokenizer import Tokenizer
    from rdlm.inference.batching import ContinuousBatch
    from rdlm.inference.generate import GenerationConfig

    model, tok = rdlm.load_pretrained(args.model).eval(), Tokenizer.from_dir(args.model)
    config = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens, stop_tokens=(tok.eos_id,),
                              exit_criterion=exit_criterion, exit_threshold=args.exit_threshold if exit_criterion else None)
    batch = ContinuousBatch(model, args.max_batch, args.max_length, max(args.num_steps, 32), sync_every=args.sync_every,
                            coda_every=args.coda_every, prefill_chunk=args.prefill_chunk, profile=True)
    for k in range(2 * args.max_batch):
        batch.add(tok.encode(prompts[k % len(prompts)], add_bos=True), config)
    tokens = iterations = 0
    t0 = time.perf_counter()
    while batch.busy:
        for event in batch.step():
            tokens, iterations = tokens + 1, iterations + event.steps
    total = time.perf_counter() - t0
    phases = batch.take_timings()
    phases["host bookkeeping (the rest)"] = total - sum(phases.values())
    return dict(tps=tokens / total, seconds=total, phases=phases, mean_iterations=iterations / tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a trained model directory with tokenizer.json")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--num-steps", "-r", type=int, default=32)
    p.add_argument("--exit-criterion")
    p.add_argument("--exit-threshold", type=float)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--prompt-text", default="the cat sat on|12 13 14 15|a dog looked at|the old man walked to")
    p.add_argument("--prompt-file", help="prompts, one per line (instead of --prompt-text)")
    p.add_argument("--no-fixed", action="store_true", help="with an exit criterion: skip the fixed-r run")
    p.add_argument("--sync-every", type=int, default=4,
                   help="steps between the batch's looks at its exit flags (the server's --exit-sync-every)")
    p.add_argument("--coda-every", type=int, default=8,
                   help="steps a done row may wait for others' codas (the server's --coda-every)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt token-iterations per step (the server's --prefill-chunk)")
    p.add_argument("--profile", action="store_true",
                   help="print the server's seconds per phase of its steps (rdlm serve --profile), then run the "
                        "batch in this process without HTTP and print the same")
    p.add_argument("--threads", type=int, help="torch threads of the offline run (the server takes torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = (Path(args.prompt_file).read_text().splitlines() if args.prompt_file else args.prompt_text.split("|"))
    prompts = [p.replace("\\n", "\n") for p in prompts if p.strip()]
    modes = [args.exit_criterion] if args.exit_criterion else [None]
    if args.exit_criterion and not args.no_fixed:
        modes.append(None)
    load = os.getloadavg()[0]
    results = {}
    for mode in modes:
        results[mode] = (serve(args, prompts, mode), offline(args, prompts, mode))
    print(f"model {args.model} | r {args.num_steps} | sync every {args.sync_every} | coda every {args.coda_every} "
          f"| prefill chunk {args.prefill_chunk} | clients {args.clients} "
          f"| max batch {args.max_batch} "
          f"| {args.new_tokens} new tokens | {args.seconds:.0f} s | load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for mode, (served, off) in results.items():
        name = f"{mode} {args.exit_threshold}" if mode else "fixed r"
        print(f"{name}: served {served['tps']:.1f} tok/s over {served['requests']} requests, "
              f"{served['mean_iterations']:.2f} iterations/token | TTFT p50 "
              f"{percentile(served['ttft'], 0.5) * 1e3:.0f} ms p99 {percentile(served['ttft'], 0.99) * 1e3:.0f} ms | "
              f"per token p50 {percentile(served['tpot'], 0.5) * 1e3:.1f} ms p99 "
              f"{percentile(served['tpot'], 0.99) * 1e3:.1f} ms")
        ph = served["phases"]
        server_ttft = ph.get("rdlm_time_to_first_token_seconds_sum", float("nan")) / max(
            ph.get("rdlm_time_to_first_token_seconds_count", 0), 1)
        print(f"{name}: {served['seconds']:.1f} s: the batch stepped {ph.get('steps', float('nan')):.1f} s; "
              f"CPU seconds: server {served['server_cpu']:.1f}, clients {served['clients_cpu']:.1f}; "
              f"TTFT in the server (from submission) mean {server_ttft * 1e3:.0f} ms")
        if args.profile:
            steps = served["phases"].get("steps", 0.0)
            for phase, seconds in served["phases"].items():
                if phase != "steps" and not phase.startswith("rdlm_"):
                    print(f"    {phase:32s} {seconds:7.2f} s  {seconds / served['seconds']:6.1%}")
            rest = steps - sum(v for p, v in served["phases"].items() if p != "steps" and not p.startswith("rdlm_"))
            print(f"    {'host bookkeeping in steps':32s} {rest:7.2f} s  {rest / served['seconds']:6.1%}")
            print(f"    {'outside steps (idle, HTTP)':32s} {served['seconds'] - steps:7.2f} s  "
                  f"{(served['seconds'] - steps) / served['seconds']:6.1%}")
        print(f"{name}: offline {off['tps']:.1f} tok/s (generate, one batch of {args.max_batch}), "
              f"{off['mean_iterations']:.2f} iterations/token | served / offline {served['tps'] / off['tps']:.2f}")
    if args.profile:
        for mode in modes:
            name = f"{mode} {args.exit_threshold}" if mode else "fixed r"
            prof = profile(args, prompts, mode)  # the same batch in this process, every request queued at once
            print(f"{name}: in-process batch {prof['tps']:.1f} tok/s ({prof['seconds']:.1f} s, "
                  f"{prof['mean_iterations']:.2f} iterations/token); per phase:")
            for phase, seconds in prof["phases"].items():
                print(f"    {phase:32s} {seconds:7.2f} s  {seconds / prof['seconds']:6.1%}")
    if args.exit_criterion and None in results:
        for where, k in (("served", 0), ("offline", 1)):
            adaptive, fixed = results[args.exit_criterion][k], results[None][k]
            ideal = args.num_steps / adaptive["mean_iterations"]
            speedup = adaptive["tps"] / fixed["tps"]
            print(f"adaptive speed-up, {where}: {speedup:.2f}x of an ideal {ideal:.2f}x "
                  f"(r / mean iterations) = {speedup / ideal:.0%}")


if __name__ == "__main__":
    main()
