"""The parallel (diffusion-style) sampler against sequential greedy decoding at the same r.

    python benchmarks/bench_parallel.py --model out/spec-tiny                  # text model (tokenizer.json)
    python benchmarks/bench_parallel.py --model demo-report/model --task       # the demo's task model

For each setting of a small grid (inner recurrence x headway x freeze threshold x state noise mixing) it prints wall-clock
tokens/s against sequential decoding (timed alternately, one prompt after the other, so a noisy
machine hits both alike), core passes per new token (sequential: r) and agreement with sequential
output: the fraction of new tokens equal to sequential's at the same index, and of prompts whose whole
continuation is the same. `--task` scores exact-match accuracy on the demo task instead (the answer is
the first new token, which a full prefill decides; so the parallel rows there run without one and the
prompt is the first wave). Random weights say nothing here (their states need not settle), hence a
trained model. A script, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

import rdlm
from rdlm.inference.generate import GenerationConfig, generate

PROMPTS = ["the cat sat on", "12 13 14 15", "a dog walked to the river. the old man", "40 41 42",
           "my friend looked at", "the bird slept near the red house. a small child"]


def load(model_dir: str, task: bool, examples: int):
    model = rdlm.load_pretrained(model_dir).eval()
    if task:
        from rdlm import tasks as T

        meta = json.loads((Path(model_dir) / "task_tokenizer.json").read_text())
        tok = T.CharTokenizer()
        test = T.test_split(meta.get("task", "permutations"), examples, seed=1)
        prompts = [tok.encode(ex.prompt) for ex in test]
        return model, prompts, (tok, test)
    from rdlm.data.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return model, [tok.encode(t, add_bos=True) for t in PROMPTS], None


def timed(model, prompt, config):
    t0 = time.perf_counter()
    result = generate(model, prompt, config)
    return result, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a trained model directory")
    p.add_argument("--task", action="store_true", help="the demo's task model: exact-match accuracy")
    p.add_argument("--examples", type=int, default=100, help="--task: test examples")
    p.add_argument("--num-steps", "-r", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--inner", default="2,4,8", help="inner recurrence values")
    p.add_argument("--headway", default="1,2", help="headway values")
    p.add_argument("--threshold", default="0.03,0.1", help="latent-diff freeze thresholds")
    p.add_argument("--noise", default="0", help="state noise mixing values")
    p.add_argument("--max-wavefront", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, prompts, task = load(args.model, args.task, args.examples)
    r, new = args.num_steps, (4 if args.task else args.new_tokens)
    stops = (task[0].eos_id,) if task else ()
    sequential = GenerationConfig(num_steps=r, max_new_tokens=new, stop_tokens=stops)
    reference = [generate(model, q, sequential).tokens[0] for q in prompts]

    def score(outputs):
        if task:
            tok, test = task
            return 100 * sum(tok.decode(o).split("\n")[0].strip() == ex.answer for o, ex in zip(outputs, test)) / len(test)
        same = [sum(a == b for a, b in zip(o, s)) / len(s) for o, s in zip(outputs, reference)]
        return 100 * sum(same) / len(same)

    print(f"model {args.model} ({model.num_parameters() / 1e6:.2f} M parameters), r = {r}, {len(prompts)} prompts "
          f"x {new} new tokens, threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    metric = "accuracy" if task else "agree %"
    print(f"sequential greedy: {metric} {score(reference):.1f}" if task else "sequential greedy: the reference")
    print(f"{'inner':>5} {'head':>4} {'thresh':>6} {'noise':>5} {'core/tok':>8} {'steps/tok':>9} {metric:>8} {'same':>5} "
          f"{'seq tok/s':>9} {'par tok/s':>9} {'speed-up':>8}")
    grid = itertools.product(map(int, args.inner.split(",")), map(int, args.headway.split(",")),
                             map(float, args.threshold.split(",")), map(float, args.noise.split(",")))
    for inner, headway, threshold, noise in grid:
        config = GenerationConfig(num_steps=r, max_new_tokens=new, stop_tokens=stops, sampler="parallel",
                                  inner_recurrence=inner, headway=headway, freeze_threshold=threshold,
                                  max_wavefront=args.max_wavefront, state_noise_mixing=noise, full_prefill=not args.task)
        seq_s = par_s = 0.0
        seq_n = par_n = passes = steps = 0
        outputs = []
        for rep in range(args.repeats):
            for q in prompts:  # alternate: a noisy machine slows both alike
                s, ts = timed(model, q, sequential)
                o, tp = timed(model, q, config)
                seq_s, par_s = seq_s + ts, par_s + tp
                seq_n, par_n = seq_n + len(s.tokens[0]), par_n + len(o.tokens[0])
                if rep == 0:
                    outputs.append(o.tokens[0])
                    passes, steps = passes + o.core_passes, steps + o.wave_steps
        # core passes after the prefill, per token after the first (which the prefill chose)
        decoded = sum(len(o) - (0 if args.task else 1) for o in outputs)
        same = sum(o == s for o, s in zip(outputs, reference)) / len(prompts)
        print(f"{inner:>5} {headway:>4} {threshold:>6} {noise:>5} {passes / decoded:>8.2f} {steps / decoded:>9.2f} "
              f"{score(outputs):>8.1f} {100 * same:>4.0f}% {seq_n / seq_s:>9.1f} {par_n / par_s:>9.1f} "
              f"{(par_n / par_s) / (seq_n / seq_s):>7.2f}x", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
