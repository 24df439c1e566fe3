"""Retrofitted recurrence at CPU scale (McLeish et al. 2025's central claim): from one pretrained fixed-depth
model, (a) keep training it as it is, or (b) retrofit it (rdlm.model.retrofit) and train with a curriculum on
r, for the same training FLOPs (counted as the trainer counts them), and compare validation loss.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_retrofit.py --out bench-retrofit

1. Pretrain a small Llama (rdlm's fixed-depth baseline, `plain_config`: 8 layers, h = 128, grouped-query
   attention) on the running Python's standard library for `--base-minutes`, and save it as a transformers
   Llama directory (`save_as_llama`) with its tokenizer.
2. For each seed: (b) `retrofit` it, prelude 0-1, core 2-5, coda 6-7 (the paper's 2,4,2 split, nothing
   dropped), adapter [0 | I], and train for `--minutes` with the `--curriculum` ramp of the mean r up to
   `--mean-recurrence`; then (a) continue the pretrained model without recurrence until it has used the
   same FLOPs as (b). Same data order, optimizer and learning rate for both.
3. Report the validation loss of (a) and of (b) at r = 1, 2, 4, 8, 16, 32, the curves over training FLOPs,
   and a plot (`<out>/retrofit-<settings>.png`, with the numbers in the .json beside it). `--reuse-base` starts
   further comparisons (another `--adapter-init`, curriculum or budget) from the same pretrained model.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rdlm import RecurrentDepthLM  # noqa: E402
from rdlm.data.prepare import prepare, read_documents  # noqa: E402
from rdlm.data.tokenizer import train_tokenizer  # noqa: E402
from rdlm.data.tokenizer import Tokenizer  # noqa: E402
from rdlm.model.retrofit import load_llama, plain_config, retrofit, save_as_llama  # noqa: E402
from rdlm.resources import LongRunWarning  # noqa: E402
from rdlm.train import TrainConfig  # noqa: E402
from rdlm.train.monitor import evaluate  # noqa: E402
from rdlm.train.trainer import Trainer  # noqa: E402

R_VALUES = (1, 2, 4, 8, 16, 32)


class Stop(Exception):
    pass


def load() -> float:
    return round(os.getloadavg()[0], 2)


def run(model: RecurrentDepthLM, shards: Path, tok, *, seed: int, lr: float, batch: int, minutes: float | None = None,
        flops_budget: float | None = None, eval_every: int, eval_r: tuple[int, ...], **extra) -> dict:
    """Train until the time or FLOPs budget; returns the trainer, the FLOPs used and the eval curve."""
    deadline = None if minutes is None else time.time() + minutes * 60
    used, curve, flops_at = [0.0], [], {}

    def hook(record):
        if record["kind"] == "train":
            used[0] += record["flops"]
            flops_at[record["step"]] = used[0]
            if (deadline is not None and time.time() > deadline) or (flops_budget is not None and used[0] >= flops_budget):
                raise Stop
        elif record["kind"] == "eval":
            curve.append({"step": record["step"], "flops": flops_at.get(record["step"], used[0]),
                          **{f"loss_r{r}": math.log(record[f"val_ppl_r{r}"]) for r in eval_r}})

    config = TrainConfig(steps=1_000_000, micro_batch_size=batch, lr=lr, warmup_steps=20, ema_decay=None,
                         progress=False, tensorboard=False, seed=seed, data=str(shards), eval_every=eval_every,
                         eval_num_steps=eval_r, eval_rows=32, threads=torch.get_num_threads(), **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LongRunWarning)
        trainer = Trainer(config, model=model, tokenizer=tok, step_hooks=[hook])
    started = time.time()
    try:
        trainer.fit()
    except Stop:
        pass
    return {"trainer": trainer, "flops": used[0], "steps": trainer.step, "seconds": time.time() - started,
            "curve": curve}


def final_losses(trainer: Trainer, r_values) -> dict[int, float]:
    metrics = evaluate(trainer.model, trainer.val_batches, list(r_values), seed=0)
    return {r: round(math.log(metrics[f"val_ppl_r{r}"]), 4) for r in r_values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-retrofit")
    parser.add_argument("--base-minutes", type=float, default=5.0, help="pretraining of the fixed-depth model")
    parser.add_argument("--minutes", type=float, default=4.0, help="training of (b), the retrofitted model")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--mean-recurrence", type=int, default=4, help="the curriculum's final mean r")
    parser.add_argument("--curriculum", default="1-sqrt", choices=("linear", "1-sqrt"))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--adapter-init", default="identity", choices=("identity", "sum", "random"))
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="for both (a) and (b)")
    parser.add_argument("--reuse-base", action="store_true",
                        help="start from the pretrained model an earlier run left in --out (skip pretraining)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tok = Tokenizer.load(out / "llama") if args.reuse_base else train_tokenizer(read_documents(files), 1024)
    prepare(files, tok, out / "shards", context_length=args.seq_len, val_fraction=0.05, seed=0)
    config = plain_config(core_layers=8, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=384,
                          vocab_size=tok.vocab_size, context_length=args.seq_len, rope_base=10000.0)
    if args.reuse_base:
        base_model = load_llama(out / "llama")
        base_info = json.loads((out / "base.json").read_text())
    else:
        torch.manual_seed(0)
        base = run(RecurrentDepthLM(config), out / "shards", tok, seed=100, lr=args.lr, batch=args.batch,
                   minutes=args.base_minutes, eval_every=0, eval_r=(1,))
        base_model = base["trainer"].model.eval()
        save_as_llama(base_model, out / "llama")
        tok.save(out / "llama")
        base_info = {"steps": base["steps"], "seconds": round(base["seconds"], 1), "flops": base["flops"],
                     "val_loss": final_losses(base["trainer"], (1,))[1], "parameters": base_model.num_parameters()}
        (out / "base.json").write_text(json.dumps(base_info))
    result = {"base": base_info, "split": "prelude 0-1, core 2-5, coda 6-7", "curriculum": args.curriculum,
              "mean_recurrence": args.mean_recurrence, "adapter_init": args.adapter_init, "minutes": args.minutes,
              "optimizer": args.optimizer,
              "runs": []}
    print(json.dumps(result["base"]), flush=True)
    tag = f"{args.adapter_init}-{args.curriculum}-r{args.mean_recurrence}-{args.minutes:g}min-{args.optimizer}"
    for seed in map(int, args.seeds.split(",")):
        retrofitted = retrofit(out / "llama", out / f"retrofit-{seed}", [0, 1], [2, 3, 4, 5], [6, 7],
                               adapter_init=args.adapter_init, mean_recurrence=args.mean_recurrence,
                               backprop_depth=args.mean_recurrence, overwrite=True)  # its own scratch copy
        b = run(retrofitted.train(), out / "shards", tok, seed=seed, lr=args.lr, batch=args.batch,
                minutes=args.minutes, eval_every=50, eval_r=(1, args.mean_recurrence), curriculum=args.curriculum,
                optimizer=args.optimizer)
        a = run(copy.deepcopy(base_model).train(), out / "shards", tok, seed=seed, lr=args.lr, batch=args.batch,
                flops_budget=b["flops"], eval_every=50, eval_r=(1,), optimizer=args.optimizer)
        row = {"seed": seed,
               "a": {"steps": a["steps"], "flops": a["flops"], "seconds": round(a["seconds"], 1),
                     "val_loss": final_losses(a["trainer"], (1,))[1], "curve": a["curve"]},
               "b": {"steps": b["steps"], "flops": b["flops"], "seconds": round(b["seconds"], 1),
                     "val_loss": final_losses(b["trainer"], R_VALUES), "curve": b["curve"]},
               "load_avg_1min": load()}
        result["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("a", "b")} |
                         {"a": row["a"]["val_loss"], "b": row["b"]["val_loss"], "a_steps": a["steps"],
                          "b_steps": b["steps"]}), flush=True)
    (out / f"retrofit-{tag}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"retrofit-{tag}.png")
    shutil.rmtree(out / "shards", ignore_errors=True)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in result["runs"]:
        s = row["seed"]
        a, b = row["a"]["curve"], row["b"]["curve"]
        left.plot([p["flops"] for p in a], [p["loss_r1"] for p in a], "-", color="C0", alpha=0.7,
                  label="(a) no recurrence" if s == result["runs"][0]["seed"] else None)
        key = f"loss_r{result['mean_recurrence']}"
        left.plot([p["flops"] for p in b], [p[key] for p in b], "-", color="C1", alpha=0.7,
                  label=f"(b) retrofitted, r = {result['mean_recurrence']}" if s == result["runs"][0]["seed"] else None)
        rs = sorted(map(int, row["b"]["val_loss"]))
        right.plot(rs, [row["b"]["val_loss"][r] for r in rs], "o-", color="C1", alpha=0.7,
                   label="(b) retrofitted" if s == result["runs"][0]["seed"] else None)
        right.axhline(row["a"]["val_loss"], color="C0", alpha=0.7, linestyle="--",
                      label="(a) no recurrence" if s == result["runs"][0]["seed"] else None)
    left.set_xlabel("training FLOPs after pretraining")
    left.set_ylabel("validation loss")
    left.legend()
    right.set_xscale("log", base=2)
    right.set_xlabel("r at test time")
    right.set_ylabel("validation loss at equal training FLOPs")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
