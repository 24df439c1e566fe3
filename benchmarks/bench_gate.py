"""What a trained exit gate saves: an Ouro-style model trained with Ouro's expected-loss objective on the
running Python's standard library, then read out at its gate's exits.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_gate.py --minutes 6

The model is the `ouro-tiny` wiring (the whole stack looped, s_0 = e, the final norm after every loop, the
learned gate) at a few million parameters; it trains at a fixed r = 4 on sum_i p_i loss_i - beta H(p)
(`--exit-loss-beta`, rdlm.model.loss.expected_exit_loss). On the validation split it reports, per gate
threshold: the mean iterations per token where the gate exits, the loss read out there (teacher-forced,
`rdlm.inference.evaluate.gate_exit_logits`), the loss after every fixed r, and the iterations per token of
greedy decoding with `exit_criterion="gate"` (the engine stops iterating a token at its exit).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rdlm import RDLMConfig, RecurrentDepthLM  # noqa: E402
from rdlm.data.prepare import prepare, read_documents  # noqa: E402
from rdlm.data.tokenizer import train_tokenizer  # noqa: E402
from rdlm.inference.evaluate import gate_exit_logits  # noqa: E402
from rdlm.inference.generate import GenerationConfig, generate  # noqa: E402
from rdlm.resources import LongRunWarning  # noqa: E402
from rdlm.train import TrainConfig  # noqa: E402
from rdlm.train.trainer import Trainer  # noqa: E402


def load() -> float:
    return round(os.getloadavg()[0], 2)


class Budget(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget")
    parser.add_argument("--exit-loss-beta", type=float, default=0.05, help="entropy weight beta")
    parser.add_argument("--loops", type=int, default=4, help="r: loops of the layer stack")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--val-rows", type=int, default=32)
    parser.add_argument("--thresholds", default="0.5,0.7,0.9")
    parser.add_argument("--out", default=None, help="keep the data and model here (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-gate-"))
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))  # top-level modules
    tok = train_tokenizer(read_documents(files), args.vocab)
    meta = prepare(files, tok, out / "shards", context_length=args.seq_len, val_fraction=0.05, seed=0)
    config = RDLMConfig.from_preset("ouro-tiny", vocab_size=tok.vocab_size, hidden_size=192, num_heads=6,
                                    num_kv_heads=2, intermediate_size=512, context_length=args.seq_len,
                                    mean_recurrence=args.loops, backprop_depth=args.loops)
    torch.manual_seed(0)
    model = RecurrentDepthLM(config)
    deadline = time.time() + args.minutes * 60

    def stop(record):
        if record["kind"] == "train" and time.time() > deadline:
            raise Budget

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LongRunWarning)
        trainer = Trainer(TrainConfig(steps=100_000, micro_batch_size=args.batch, lr=args.lr, warmup_steps=20,
                                      ema_decay=None, progress=False, tensorboard=False, seed=0,
                                      data=str(out / "shards"), exit_loss_beta=args.exit_loss_beta,
                                      threads=torch.get_num_threads()),
                          model=model, tokenizer=tok, step_hooks=[stop])
    started = time.time()
    try:
        trainer.fit()
    except Budget:
        pass
    model = trainer.model.eval()
    result = {"parameters": model.num_parameters(), "train_rows": meta["rows"]["train"], "steps": trainer.step,
              "train_seconds": round(time.time() - started, 1),
              "train_loss_last20": round(sum(trainer.losses[-20:]) / len(trainer.losses[-20:]), 4),
              "load_avg_1min_after_training": load()}

    rows = torch.cat([batch.input_ids for batch in trainer.val_batches])[:args.val_rows]
    ids, labels = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        trajectory = model(ids, args.loops, return_trajectory=True).trajectory[1:]
        positions = torch.arange(ids.shape[1])
        rope = model.rope(positions)
        fixed = [F.cross_entropy(model.readout(s, rope).flatten(0, 1), labels.flatten()).item() for s in trajectory]
        result["loss_at_r"] = {r + 1: round(v, 4) for r, v in enumerate(fixed)}
        result["gate"] = {}
        for threshold in map(float, args.thresholds.split(",")):
            logits, steps = gate_exit_logits(model, ids, args.loops, threshold)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
            mean_steps = steps.float().mean().item()
            prompts = [row[:32].tolist() for row in rows[:4]]
            decoded = generate(model, prompts, GenerationConfig(max_new_tokens=32, num_steps=args.loops,
                                                                exit_criterion="gate", exit_threshold=threshold))
            decode_steps = [s for row in decoded.iterations for s in row[1:]]  # the first token is the prefill's
            result["gate"][threshold] = {
                "mean_steps_teacher_forced": round(mean_steps, 3), "loss_at_gate_exit": round(loss, 4),
                "steps_histogram": torch.bincount(steps.flatten(), minlength=args.loops + 1)[1:].tolist(),
                "mean_steps_decoding": round(sum(decode_steps) / len(decode_steps), 3)}
    result["load_avg_1min"] = load()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
