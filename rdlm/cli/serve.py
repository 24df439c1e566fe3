"""`rdlm serve MODEL`: an OpenAI-compatible HTTP server (rdlm/inference/server/app.py) with continuous batching."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys

from rdlm.cli import add_model_argument, model_and_adapters
from rdlm.cli.generate import add_generation_args, config_from_args, engine_from_args, load_model_and_tokenizer


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model directory (with tokenizer.json) over /v1/completions, "
        "/v1/chat/completions, /v1/models, /health and /metrics. Requests join and leave "
        "the batch between core iterations; the generation options below are the defaults "
        "a request's fields override (--max-new-tokens: max_tokens).",
    )
    add_model_argument(
        p,
        "a model directory, training checkpoint step-N/ or run directory with tokenizer.json (default with --lora: "
        "the first adapter's base)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--model-name", help="the name clients use (default: the directory's name)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row before 503")
    p.add_argument(
        "--max-length",
        type=int,
        help="tokens per row, prompt and completion (default: the model's context, at most 2048)",
    )
    p.add_argument(
        "--num-slots",
        type=int,
        help="core cache slots per token, the largest r without kv_cache_budget (default: the default r, at least 32)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RDLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ requests (default: $RDLM_API_KEY; none)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="largest request body accepted, in bytes (default 1 MiB); larger ones get 413",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt token-iterations per step of the batch: prompts run their iterations inside the "
        "steps (a longer prompt in chunks of this many tokens, one iteration per step), so running "
        "requests keep decoding",
    )
    p.add_argument(
        "--coda-every",
        type=int,
        default=8,
        help="core iterations a row whose token is done may wait for others, so that their codas (and the head) run "
        "in one call",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="time each phase of the batch's steps and export them on /metrics "
        "(rdlm_batch_phase_seconds; on CUDA a device sync around each phase)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM; those still running then end "
        "with an error (a stream's error event, a 503)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request may take to send its body after its headers (then 408)",
    )
    p.add_argument(
        "--max-num-steps",
        type=int,
        default=256,
        help="the most core iterations per token (num_steps) a request may ask for (default 256)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the batch in a process of its own, the HTTP server in this one (a CPU model; default: where its "
        "compiled step runs on one thread and a CPU is left for HTTP, pinned to its own CPU)",
    )
    add_generation_args(p, named_adapters=True)
    p.set_defaults(func=run)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    try:
        from rdlm.inference.server.app import ServeConfig, create_app
        from rdlm.inference.server.http_guard import uvicorn_server
    except ImportError as err:
        raise ValueError(
            f"rdlm serve needs the serve extra ({err.name} is missing): pip install 'rdlm[serve]'"
        ) from None
    from pathlib import Path

    if args.draft_steps is not None:
        raise ValueError("--draft-steps: speculative decoding is not available in the server")
    source, adapters = model_and_adapters(args)
    model, tokenizer = load_model_and_tokenizer(
        source,
        args.dtype,
        args.device,
        need_tokenizer=True,
        quantize=args.quantize,
        group_size=args.quantize_group_size,
        threads=args.threads,
        adapters=adapters,
        any_base=args.lora_any_base,
        without_tokenizer="the server takes and returns text: give a run directory or model directory with "
        "tokenizer.json",
    )
    defaults = config_from_args(args, model)
    c = model.config
    max_length = args.max_length if args.max_length is not None else min(c.context_length, 2048)
    num_slots = args.num_slots if args.num_slots is not None else max(defaults.max_steps, 32)
    name = args.model_name or Path(source).resolve().name
    for flag, value in (("--prefill-chunk", args.prefill_chunk), ("--coda-every", args.coda_every)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_num_steps < defaults.max_steps:
        raise ValueError(f"--max-num-steps {args.max_num_steps} is below the default r ({defaults.max_steps})")
    for flag, seconds in (
        ("--shutdown-timeout", args.shutdown_timeout),
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{flag} must be a positive number of seconds, got {seconds}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    # --exit-sync-every: iterations between the host's looks, the batch's steps and a lockstep token's alike
    # (by default every 4); --compile: the batch's static step (by default compiled on the CPU for at most 64 rows)
    engine = engine_from_args(args)
    exit_sync_every = ServeConfig.exit_sync_every if engine.exit_sync_every is None else engine.exit_sync_every
    config = ServeConfig(
        model_name=name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_length=max_length,
        num_slots=num_slots,
        exit_sync_every=exit_sync_every,
        defaults=defaults,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        prefill_chunk=args.prefill_chunk,
        coda_every=args.coda_every,
        profile=args.profile,
        compile=engine.compile,
        max_num_steps=args.max_num_steps,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        engine_process=args.engine_process,
    )
    if args.api_key is None and not _loopback(args.host):
        print(
            f"rdlm serve: warning: listening on {args.host} without an API key; anyone who can reach it may "
            f"use it (--api-key or $RDLM_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    app = create_app(model, tokenizer, config)
    batch = app.state.worker.info
    static = "compiled" if batch.compiled else "on" if batch.static else "off"  # (compiled: the CPU's step)
    if not batch.compiled and adapters and batch.device == "cpu":
        static += " (not compiled with LoRA adapters)"
    served = f", LoRA adapters {', '.join(adapters)}" if adapters else ""
    own = ""
    if app.state.worker.engine is not None:
        own = ", the batch in its own process" + (f" on CPU {batch.cpu}" if batch.cpu is not None else "")
    if batch.prompt_threads is not None:  # (measured at warm-up: docs/generation.md)
        own += f", prompt calls of {batch.prompt_threads[1]}+ tokens on {batch.prompt_threads[0]} threads"
    print(
        f"rdlm serve: {name} on http://{args.host}:{args.port} (batch {args.max_batch}, {max_length} tokens "
        f"per row, {num_slots} core slots, KV cache {batch.cache_bytes / 2**30:.2f} GiB, default r "
        f"{defaults.num_steps}, static step {static}{served}{own})",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again: a finished
    # shutdown is a normal exit here, not a death by signal.
    stopped = []
    previous = {
        sig: signal.signal(sig, lambda number, frame: stopped.append(number)) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    log = logging.getLogger("rdlm")  # the server's errors, each 500 with its traceback, on stderr
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("rdlm serve: %(levelname)s: %(message)s"))
        log.addHandler(handler)
    try:
        uvicorn_server(app, args.host, args.port, args.header_timeout, args.shutdown_timeout, log_level="warning").run()
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
    print(
        f"rdlm serve: shut down{' on ' + signal.Signals(stopped[0]).name if stopped else ''}",
        file=sys.stderr,
        flush=True,
    )
    return 0
