"""The same checkpoint at the same r served by `rdlm serve` and by vLLM with rdlm's plugin (docs/vllm.md):
throughput and latency as ratios, at fixed r and with an exit criterion, and the KV-cache memory per token of
each mode. Run it in the vLLM environment (both servers then run on the same torch):

    bash scripts/setup.sh --vllm
    OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python benchmarks/bench_vllm.py --seconds 20 --rounds 2

Each server runs as a subprocess on 127.0.0.1 (a free port); `--clients` threads send streamed completions
of `--new-tokens` back to back from the same prompts until `--seconds` pass. The two servers alternate
(rdlm, vLLM, then vLLM, rdlm, ...) for `--rounds` rounds per mode; printed per run: completion tokens/s, time
to first token and time per output token (p50), and the ratio vLLM / rdlm of each round's pair. Below each run,
the server's own account of the first token (its /metrics, means): from the request's arrival and from its
admission (rdlm: joining the batch; vLLM: first scheduled); between the two lie waiting for the step in
flight, queueing and tokenizing (nan where a server's version lacks the histogram).

Requests of the same length started together end together, so with `--spread 0` (the default) the clients
send their next requests in bursts (a burst of 7 of 8, measured on two cores, either server), each server
prefilling several prompts in one step. `--spread s` gives the k-th request of the run `--new-tokens` +/- s
tokens (a fixed pattern in k, the same for both servers), so that requests end and arrive apart.

Then, in this process, vLLM's engine alone (`vllm.LLM`) on the same prompts: tokens/s and the core iterations
each decoded token ran, at fixed r and with the exit criterion (the plugin counts them: `model.stats`),
alternated for `--rounds` rounds. A model `rdlm demo` trained (its directory has `task_tokenizer.json`) is run
there on `--task-prompts` unseen test examples of its task instead (prompt, then the reply marker and the
answer, then whatever the model goes on with up to `--new-tokens`): the answers' accuracy at fixed r and with
exits, and whether every prompt's tokens equal `rdlm generate`'s with the same settings at batch 1.
`--prompt-seed` draws those examples with another seed, for prompts a design run has not seen. Compiled exit
runs also print the iterations a decode step skipped. `--compiled-only` measures vLLM's default (compiled)
modes only, and `--engine-processes` runs each engine in a fresh process of its own: measure with
`VLLM_DISABLE_COMPILE_CACHE=1`, since engines loaded from vLLM's compile cache were seen to run 2.5-3x slower.

Without --model, a random model of rdlm's `small` shape (8 heads of 32: vLLM's CPU attention takes no
narrower) with a tokenizer trained on examples/lm_eval_task is written to a temporary directory; exits mean
little on random weights, so pass a trained model (`rdlm train`, then `rdlm convert`) to judge them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serve import (  # noqa: E402
    free_port,
    histogram_means,
    http_client,
    percentile,
    wait_until_serving,
)

PROMPTS = ["The capital of France is", "Two plus two is", "Ravens are black birds and",
           "The sun rises in the", "Water boils at one hundred degrees", "A week has seven"]


def write_model(directory: Path) -> Path:
    import torch

    import rdlm
    from rdlm.data.tokenizer import train_tokenizer

    torch.manual_seed(0)
    rdlm.save_pretrained(rdlm.build_model("small"), directory)
    lines = (ROOT / "examples" / "lm_eval_task" / "facts.jsonl").read_text().splitlines(keepends=True) * 20
    train_tokenizer(lines, vocab_size=512).save(directory)
    return directory


def start(kind: str, args, port: int, criterion: str | None, log: Path) -> subprocess.Popen:
    if kind == "rdlm":
        cmd = [sys.executable, "-m", "rdlm", "serve", args.model, "--port", str(port), "--model-name", "bench",
               "--max-batch", str(args.clients), "--max-queue", str(4 * args.clients), "-r", str(args.num_steps),
               "--dtype", "float32"]
        if criterion:
            cmd += ["--exit-criterion", criterion, "--exit-threshold", str(args.exit_threshold)]
    else:
        overrides = {"rdlm_num_steps": args.num_steps}
        if criterion:
            overrides.update(rdlm_exit_criterion=criterion, rdlm_exit_threshold=args.exit_threshold)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.clients),
               "--hf-overrides", json.dumps(overrides), "--no-enable-prefix-caching"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, port, 300, log, name="rdlm serve" if kind == "rdlm" else "vLLM's server")
    except SystemExit:
        proc.kill()
        raise
    return proc


def max_tokens(args, j: int) -> int:
    """The j-th request's completion length: `--new-tokens`, spread by `--spread` (a fixed pattern in j)."""
    return args.new_tokens + (j * 7919 + 13) % (2 * args.spread + 1) - args.spread


# Each server's own histograms of a request's first token (/metrics): (from arrival, from admission).
FIRST_TOKEN = {"rdlm": ("rdlm_time_to_first_token_seconds", "rdlm_prefill_seconds"),
               "vllm": ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds")}


def measure(kind: str, args, criterion: str | None, log: Path, texts: list[str], eos: int) -> dict:
    """Completion tokens/s, TTFT (p50 and p90) and TPOT (p50) of `--clients` streaming clients for `--seconds`,
    and the server's own mean first-token times (`FIRST_TOKEN`, bench_serve.histogram_means)."""
    httpx = http_client()
    port = free_port()
    proc = start(kind, args, port, criterion, log)
    url = f"http://127.0.0.1:{port}/v1/completions"
    ttft, tpot, tokens, lock = [], [], [0], threading.Lock()
    try:
        begin = time.perf_counter()
        stop_at = begin + args.seconds

        def client(k: int) -> None:
            j = k
            with httpx.Client(timeout=300) as http:
                while time.perf_counter() < stop_at:
                    body = {"model": "bench", "prompt": texts[j % len(texts)], "stream": True, "temperature": 0,
                            "max_tokens": max_tokens(args, j), "stream_options": {"include_usage": True}}
                    if kind == "vllm":
                        body["stop_token_ids"] = [eos]  # where rdlm serve stops: the tokenizer's end of text
                    t0, stamps, used = time.perf_counter(), [], 0
                    with http.stream("POST", url, json=body) as response:
                        for line in response.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            event = json.loads(line[6:])
                            if event.get("usage") and not event.get("choices"):
                                used = event["usage"]["completion_tokens"]
                            elif event.get("choices"):
                                stamps.append(time.perf_counter())
                    j += args.clients
                    with lock:
                        tokens[0] += used
                        if stamps:  # an event may carry several tokens: time per output token counts tokens
                            ttft.append(stamps[0] - t0)
                            if used > 1:
                                tpot.append((stamps[-1] - stamps[0]) / (used - 1))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - begin
        means = histogram_means(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text, FIRST_TOKEN[kind])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    arrival, admission = (means[name] for name in FIRST_TOKEN[kind])
    return {"tok_s": tokens[0] / elapsed, "ttft": percentile(ttft, 0.5), "ttft90": percentile(ttft, 0.9),
            "tpot": percentile(tpot, 0.5), "server_ttft": arrival, "server_prefill": admission}


def task_prompts(args, count: int | None = None) -> tuple[list[list[int]], list[str], list[str]] | None:
    """Unseen test examples of a demo model's task (--prompt-seed, 1234 unless said; the demo trains on seed 0):
    token ids, replies, prompts."""
    path = Path(args.model) / "task_tokenizer.json"
    if not path.is_file():
        return None
    from rdlm.demo.tasks import CharTokenizer, generate

    spec = json.loads(path.read_text())
    tok = CharTokenizer(spec["alphabet"])
    examples = generate(spec["task"], args.task_prompts if count is None else count, seed=args.prompt_seed,
                        split="test")
    return [tok.encode(e.prompt) for e in examples], [e.reply for e in examples], [e.prompt for e in examples]


def engine_alone(args, criterion: str | None, prompts: list[list[int]], new_tokens: int, compiled: bool = False):
    """vLLM's engine in this process on `prompts` (one batch): tokens/s, iterations per decoded token, tokens.
    `compiled`: vLLM's default compilation left on (the forward compiles; with an exit criterion it stops at a
    look once every token has exited, and decode steps of at most --exit-eager-tokens tokens run the eager loop).
    With --engine-processes the engine runs in a fresh process of its own (this function, there)."""
    if args.engine_processes:
        import multiprocessing

        here = argparse.Namespace(**{**vars(args), "engine_processes": False})  # the child runs the engine itself
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(engine_alone, (here, criterion, prompts, new_tokens, compiled))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    import vllm

    overrides = {"rdlm_num_steps": args.num_steps}
    if criterion:
        overrides.update(rdlm_exit_criterion=criterion, rdlm_exit_threshold=args.exit_threshold)
        if args.exit_eager_tokens:
            overrides.update(rdlm_exit_eager_tokens=args.exit_eager_tokens)
        if args.exit_sync_every:
            overrides.update(rdlm_exit_sync_every=args.exit_sync_every)
    llm = vllm.LLM(args.model, dtype="float32", enforce_eager=not compiled, max_model_len=args.max_model_len,
                   kv_cache_memory_bytes=1 << 30, skip_tokenizer_init=True, hf_overrides=overrides,
                   enable_prefix_caching=False)  # repeated prompts: each is computed, as in rdlm serve
    params = vllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)  # warm-up: the same batch once
    repeats = max(1, round(2.0 / (time.perf_counter() - t0)))  # about 2 s timed: a batch alone is too short
    before = llm.apply_model(lambda model: dict(vars(model.stats)))[0]
    core_layers = llm.apply_model(lambda model: model.config.core_layers)[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        out = llm.generate(batch, params, use_tqdm=False)
    seconds, cpu = (time.perf_counter() - t0) / repeats, (time.process_time() - cpu0) / repeats
    after = llm.apply_model(lambda model: dict(vars(model.stats)))[0]
    caches = llm.apply_model(lambda model: len(model.kv))[0]
    del llm
    gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in out]
    # A compiled forward's skipped iterations: the core cache slots it filled without attending, one per core
    # layer and skipped iteration of a decode step (below a shared cache's k slots: fewer), over the decode
    # steps (a batch decodes its tokens after the first together: new_tokens - 1 steps a generation).
    fills = after["compiled_fills"] - before["compiled_fills"]
    skipped = fills / (core_layers * (new_tokens - 1) * repeats) if new_tokens > 1 else float("nan")
    decoded = after["decoded_tokens"] - before["decoded_tokens"]
    steps = after["steps"] - before["steps"]  # (counts over every repeat: the ratios are per token and step)
    # A compiled forward counts nothing (NaN here); an eager one at fixed r counts no decoded tokens (r each).
    per_token = (after["token_iterations"] - before["token_iterations"]) / decoded if decoded else \
        (args.num_steps if steps else float("nan"))
    loop = (after["step_iterations"] - before["step_iterations"]) / steps if steps else float("nan")
    return {"tok_s": sum(map(len, tokens)) / seconds, "iterations_per_token": per_token, "caches": caches,
            "cpu_ms_per_token": 1e3 * cpu / sum(map(len, tokens)),
            "loop_iterations_per_step": loop, "tokens": tokens, "skipped_per_decode_step": skipped,
            "looks_per_step": (after["looks"] - before["looks"]) / steps if steps else float("nan")}


def rdlm_tokens(args, criterion: str | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`rdlm generate`'s greedy tokens for each prompt alone, with the same depth and criterion."""
    import torch

    from rdlm.inference.generate import generate
    from rdlm.inference.params import GenerationConfig
    from rdlm.model.huginn import load_pretrained

    model = load_pretrained(args.model, dtype=torch.float32)
    config = GenerationConfig(num_steps=args.num_steps, max_new_tokens=new_tokens, exit_criterion=criterion,
                              exit_threshold=args.exit_threshold if criterion else None)
    return [generate(model, p, config).tokens[0] for p in prompts]


def engine_report(args, criteria: list) -> None:
    """vLLM's engine alone at each batch size of --batches: fixed r eager, fixed r compiled (vLLM's default)
    and each exit criterion, alternated in --rounds rounds (the best round of each kept), with the ratios of the
    exits to fixed r in the same run."""
    settings = (True,) if args.compiled_only else (False, True)
    modes = [(None, compiled) for compiled in settings] + [(c, compiled) for c in criteria if c is not None
                                                             for compiled in settings]
    for batch in args.batches:
        engine_batch(args, modes, batch)


def engine_batch(args, modes: list, batch: int) -> None:
    task = task_prompts(args, batch)
    if task is None:
        from rdlm.data.tokenizer import Tokenizer

        tok = Tokenizer.load(args.model)
        prompts, replies, new_tokens = [tok.encode(PROMPTS[j % len(PROMPTS)]) for j in range(batch)], None, \
            args.new_tokens
    else:
        (prompts, replies, _), new_tokens = task, args.new_tokens  # the reply, then what the model goes on with
        from rdlm.demo.tasks import CharTokenizer

        alphabet = json.loads((Path(args.model) / "task_tokenizer.json").read_text())["alphabet"]
        decode = CharTokenizer(alphabet).decode
    best: dict = {}
    for k in range(args.rounds):  # the modes alternate, each in an engine of its own; the best round is kept
        for mode in modes if k % 2 == 0 else modes[::-1]:
            e = engine_alone(args, mode[0], prompts, new_tokens, compiled=mode[1])
            print(f"vLLM engine alone, {batch} prompts, round {k + 1}, {label_of(args, mode)}: {e['tok_s']:.1f} "
                  f"tok/s, {e['cpu_ms_per_token']:.3f} CPU ms per token (load {os.getloadavg()[0]:.2f})", flush=True)
            if mode not in best or e["tok_s"] > best[mode]["tok_s"]:
                best[mode] = e
    for mode in modes:
        e = best[mode]
        line = (f"vLLM engine alone, {label_of(args, mode):28} {len(prompts)} prompts: {e['tok_s']:8.1f} tok/s "
                f"({e['cpu_ms_per_token']:.3f} CPU ms per token), "
                f"{e['iterations_per_token']:.2f} iterations per decoded token, {e['loop_iterations_per_step']:.2f} "
                f"loop iterations per step, {e['looks_per_step']:.2f} looks per step, {e['caches']} KV caches")
        if mode[0] is not None and mode[1]:  # (the eager loop's stops are counted above)
            line += f", {e['skipped_per_decode_step']:.2f} iterations a decode step skipped (compiled)"
        if mode[0] is not None:
            fixed = best[(None, mode[1])]  # the same compilation setting
            line += "; vs fixed r ({}) {:.2f}x tokens/s, {:.2f}x CPU time per token".format(
                "compiled" if mode[1] else "eager", e["tok_s"] / fixed["tok_s"],
                fixed["cpu_ms_per_token"] / e["cpu_ms_per_token"])
        if replies is not None:
            correct = sum(decode(t).startswith(r) for t, r in zip(e["tokens"], replies, strict=True))
            same = e["tokens"] == rdlm_tokens(args, mode[0], prompts, new_tokens)
            line += f"; accuracy {correct}/{len(replies)}; tokens equal rdlm generate's at batch 1: {same}"
        print(f"{line} (load {os.getloadavg()[0]:.2f})", flush=True)


def label_of(args, mode: tuple) -> str:
    criterion, compiled = mode
    name = "fixed r" if criterion is None else f"{criterion} < {args.exit_threshold:g}"
    return f"{name}, {'compiled' if compiled else 'eager'}"


def cache_bytes_per_token(args) -> dict:
    """KV-cache bytes one token holds in each mode (fp32): its prelude and coda layers, and the core's r
    (per-iteration), k (rdlm_cache_slots = k) or 1 (shared) copies."""
    from rdlm.model.huginn import read_config

    c = read_config(args.model)
    layer = 2 * c.kv_heads * c.head_dim * 4
    outside = c.prelude_layers + c.coda_layers
    modes = {"per-iteration (vLLM) / full (rdlm)": args.num_steps}
    for k in (8, 4):
        if k < args.num_steps:
            modes[f"rdlm_cache_slots={k} (rdlm: cache_slots={k})"] = k
    modes["shared, one slot (vLLM: rdlm_cache=shared; rdlm: cache_slots=1)"] = 1
    return {mode: (outside + copies * c.core_layers) * layer for mode, copies in modes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory with tokenizer.json (default: a random `small` one)")
    parser.add_argument("-r", "--num-steps", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="rdlm/vLLM pairs per mode, alternated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--spread", type=int, default=0,
                        help="request k asks for --new-tokens +/- this many tokens (a fixed pattern in k), so that "
                             "requests end and arrive apart (default 0: the same length, arrivals in bursts)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--exit-criterion", default="latent-diff", help="the adaptive mode's ('none': fixed r only)")
    parser.add_argument("--exit-threshold", type=float, default=0.03)
    parser.add_argument("--exit-eager-tokens", type=int, default=0,
                        help="rdlm_exit_eager_tokens of the compiled engine-alone runs with exits: decode steps of at "
                             "most this many tokens run the eager loop (default 0: every step compiled)")
    parser.add_argument("--task-prompts", type=int, default=64, help="test examples for a demo model's servers")
    parser.add_argument("--prompt-seed", type=int, default=1234,
                        help="the seed a demo model's test examples are drawn with (default 1234; the demo trains "
                             "on 0): a new seed gives prompts a design run has not seen")
    parser.add_argument("--exit-sync-every", type=int, default=0,
                        help="rdlm_exit_sync_every of the runs with exits (default 0: the plugin's own)")
    parser.add_argument("--compiled-only", action="store_true",
                        help="engine-alone runs: the compiled modes only (vLLM's default), not the eager ones")
    parser.add_argument("--engine-processes", action="store_true",
                        help="engine-alone runs: each engine in a fresh process of its own, so none inherits "
                             "another's compiled state (measure with VLLM_DISABLE_COMPILE_CACHE=1: engines "
                             "loaded from vLLM's compile cache were seen to run 2.5-3x slower, docs/vllm.md)")
    parser.add_argument("--batches", default="1,8,64",
                        help="prompts per batch of the engine-alone runs, comma-separated (a demo model: its test "
                             "examples; otherwise the fixed prompts, repeated)")
    parser.add_argument("--no-servers", action="store_true", help="the engine alone only (no HTTP servers)")
    parser.add_argument("--no-engine", action="store_true", help="the HTTP servers only (no engine-alone runs)")
    args = parser.parse_args()
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if any(b < 1 for b in args.batches):
        parser.error("--batches must be at least 1 each")
    if args.exit_sync_every < 0:
        parser.error("--exit-sync-every must be at least 0")
    for name in ("num_steps", "clients", "rounds", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.spread < args.new_tokens:
        parser.error(f"--spread must be at least 0 and less than --new-tokens ({args.new_tokens}), got {args.spread}")
    if not args.seconds > 0:
        parser.error("--seconds must be > 0")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(write_model(Path(tmp) / "model"))
        modes = [None] + ([args.exit_criterion] if args.exit_criterion != "none" else [])
        from rdlm.data.tokenizer import Tokenizer

        eos = Tokenizer.load(args.model).eos_id
        task = task_prompts(args)
        texts = PROMPTS if task is None else task[2]
        spread = f" +/- {args.spread}" if args.spread else ""
        print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; model {args.model}, r = "
              f"{args.num_steps}, {args.clients} clients x {args.new_tokens}{spread} new tokens, {args.seconds:g} s "
              "per run")
        for criterion in [] if args.no_servers else modes:
            label = "fixed r" if criterion is None else f"{criterion} < {args.exit_threshold:g}"
            ratios = []
            for k in range(args.rounds):
                order = ("rdlm", "vllm") if k % 2 == 0 else ("vllm", "rdlm")
                got = {kind: measure(kind, args, criterion, Path(tmp) / f"{kind}.log", texts, eos) for kind in order}
                ratios.append(got["vllm"]["tok_s"] / got["rdlm"]["tok_s"])
                for kind in order:
                    m = got[kind]
                    print(f"{label:24} round {k + 1} {kind:5} {m['tok_s']:8.1f} tok/s  TTFT p50 {m['ttft'] * 1e3:7.1f}"
                          f" p90 {m['ttft90'] * 1e3:7.1f} ms"
                          f"  TPOT p50 {m['tpot'] * 1e3:6.1f} ms  (load {os.getloadavg()[0]:.2f})", flush=True)
                    print(f"{'':24}   in the server, first token from arrival {m['server_ttft'] * 1e3:6.1f} ms, "
                          f"from admission {m['server_prefill'] * 1e3:6.1f} ms (means)", flush=True)
            print(f"{label:24} vLLM / rdlm serve tokens/s: " + ", ".join(f"{r:.2f}" for r in ratios), flush=True)
        if args.no_engine:
            return
        engine_report(args, modes)
        for mode, size in cache_bytes_per_token(args).items():
            print(f"KV cache per token, {mode}: {size} bytes")


if __name__ == "__main__":
    main()
