"""`rdlm generate`: continue prompts with a model (a thin layer over `rdlm.inference.generate`).

Text prompts (`--prompt`, repeatable: a batch) need a model with tokenizer.json (a model directory,
checkpoint or run directory that has one); token-id prompts (`--prompt-ids 1,2,3`) work with any
model, presets included. What `--model` can name: rdlm.model.resolve.
"""

from __future__ import annotations

import argparse
import sys

import torch

from rdlm.cli import CLIError, add_quantize_arguments, add_threads_argument, check_exit_threshold
from rdlm.inference.exits import CRITERIA
from rdlm.inference.generate import GenerationConfig, GenerationResult, TokenEvent, generate
from rdlm.inference.params import check_prompts
from rdlm.model import dtypes
from rdlm.model.resolve import ACCEPTED, resolve_model_source
from rdlm.resources import check_device, use_threads


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text or token ids from a model")
    p.add_argument("--model", required=True, help=ACCEPTED)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); needs tokenizer.json")
    src.add_argument("--prompt-ids", action="append",
                     help="comma-separated token ids (repeat for a batch); default 1,2,3")
    p.add_argument("--no-bos", action="store_true", help="do not prepend <|begin_text|> to text prompts")
    p.add_argument("--no-stream", action="store_true", help="print text when done instead of streaming")
    p.add_argument("--stats", action="store_true", help="print iterations per token and speed to stderr")
    add_generation_args(p)
    p.set_defaults(func=run)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `generate` and `chat`; they map one to one onto GenerationConfig."""
    g = p.add_argument_group("generation")
    g.add_argument("--num-steps", "-r", type=int, default=None,
                   help="core iterations r per token (the maximum with --exit-criterion); "
                        "default: the model's mean recurrence")
    g.add_argument("--max-new-tokens", type=int, default=32, help="most tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    g.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with this much probability")
    g.add_argument("--min-p", type=float, help="drop tokens less likely than min-p x the most likely one")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive (multiply negative) logits of tokens already seen by this (1: off)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; needs a tokenizer)")
    g.add_argument("--stop-ids", default="", help="comma-separated stop token ids")
    g.add_argument("--exit-criterion", choices=sorted(CRITERIA), help="per-token adaptive compute")
    g.add_argument("--exit-threshold", type=float, help="default: the criterion's (kl: 5e-4)")
    g.add_argument("--min-steps", type=int, default=None,
                   help="fewest iterations per token before an exit (default 2; 1 for a learned gate)")
    g.add_argument("--exit-every", type=int, default=1,
                   help="evaluate the exit criterion every n iterations (1: after each, as in the paper)")
    g.add_argument("--exit-sync-every", type=int, default=None,
                   help="the host reads exit flags every n iterations (speed only, never the tokens; default "
                        "1 on the CPU, 4 on a GPU); in rdlm serve also every n steps of the batch (rows found "
                        "done then leave its calls; default 4)")
    g.add_argument("--max-latent-iterations", type=int,
                   help="depth budget: most core iterations for all of a response's tokens (at least 1 each)")
    g.add_argument("--target-mean-iterations", type=float,
                   help="depth budget: keep a response's running mean of iterations per token at most this")
    g.add_argument("--cache", choices=["full", "shared"], default="full", help="KV-cache strategy")
    g.add_argument("--cache-slots", type=int, help="k for --cache shared (iteration i uses slot i mod k)")
    g.add_argument("--continuous-cot", action="store_true",
                   help="warm-start each token's state from the previous token's final state")
    g.add_argument("--draft-steps", type=int, help="self-speculative decoding: draft with N iterations")
    g.add_argument("--draft-length", type=int, default=4, help="tokens drafted per speculative round")
    g.add_argument("--sampler", choices=["sequential", "parallel"], default="sequential",
                   help="parallel: the diffusion-style wavefront sampler (one prompt at a time)")
    g.add_argument("--inner-recurrence", type=int, default=4,
                   help="parallel: core iterations per wavefront step")
    g.add_argument("--headway", type=int, default=1, help="parallel: new positions per step")
    g.add_argument("--freeze-criterion", choices=sorted(n for n, s in CRITERIA.items() if not s.uses_gate),
                   default="latent-diff",
                   help="parallel: when a position's state has settled")
    g.add_argument("--freeze-threshold", type=float, help="parallel: default the criterion's (latent-diff: 0.03)")
    g.add_argument("--max-wavefront", type=int, default=128, help="parallel: most positions in flight (0: no limit)")
    g.add_argument("--state-noise-mixing", type=float, default=0.0,
                   help="parallel: noise mixed into each state per step, damped by 1/(1 + iterations)")
    g.add_argument("--embedding-ema", type=float, default=0.1,
                   help="parallel: EMA weight of a position's earlier input embeddings")
    g.add_argument("--full-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="parallel: prefill the prompt at r (--no-full-prefill: the prompt is the first wave)")
    g.add_argument("--init-scale", type=float, default=1.0, help="s_0 noise scale (0: all-zero state)")
    g.add_argument("--seed", type=int, default=0, help="seed of s_0 and of sampling (per row)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the static decode step captured in a CUDA graph (default: on with CUDA, off on CPU); "
                        "rdlm serve: the batch's static core iteration, the same default")
    g.add_argument("--dtype", choices=dtypes.CHOICES, default="float32", help="weights and activations dtype")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_threads_argument(g)
    add_quantize_arguments(g)


def config_from_args(args: argparse.Namespace, model, stop_tokens: tuple[int, ...] = ()) -> GenerationConfig:
    stop_ids = tuple(parse_ids(args.stop_ids)) if args.stop_ids else ()
    vocab = model.config.vocab_size
    for token in stop_ids:
        if not 0 <= token < vocab:
            raise CLIError(f"--stop-ids {token} is outside the model's vocabulary (ids 0 to {vocab - 1}): it could "
                           "never be generated")
    check_exit_threshold(args.exit_criterion, args.exit_threshold)
    if args.sampler == "parallel":
        check_exit_threshold(args.freeze_criterion, args.freeze_threshold, "--freeze-threshold",
                             "--freeze-criterion")
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        num_steps=model.config.mean_recurrence if args.num_steps is None else args.num_steps,
        exit_criterion=args.exit_criterion, exit_threshold=args.exit_threshold, min_steps=args.min_steps,
        exit_every=args.exit_every, exit_sync_every=args.exit_sync_every, compile=args.compile,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, stop_tokens=stop_tokens + stop_ids,
        stop_strings=tuple(args.stop), cache_strategy=args.cache, cache_slots=args.cache_slots,
        continuous_cot=args.continuous_cot, init_scale=args.init_scale, seed=args.seed,
        draft_steps=args.draft_steps, draft_length=args.draft_length, sampler=args.sampler,
        inner_recurrence=args.inner_recurrence, headway=args.headway, freeze_criterion=args.freeze_criterion,
        freeze_threshold=args.freeze_threshold, max_wavefront=args.max_wavefront or None,
        state_noise_mixing=args.state_noise_mixing, embedding_ema=args.embedding_ema,
        full_prefill=args.full_prefill, max_latent_iterations=args.max_latent_iterations,
        target_mean_iterations=args.target_mean_iterations)


def load_model_and_tokenizer(source: str, dtype: str = "float32", device: str = "cpu", need_tokenizer=False,
                             without_tokenizer: str = "use --prompt-ids for token ids", quantize: str | None = None,
                             group_size: int = 128, threads: int | None = None):
    """The model (quantized by `quantize`, when given; its work on `threads` CPU threads, by default
    rdlm.resources.use_threads') and, when it comes with tokenizer.json, its tokenizer (else None).
    `without_tokenizer` ends the error when one is needed and missing: what the command can do instead."""
    from rdlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

    check_device(device)
    found = resolve_model_source(source)
    tokenizer = None
    if found.tokenizer_dir is not None:
        tokenizer = Tokenizer.from_dir(found.tokenizer_dir)
    elif need_tokenizer:
        raise ValueError(f"{source!r} has no {TOKENIZER_FILE}: text needs a model directory with a "
                         f"tokenizer ({without_tokenizer})")
    model = found.load(dtype=dtype, device=device, quantize=quantize, group_size=group_size)
    use_threads(model, threads)
    if getattr(model, "quantization", None) is not None:
        from rdlm.model.quantize import describe

        print(f"rdlm: quantized {describe(model)}", file=sys.stderr)
    return model, tokenizer


def check_fits(context: int, prompt_length: int, new_tokens: int) -> None:
    """Refuse a prompt and --max-new-tokens that do not fit the model's context, saying what would."""
    if prompt_length + new_tokens <= context:
        return
    if prompt_length >= context:
        raise CLIError(f"the prompt has {prompt_length} tokens and the model's context is {context}: a prompt of "
                       f"at most {context - 1} tokens leaves room for a new one")
    raise CLIError(f"the prompt ({prompt_length} tokens) + --max-new-tokens {new_tokens} exceed the model's context "
                   f"of {context}: at most --max-new-tokens {context - prompt_length} fits this prompt")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"token ids must be comma-separated integers, got {text!r}") from None


class TextStreamer:
    """Prints a reply's text as tokens arrive (rdlm.data.tokenizer.StreamDecoder: the printed pieces join to
    the reply decoded at once)."""

    def __init__(self, tokenizer, out=None, strip_leading: bool = False) -> None:
        from rdlm.data.tokenizer import StreamDecoder

        self.text = StreamDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), strip_leading)
        self.out = out or sys.stdout

    def __call__(self, event: TokenEvent) -> None:
        self.out.write(self.text.push(event.token))
        self.out.flush()

    def finish(self) -> None:
        self.out.write(self.text.finish() + "\n")
        self.out.flush()


def print_stats(result: GenerationResult) -> None:
    new = sum(len(t) for t in result.tokens)
    decode_tps = (new - len(result.tokens)) / result.decode_seconds if result.decode_seconds else 0.0
    line = (f"new tokens {new} | iterations per token mean {result.mean_steps:.2f} | prefill "
            f"{result.prompt_tokens / max(result.prefill_seconds, 1e-9):.1f} tok/s | decode {decode_tps:.1f} "
            f"tok/s | cache {result.cache_bytes / 2**20:.2f} MiB")
    if result.wave_steps:
        line += (f" | parallel: {result.wave_steps} wavefront steps, "
                 f"{result.core_passes / max(new - 1, 1):.2f} core passes per token")
    if result.acceptance_rate is not None:
        line += f" | speculative acceptance {result.acceptance_rate:.2f} ({result.accepted}/{result.drafted})"
    print(line, file=sys.stderr)
    for row, steps in enumerate(result.steps):
        print(f"iterations per token [{row}]: {' '.join(map(str, steps))}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)  # a preset is a freshly initialized model: make it reproducible
    text_mode = args.prompt is not None
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.device,
                                                need_tokenizer=text_mode or bool(args.stop),
                                                quantize=args.quantize, group_size=args.quantize_group_size,
                                                threads=args.threads)
    if text_mode:
        prompts = [tokenizer.encode(p, add_bos=not args.no_bos) for p in args.prompt]
        stop_tokens = (tokenizer.eos_id,)
    else:
        prompts = [parse_ids(p) for p in (args.prompt_ids or ["1,2,3"])]
        stop_tokens = ()
    config = config_from_args(args, model, stop_tokens)
    check_prompts(model, prompts)
    check_fits(model.config.context_length, max(map(len, prompts)), config.max_new_tokens)
    decode = tokenizer.decode if tokenizer is not None else None
    if text_mode and len(prompts) == 1 and not args.no_stream:
        print(args.prompt[0], end="", flush=True)
        streamer = TextStreamer(tokenizer)
        try:
            result = generate(model, prompts, config, decode=decode, on_token=streamer)
        except BaseException:
            print(flush=True)  # an error starts on a line of its own, after the text so far
            raise
        streamer.finish()
    else:
        result = generate(model, prompts, config, decode=decode)
        for row, prompt in enumerate(prompts):
            if text_mode:
                print(args.prompt[row] + tokenizer.decode(result.tokens[row], skip_special_tokens=True))
            else:
                print(",".join(str(t) for t in prompt + result.tokens[row]))
    if args.stats:
        print_stats(result)
    return 0
