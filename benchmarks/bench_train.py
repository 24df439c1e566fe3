"""Training benchmarks for the note (issue 3).

    python benchmarks/bench_train.py throughput [--preset small] [--means 4,32] [--k 8]
    python benchmarks/bench_train.py perplexity [--minutes 4] [--out runs/bench-ppl]

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rdlm import RDLMConfig, RecurrentDepthLM  # noqa: E402
from rdlm.data import MemoryRows  # noqa: E402
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
    config = RDLMConfig.from_preset(args["preset"], mean_recurrence=args["mean"], backprop_depth=args["k"])
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


def stdlib_files() -> list[str]:
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def perplexity(args: argparse.Namespace) -> dict:
    from rdlm.data import prepare
    from rdlm.tokenizer import train_tokenizer
    from rdlm.data import read_documents

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
    throughput(args) if args.which == "throughput" else perplexity(args)


if __name__ == "__main__":
    main()
