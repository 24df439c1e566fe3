"""Training benchmarks for the note (issues 3 and 12).

    python benchmarks/bench_train.py throughput [--preset small] [--means 4,32] [--k 8]
    python benchmarks/bench_train.py throughput --device cuda --preset h2048 --batch 8 --seq-len 1024 \
        --means 32 --k 8 [--compile] [--strategy fsdp] [--memory-r 8,32,64] [--levers] [--profile DIR]
    python benchmarks/bench_train.py perplexity [--minutes 4] [--out runs/bench-ppl]

throughput on a GPU (--device cuda) runs in this process (also under torchrun, with --strategy), or
with --isolate each configuration in a fresh process (compiled blocks keep a finished model alive, so
only then is each peak memory its own): per mean r, tokens/s, MFU against the GPU's dense bf16 peak
(H100 SXM: 989 TFLOP/s) and peak GPU memory, over timed steps after warm-up ones (synchronized at both
ends; the steps in between do not wait). --memory-r also runs fixed r (no sampling) to show memory
flat in r. --levers measures the efficiency levers one by one, each on top of the previous: all off
(the logits materialized for the loss, per-tensor AdamW, a host sync per step and synchronous
host-to-device copies, s_0 drawn on the host, eager), + chunked cross-entropy, + fused AdamW, + no host
sync per step, + s_0 drawn on the GPU, + regional compile, + bf16 parameters (FSDP2's mixed precision
on one process). --profile writes a torch profiler table of one step of the first and last
configuration. Shapes: the config presets plus `h2048` (h=2048, 16 heads, (2, 4, 2), MLP 5632, vocab
65536, about 0.55B parameters: issue 12's measurement shape).

throughput: tokens/s and memory of `rdlm.train` training steps at several mean recurrences with
    backprop depth k. Each configuration runs in its own child process, so that its peak RSS
    (`resource.getrusage(RUSAGE_SELF).ru_maxrss` of the child) is its own. Also reported: the bytes of
    tensors autograd saves for backward in one forward pass (torch.autograd.graph.saved_tensors_hooks),
    the activation memory truncated backprop keeps flat, at the sampled r's extremes.
perplexity: trains the preset on the running Python's standard library source (a real corpus that is
    always available offline) for a fixed wall-clock budget, then reports validation perplexity at
    several r.

The CPU may be shared: the 1-minute load average is printed with every result.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import resource
import sys
import sysconfig
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rdlm import RDLMConfig, RecurrentDepthLM  # noqa: E402
from rdlm.data.shards import MemoryRows  # noqa: E402
from rdlm.train import TrainConfig, train  # noqa: E402


def load() -> float:
    return round(os.getloadavg()[0], 2)


def saved_bytes(model: RecurrentDepthLM, ids: torch.Tensor, num_steps: tuple[int, int]) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, num_steps=num_steps).logits.sum()
    return total


def _throughput_child(args: dict, queue) -> None:
    torch.manual_seed(0)
    config = model_config(args["preset"], mean_recurrence=args["mean"], backprop_depth=args["k"])
    model = RecurrentDepthLM(config)
    seq, batch = args["seq_len"], args["batch"]
    rows = torch.randint(0, config.vocab_size, (batch * (args["steps"] + 1), seq + 1),
                         generator=torch.Generator().manual_seed(0))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    records = []
    result = train(TrainConfig(steps=args["steps"] + 1, micro_batch_size=batch, ema_decay=None, progress=False,
                               tensorboard=False, warmup_steps=1, seed=args["seed"], threads=args["threads"]),
                   model=model, train_data=MemoryRows(rows), step_hooks=[records.append])
    timed = [r for r in records if r["kind"] == "train"][1:]  # the first step warms up allocators
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids = rows[:batch, :seq]
    activation = {f"r={n + k}": saved_bytes(model, ids, (n, k)) for n, k in ((0, min(args["k"], 1)),
                                                                             (0, args["k"]), (56, args["k"]))}
    queue.put({"mean_r": args["mean"], "k": args["k"], "sampled_r": [r["num_steps"] for r in timed],
               "tokens_per_s": round(tokens / seconds, 1), "seconds_per_step": round(seconds / len(timed), 3),
               "peak_rss_mib": round(rss_peak / 1024, 1), "rss_before_training_mib": round(rss_before / 1024, 1),
               "saved_activation_mib": {k: round(v / 2**20, 2) for k, v in activation.items()},
               "threads": args["threads"] or 1, "final_loss": round(result.losses[-1], 4),
               "load_avg_1min": load()})


def throughput(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = []
    for mean in [int(m) for m in args.means.split(",")]:
        queue = ctx.Queue()
        proc = ctx.Process(target=_throughput_child, args=(dict(preset=args.preset, mean=mean, k=args.k,
                                                               seq_len=args.seq_len, batch=args.batch,
                                                               steps=args.steps, seed=args.seed,
                                                               threads=args.threads), queue))
        proc.start()
        result = queue.get()
        proc.join()
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


# Benchmark-only shapes (presets are for models; this one is for measurements).
SHAPES = {"h2048": dict(prelude_layers=2, core_layers=4, coda_layers=2, hidden_size=2048, num_heads=16,
                        intermediate_size=5632, vocab_size=65536, context_length=4096)}


def model_config(preset: str, **overrides) -> RDLMConfig:
    if preset in SHAPES:
        return RDLMConfig(**{**SHAPES[preset], **overrides}, name=preset)
    return RDLMConfig.from_preset(preset, **overrides)


LEVERS = ["all off", "+ chunked cross-entropy", "+ fused AdamW", "+ no host sync per step", "+ s_0 drawn on the GPU",
          "+ regional compile", "+ bf16 parameters (FSDP2, 1 process)"]


class Lever:
    """Switch the efficiency levers off by restoring the code paths they replaced (benchmark only)."""

    def __init__(self, level: int) -> None:
        self.level = level

    def __enter__(self):
        from rdlm.model.lm import RecurrentDepthLM as Model
        from rdlm.train.optim import AdamW
        from rdlm.train.trainer import Trainer

        self.saved = [(Model, "forward", Model.forward), (AdamW, "_step_fused", AdamW._step_fused),
                      (Trainer, "_to_device", Trainer._to_device), (Trainer, "_initial_state", Trainer._initial_state)]
        forward = Model.forward
        if self.level < 1:  # the loss from materialized float32 logits, as before
            def logits_loss(self, *args, labels=None, return_logits=True, loss_reduction="mean", **kwargs):
                out = forward(self, *args, **kwargs)
                if labels is not None:
                    out.loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(),
                                                                 ignore_index=-100, reduction=loss_reduction)
                return out
            Model.forward = logits_loss
        if self.level < 2:  # per-tensor AdamW
            def per_tensor(self, group, params, found_inf):
                if found_inf is None or not found_inf.item():
                    self._step_per_tensor(group, params)
            AdamW._step_fused = per_tensor
        if self.level < 3:  # synchronous host-to-device copies
            Trainer._to_device = lambda self, t: t.to(self.device)
        if self.level < 4:  # s_0 drawn on the host, row by row, then copied
            def host_initial_state(self, batch, step, micro):
                from rdlm.model.recurrence import microbatch_seed

                rows, c = [], self.model.config
                template = torch.empty(1, batch.input_ids.shape[1], c.hidden_size)
                for pos in self.batches.positions(step, micro, self.world.rank):
                    g = torch.Generator().manual_seed(microbatch_seed(self.config.seed, int(pos), stream=1))
                    rows.append(self.model.init_state(template, 1.0, g))
                return self._to_device(torch.cat(rows))
            Trainer._initial_state = host_initial_state
        return self

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)
        return False


def gpu_run(args: argparse.Namespace, mean: int, level: int = len(LEVERS) - 1, sampler: str | None = None,
            profile: str | None = None, label: str = "") -> dict:
    """Train `args.warmup + args.steps` steps on the GPU; time the last `args.steps`."""
    from rdlm.train.distributed import teardown_group
    from rdlm.train.monitor import peak_flops
    from rdlm.train.trainer import Trainer

    cuda = args.device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    overrides = dict(mean_recurrence=mean, backprop_depth=args.k,
                     activation_checkpointing=args.activation_checkpointing)
    config = model_config(args.preset, **overrides)
    model = build_quickly(config)
    total = args.warmup + args.steps + (1 if profile else 0)
    rows = torch.randint(0, config.vocab_size, (args.batch * (args.warmup + args.steps + 1) * args.world,
                                                args.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    compile_ = args.compile if level == len(LEVERS) - 1 and not args.levers else level >= 5
    strategy = args.strategy if not args.levers else ("fsdp" if level >= 6 else "single")
    sync = level < 3
    cfg = TrainConfig(steps=total, micro_batch_size=args.batch, progress=False, tensorboard=False, warmup_steps=1,
                      seed=args.seed, device=args.device, compile=compile_, strategy=strategy,
                      cpu_offload=args.cpu_offload,
                      recurrence_sampler=sampler, ema_decay=args.ema_decay or None)
    with Lever(level):
        trainer = Trainer(cfg, model=model, train_data=MemoryRows(rows))
        try:
            for _ in range(args.warmup):
                trainer.settle([trainer.train_step()])
            synchronize()
            start = time.perf_counter()
            pending, flops, tokens = [], 0.0, 0
            for _ in range(args.steps):
                record = trainer.train_step()
                flops, tokens = flops + record.pop("flops"), tokens + record["tokens"]
                pending.append(record)
                if sync:
                    trainer.settle(pending)
                    pending = []
            trainer.settle(pending)
            synchronize()
            seconds = time.perf_counter() - start
            if profile:
                write_profile(trainer, profile, label)
        finally:
            if trainer.own_group:
                teardown_group()
    peak = peak_flops(torch.device("cuda"), None) or 989e12 if cuda else None
    drawn = trainer.drawn[-args.steps - (1 if profile else 0):][:args.steps]
    return {"lever": label, "preset": args.preset, "mean_r": mean, "sampler": sampler or config.recurrence_sampler,
            "k": args.k, "r_drawn": [d[0] for d in drawn], "tokens_per_s": round(tokens / seconds, 1),
            "seconds_per_step": round(seconds / args.steps, 3),
            "mfu": round(flops / seconds / (peak * args.world), 4) if peak else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "parameters": model.num_parameters() if strategy == "single" else config_parameters(config),
            "gpu": torch.cuda.get_device_name() if cuda else None, "strategy": strategy, "compile": compile_,
            "activation_checkpointing": args.activation_checkpointing, "cpu_offload": args.cpu_offload,
            "micro_batch": [args.batch, args.seq_len], "loss": round(trainer.losses[-1], 4)}


def build_quickly(config: RDLMConfig) -> RecurrentDepthLM:
    """The model with its own initialization only (skipping torch's default one: minutes at 3.5B)."""
    from rdlm.model.lm import rope_tables

    with torch.device("meta"):
        model = RecurrentDepthLM(config)
    model.to_empty(device="cpu")
    cos, sin = rope_tables(config.head_dim, config.context_length, config.rope_base)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    model.reset_parameters()
    return model


def config_parameters(config: RDLMConfig) -> int:
    with torch.device("meta"):
        return RecurrentDepthLM(config).num_parameters()


def write_profile(trainer, directory: str, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.settle([trainer.train_step()])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() else "-" for c in label).strip("-") or "run"
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out / f"profile-{name}.txt").write_text(table)
    print(f"--- profile: {label}\n{table[:2500]}", flush=True)


def _isolated_child(args: argparse.Namespace, kwargs: dict, queue) -> None:
    try:
        queue.put(gpu_run(args, **kwargs))
    except Exception as err:
        queue.put({"lever": kwargs.get("label"), "error": f"{type(err).__name__}: {err}"[:500]})


def isolated(args: argparse.Namespace, **kwargs) -> dict:
    """gpu_run in a fresh process: its peak memory is its own (compiled code keeps models alive)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_isolated_child, args=(args, kwargs, queue))
    proc.start()
    try:
        return queue.get()
    except Exception as err:
        return {"lever": kwargs.get("label"), "error": f"child failed: {err}"}
    finally:
        proc.join()


def gpu_throughput(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    results = []
    run = (lambda **kw: isolated(args, **kw)) if args.isolate else (lambda **kw: gpu_run(args, **kw))

    def show(result):
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
        results.append(result)

    means = [int(m) for m in args.means.split(",")]
    if args.levers:
        for level, label in enumerate(LEVERS):
            profile = args.profile if level in (0, len(LEVERS) - 1) else None
            try:
                show(run(mean=means[0], level=level, profile=profile, label=label))
            except Exception as err:  # report and go on: one failing lever must not hide the others
                show({"lever": label, "error": f"{type(err).__name__}: {err}"[:500]})
    else:
        for mean in means:
            show(run(mean=mean, label=f"mean r={mean}", profile=args.profile))
    for r in [int(x) for x in args.memory_r.split(",")] if args.memory_r else []:
        try:
            show(run(mean=r, sampler="fixed", label=f"fixed r={r}"))
        except Exception as err:
            show({"lever": f"fixed r={r}", "error": f"{type(err).__name__}: {err}"[:500]})
    return results


def stdlib_files() -> list[str]:
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def perplexity(args: argparse.Namespace) -> dict:
    from rdlm.data.prepare import prepare
    from rdlm.data.tokenizer import train_tokenizer
    from rdlm.data.prepare import read_documents

    out = Path(args.out)
    files = stdlib_files()
    config = RDLMConfig.from_preset(args.preset)
    start = time.time()
    tok = train_tokenizer(read_documents(files), config.vocab_size)
    # Top-level definitions (separated by two blank lines in PEP 8 code) are the documents.
    meta = prepare(files, tok, out / "shards", context_length=args.seq_len, val_fraction=0.05, seed=0,
                   separator="\n\n\n")
    prep_seconds = time.time() - start
    print(json.dumps({"corpus_files": len(files), "tokenizer_vocab": tok.vocab_size, "rows": meta["rows"],
                      "train_tokens": meta["rows"]["train"] * meta["row_length"],
                      "prep_seconds": round(prep_seconds, 1)}), flush=True)
    deadline = time.time() + args.minutes * 60
    evals = [int(r) for r in args.eval_r.split(",")]

    class Budget(Exception):
        pass

    def stop_at_deadline(record):
        if record["kind"] == "train" and time.time() > deadline:
            raise Budget

    # Train for the wall-clock budget, then evaluate the weights it reached (step count from the run).
    torch.manual_seed(0)
    model = RecurrentDepthLM(config)
    cfg = dict(steps=100_000, micro_batch_size=args.batch, lr=args.lr, warmup_steps=20, ema_decay=None,
               progress=False, tensorboard=False, eval_num_steps=tuple(evals), eval_rows=args.eval_rows,
               seed=0, data=str(out / "shards"))
    from rdlm.train.trainer import Trainer

    # The run stops at the wall-clock budget (--minutes), not after its nominal 100,000 steps: the time
    # estimate rdlm would print for those steps says nothing about this run, so it is silenced.
    from rdlm.resources import LongRunWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LongRunWarning)
        trainer = Trainer(TrainConfig(**cfg), model=model, tokenizer=tok, step_hooks=[stop_at_deadline])
    t0 = time.time()
    try:
        trainer.fit()
    except Budget:
        pass
    train_seconds = time.time() - t0
    from rdlm.train.monitor import evaluate

    torch.set_num_threads(1)
    metrics = evaluate(trainer.model, trainer.val_batches, evals, seed=0)
    result = {"preset": args.preset, "steps": trainer.step, "train_seconds": round(train_seconds, 1),
              "tokens_seen": trainer.step * args.batch * args.seq_len,
              "train_loss_last10": round(sum(trainer.losses[-10:]) / len(trainer.losses[-10:]), 4),
              "val_rows": min(args.eval_rows, meta["rows"]["val"]),
              **{f"val_ppl_r{r}": round(metrics[f"val_ppl_r{r}"], 2) for r in evals},
              "token_correlation": round(metrics["token_correlation"], 4),
              "state_rel_change": round(metrics["state_rel_change"], 4), "load_avg_1min": load()}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--preset", default="small")
    t.add_argument("--means", default="4,32")
    t.add_argument("--k", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--device", default="cpu", help="cpu (a child process per mean r) or cuda (in-process)")
    t.add_argument("--strategy", default="auto", help="cuda: auto, single, fsdp, ddp (several: torchrun)")
    t.add_argument("--compile", action="store_true", help="cuda: regional compile")
    t.add_argument("--cpu-offload", action="store_true", help="cuda: FSDP2 CPU offload")
    t.add_argument("--activation-checkpointing", action="store_true")
    t.add_argument("--ema-decay", type=float, default=0.999, help="cuda: the EMA is part of a real step (0: none)")
    t.add_argument("--warmup", type=int, default=2, help="cuda: untimed steps first (compile, allocator)")
    t.add_argument("--memory-r", default="", help="cuda: also run these fixed r (memory flat in r)")
    t.add_argument("--levers", action="store_true", help="cuda: the efficiency levers one by one")
    t.add_argument("--profile", default=None, help="cuda: write torch profiler tables here")
    t.add_argument("--isolate", action="store_true", help="cuda: each configuration in a fresh process")
    p = sub.add_parser("perplexity")
    p.add_argument("--preset", default="small")
    p.add_argument("--minutes", type=float, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-r", default="1,4,16,32")
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--out", default="/tmp/rdlm-bench-ppl")
    args = parser.parse_args()
    print(json.dumps({"bench": args.which, "torch": torch.__version__, "cpus": os.cpu_count(),
                      "load_avg_1min": load()}), flush=True)
    if args.which == "perplexity":
        perplexity(args)
    elif args.device == "cuda" or args.levers:
        gpu_throughput(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
