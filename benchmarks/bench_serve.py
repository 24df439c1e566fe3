"""Serving throughput and latency: N concurrent streaming clients against `rdlm serve`, for a bounded
time, against offline batched `generate` on the same model and prompts.

    python benchmarks/bench_serve.py --model out/spec-tiny --clients 16 --max-batch 16 -r 32 --seconds 30
    python benchmarks/bench_serve.py --model out/spec-tiny --clients 16 --max-batch 16 -r 32 \\
        --exit-criterion latent-diff --exit-threshold 0.01             # adaptive exits at the same max r

The server runs as a subprocess (`rdlm serve` on 127.0.0.1, a free port); each client thread sends
streamed completions back to back (plain HTTP, server-sent events) until the time is up. Printed:
served completion tokens/s; time to first token and time per output token (p50/p99); offline
`generate` tokens/s for one batch of `--max-batch` of the same prompts; their ratio. Prompts are
cycled from --prompt-text. This is a script, not a test.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
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


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rdlm", "serve", args.model, "--port", str(port), "--max-batch",
           str(args.max_batch), "--max-queue", str(4 * args.clients), "-r", str(args.num_steps),
           "--model-name", "bench", "--max-length", str(args.max_length)]
    if args.exit_criterion:
        cmd += ["--exit-criterion", args.exit_criterion]
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


def serve(args, prompts: list[str]) -> dict:
    import json

    httpx = http_client()  # raw SSE keeps the clients light

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(args, port)
    ttft, tpot, tokens, lock = [], [], [0], threading.Lock()
    stop_at = time.perf_counter() + args.seconds
    url = f"http://127.0.0.1:{port}/v1/completions"

    def client(k: int) -> None:
        j = k
        with httpx.Client(timeout=300) as http:
            while time.perf_counter() < stop_at:
                body = {"model": "bench", "prompt": prompts[j % len(prompts)], "stream": True, "temperature": 0,
                        "max_tokens": args.new_tokens, "stream_options": {"include_usage": True}}
                t0, stamps, used = time.perf_counter(), [], 0
                with http.stream("POST", url, json=body) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if '"usage"' in line and '"choices": []' in line:
                            used = json.loads(line[6:])["usage"]["completion_tokens"]
                        else:
                            stamps.append(time.perf_counter())
                j += args.clients
                with lock:
                    tokens[0] += used
                    if stamps:
                        ttft.append(stamps[0] - t0)
                        if used > 1:
                            tpot.append((stamps[-1] - stamps[0]) / (used - 1))

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.seconds + 600)
        elapsed = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return dict(tps=tokens[0] / elapsed, ttft=ttft, tpot=tpot, requests=len(ttft))


def offline(args, prompts: list[str]) -> float:
    import rdlm
    from rdlm.inference.generate import GenerationConfig, generate
    from rdlm.data.tokenizer import Tokenizer

    model, tok = rdlm.load_pretrained(args.model).eval(), Tokenizer.from_dir(args.model)
    ids = [tok.encode(prompts[k % len(prompts)], add_bos=True) for k in range(args.max_batch)]
    config = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens, stop_tokens=(tok.eos_id,),
                              exit_criterion=args.exit_criterion, exit_threshold=args.exit_threshold)
    generate(model, ids, config)  # warm-up
    t0 = time.perf_counter()
    result = generate(model, ids, config)
    return sum(len(t) for t in result.tokens) / (time.perf_counter() - t0)


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
    p.add_argument("--threads", type=int, help="torch threads of the offline run (the server takes torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = args.prompt_text.split("|")
    load = os.getloadavg()[0]
    served = serve(args, prompts)
    offline_tps = offline(args, prompts)
    mode = f"{args.exit_criterion} {args.exit_threshold}" if args.exit_criterion else "fixed"
    print(f"model {args.model} | r {args.num_steps} ({mode}) | clients {args.clients} | max batch {args.max_batch} "
          f"| {args.new_tokens} new tokens | {args.seconds:.0f} s | load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"served   {served['tps']:8.1f} tok/s over {served['requests']} requests | TTFT p50 "
          f"{percentile(served['ttft'], 0.5) * 1e3:.0f} ms p99 {percentile(served['ttft'], 0.99) * 1e3:.0f} ms | "
          f"per token p50 {percentile(served['tpot'], 0.5) * 1e3:.1f} ms p99 {percentile(served['tpot'], 0.99) * 1e3:.1f} ms")
    print(f"offline  {offline_tps:8.1f} tok/s (generate, one batch of {args.max_batch})")
    print(f"served / offline {served['tps'] / offline_tps:.2f}"
          f" | mean TTFT {statistics.mean(served['ttft']) * 1e3:.0f} ms" if served["ttft"] else "")


if __name__ == "__main__":
    main()
