"""Self-speculative decoding on a trained model: acceptance rate and speed-up over plain greedy decoding.

    python benchmarks/bench_speculative.py --model out/demo-model            # a trained model directory
    python benchmarks/bench_speculative.py --train out/spec-tiny             # no model yet: train `tiny`
                                                                              # on synthetic text (~2 min)

Drafts with N iterations and verifies with M in one forward; checks that the tokens equal plain greedy
decoding at M and prints acceptance rate and decode speed-up for several (N, L). Random weights make a
meaningless acceptance rate (the model does not converge over iterations), hence a trained model.
This is a script, not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

import rdlm
from rdlm.inference.generate import GenerationConfig, generate

NAMES = ["the cat", "a dog", "the bird", "my friend", "the old man", "a small child"]
VERBS = ["sat on", "looked at", "walked to", "jumped over", "slept near"]
PLACES = ["the mat", "the log", "the red house", "a big tree", "the river"]


def synthetic_corpus(n: int, seed: int = 0) -> list[str]:
    """Structured text: sentences from a small grammar and counting runs (predictable continuations)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        if rng.random() < 0.5:
            docs.append(" ".join(f"{rng.choice(NAMES)} {rng.choice(VERBS)} {rng.choice(PLACES)}."
                                 for _ in range(rng.randint(3, 8))))
        else:
            start = rng.randint(0, 80)
            docs.append(" ".join(str(i) for i in range(start, start + rng.randint(10, 30))) + ".")
    return docs


def train_tiny(out: Path, seconds: float, seed: int = 0) -> None:
    from tqdm.auto import tqdm

    from rdlm.data.tokenizer import train_tokenizer

    print(f"training a tokenizer, then `tiny` for {seconds:.0f} s on synthetic text", file=sys.stderr, flush=True)
    torch.manual_seed(seed)
    docs = synthetic_corpus(4000, seed)
    tok = train_tokenizer(docs, vocab_size=400)
    model = rdlm.build_model("tiny", seed=seed, vocab_size=tok.vocab_size)
    ids = [t for d in docs for t in [tok.bos_id, *tok.encode(d)]]
    data = torch.tensor(ids)
    seq, batch = 64, 16
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=5e-4)
    model.train()
    start, step = time.perf_counter(), 0
    # The bar counts the seconds of the budget (training runs for a time, not a number of steps).
    with tqdm(total=round(seconds), unit="s", desc="training tiny", dynamic_ncols=True) as bar:
        while (elapsed := time.perf_counter() - start) < seconds:
            rows = torch.randint(0, len(data) - seq - 1, (batch,))
            x = torch.stack([data[i:i + seq + 1] for i in rows])
            loss = model(x[:, :-1], labels=x[:, 1:]).loss  # r: docs/architecture.md#sampling-r
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 20 == 0:
                bar.set_postfix(step=step, loss=f"{loss.item():.3f}", refresh=False)
                bar.update(min(round(elapsed), bar.total) - bar.n)
        bar.update(bar.total - bar.n)
    rdlm.save_pretrained(model.eval(), out)
    tok.save(out)
    print(f"trained tiny for {step} steps, final loss {loss.item():.3f}; saved to {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a trained model directory (with tokenizer.json)")
    p.add_argument("--train", help="train a tiny model on synthetic text into this directory first")
    p.add_argument("--train-seconds", type=float, default=120)
    p.add_argument("--num-steps", "-r", type=int, default=16, help="verification depth M")
    p.add_argument("--drafts", default="2:4,4:4,8:4,4:8", help="N:L pairs")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.train:
        train_tiny(Path(args.train), args.train_seconds)
        args.model = args.train
    if not args.model:
        p.error("give --model DIR or --train DIR")
    from rdlm.data.tokenizer import Tokenizer

    model = rdlm.load_pretrained(args.model).eval()
    tok = Tokenizer.from_dir(args.model)
    prompts = ["the cat sat on", "12 13 14 15", "a dog walked to the river. the old man", "40 41 42"]
    prompts = [tok.encode(t, add_bos=True) for t in prompts]
    plain_cfg = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens)
    plain = [generate(model, p, plain_cfg) for p in prompts]
    plain_time = sum(r.decode_seconds for r in plain)
    plain_tokens = sum(len(r.tokens[0]) - 1 for r in plain)
    print(f"model {args.model} ({model.config.name}, {model.num_parameters() / 1e6:.2f} M parameters), "
          f"M = {args.num_steps}, {len(prompts)} prompts x {args.new_tokens} new tokens")
    print(f"sample: {tok.decode(prompts[0])!r} -> {tok.decode(plain[0].tokens[0])!r}")
    print(f"plain greedy at M: {plain_tokens / plain_time:.1f} tok/s")
    print(f"{'N':>3} {'L':>3} {'acceptance':>10} {'tok/s':>8} {'speed-up':>8} {'same tokens':>11}")
    for pair in args.drafts.split(","):
        n, length = (int(x) for x in pair.split(":"))
        cfg = GenerationConfig(num_steps=args.num_steps, max_new_tokens=args.new_tokens, draft_steps=n,
                               draft_length=length)
        spec = [generate(model, p, cfg) for p in prompts]
        same = all(s.tokens == g.tokens for s, g in zip(spec, plain))
        drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
        tps = sum(len(s.tokens[0]) - 1 for s in spec) / sum(s.decode_seconds for s in spec)
        print(f"{n:>3} {length:>3} {accepted / drafted:>10.2f} {tps:>8.1f} {tps / (plain_tokens / plain_time):>7.2f}x "
              f"{str(same):>11}", flush=True)


if __name__ == "__main__":
    main()
