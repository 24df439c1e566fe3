"""`rdlm generate`: continue prompts with a model (a thin layer over `rdlm.inference.generate`).

Text prompts (`--prompt`, repeatable: a batch) need a model with tokenizer.json (a model directory,
checkpoint or run directory that has one); token-id prompts (`--prompt-ids 1,2,3`) work with any
model, presets included. What `--model` can name: rdlm.model.resolve.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, cast

import torch

from rdlm.checks import OneOf
from rdlm.cli import (
    CLIError,
    add_lora_arguments,
    add_quantize_arguments,
    add_threads_argument,
    check_exit_threshold,
    model_and_adapters,
)
from rdlm.inference.exits.criteria import CRITERIA
from rdlm.inference.generate import EngineArgs, GenerationConfig, GenerationResult, TokenEvent, generate
from rdlm.inference.params import PARTS, check_prompts, params_for
from rdlm.model import dtypes
from rdlm.model.resolve import ACCEPTED, resolve_model_source
from rdlm.resources import check_device, use_threads

if TYPE_CHECKING:
    from rdlm.model.lora_files import AdapterFiles


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text or token ids from a model")
    p.add_argument("--model", help=f"{ACCEPTED} (default with --lora: the adapter's base)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); needs tokenizer.json")
    src.add_argument(
        "--prompt-ids", action="append", help="comma-separated token ids (repeat for a batch); default 1,2,3"
    )
    p.add_argument("--no-bos", action="store_true", help="do not prepend <|begin_text|> to text prompts")
    p.add_argument("--no-stream", action="store_true", help="print text when done instead of streaming")
    p.add_argument("--stats", action="store_true", help="print iterations per token and speed to stderr")
    add_generation_args(p)
    p.set_defaults(func=run)


# What the command line adds to a generation parameter's declaration (rdlm.inference.params): its flags where
# they are not --field-name, its default where it is not the field's, choices, and help ("{help}": the
# declared meaning) that names other flags or rdlm serve.
FLAGS: dict[str, dict] = {
    "num_steps": {
        "flags": ("--num-steps", "-r"),
        "default": None,
        "help": "{help}; default: the model's mean recurrence",
    },
    "exit_criterion": {"choices": sorted(CRITERIA)},
    "cache_strategy": {"flags": ("--cache",)},
    "freeze_criterion": {"choices": sorted(n for n, s in CRITERIA.items() if not s.uses_gate)},
    "max_wavefront": {"help": "{help} (0: no limit)"},
}


def add_generation_args(p: argparse.ArgumentParser, named_adapters: bool = False) -> None:
    """Options shared by `generate`, `chat` and `serve`: a flag per generation parameter the command line
    takes (its declared type, default and meaning, with FLAGS' additions) in a group per part, the stops,
    the LoRA adapters (`named_adapters`: the server's NAME=DIR) and how the model runs."""
    groups = {part.name: p.add_argument_group(f"generation: {part.name}", part.controls) for part in PARTS}
    for param in params_for("cli"):
        flag = FLAGS.get(param.name, {})
        options = {
            "dest": param.name,
            "default": flag.get("default", param.default),
            "help": flag.get("help", "{help}").format(help=param.help),
        }
        if param.kind is bool:
            options["action"] = "store_true" if param.default is False else argparse.BooleanOptionalAction
        elif "choices" in flag or isinstance(param.check, OneOf):
            options["choices"] = flag.get("choices") or list(cast(OneOf, param.check).choices)
        else:
            options["type"] = param.kind
        groups[param.part].add_argument(*flag.get("flags", ["--" + param.name.replace("_", "-")]), **options)
    groups["sampling"].add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable; needs a tokenizer)"
    )
    groups["sampling"].add_argument("--stop-ids", default="", help="comma-separated stop token ids")
    add_lora_arguments(groups["adapter"], named=named_adapters)
    engine = groups["engine"]  # how the engine runs: set once per engine (EngineArgs), not per request
    engine.add_argument(
        "--exit-sync-every",
        type=int,
        default=None,
        help="core iterations between the host's looks at the exit flags (speed only, never the tokens; default "
        "1 on the CPU and 4 on a GPU; rdlm serve: 4)",
    )
    engine.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the static decode step: captured in a CUDA graph (default on with CUDA), or compiled on the CPU "
        "(default on for long jobs of at most 32 rows; rdlm serve: for at most 64 rows; RDLM_COMPILE=0 keeps it "
        "eager)",
    )
    g = p.add_argument_group("model", "how the model is loaded and where it runs")
    g.add_argument("--dtype", choices=dtypes.CHOICES, default="float32", help="weights and activations dtype")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_threads_argument(g)
    add_quantize_arguments(g)


def engine_from_args(args: argparse.Namespace) -> EngineArgs:
    """How the engine runs, from the command line's engine flags."""
    if args.exit_sync_every is not None and args.exit_sync_every < 1:
        raise CLIError(f"--exit-sync-every must be at least 1, got {args.exit_sync_every}")
    return EngineArgs(compile=args.compile, exit_sync_every=args.exit_sync_every)


def config_from_args(args: argparse.Namespace, model, stop_tokens: tuple[int, ...] = ()) -> GenerationConfig:
    stop_ids = tuple(parse_ids(args.stop_ids)) if args.stop_ids else ()
    vocab = model.config.vocab_size
    for token in stop_ids:
        if not 0 <= token < vocab:
            raise CLIError(
                f"--stop-ids {token} is outside the model's vocabulary (ids 0 to {vocab - 1}): it could "
                "never be generated"
            )
    check_exit_threshold(args.exit_criterion, args.exit_threshold)
    if args.sampler == "parallel":
        check_exit_threshold(args.freeze_criterion, args.freeze_threshold, "--freeze-threshold", "--freeze-criterion")
    values = {param.name: getattr(args, param.name) for param in params_for("cli")}
    values.update(
        num_steps=model.config.mean_recurrence if args.num_steps is None else args.num_steps,
        max_wavefront=args.max_wavefront or None,
        stop_tokens=stop_tokens + stop_ids,
        stop_strings=tuple(args.stop),
    )
    return GenerationConfig(**values)


def load_model_and_tokenizer(
    source: str,
    dtype: str | None = "float32",
    device: str = "cpu",
    need_tokenizer=False,
    without_tokenizer: str = "use --prompt-ids for token ids",
    quantize: str | None = None,
    group_size: int = 128,
    threads: int | None = None,
    adapters: dict[str, AdapterFiles] | None = None,
    any_base: bool = False,
):
    """The model (quantized by `quantize`, when given; with the LoRA `adapters` loaded on it by name, their
    base checked unless `any_base` (rdlm.model.lora.load_adapters); its work on `threads` CPU threads, by
    default rdlm.resources.use_threads') and, when it comes with tokenizer.json, its tokenizer (else None).
    `without_tokenizer` ends the error when one is needed and missing: what the command can do instead.
    `rdlm.cli.model_and_adapters` gives `source` and `adapters` from a command's --model and --lora."""
    from rdlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

    check_device(device)
    found = resolve_model_source(source)
    tokenizer = None
    if found.tokenizer_dir is not None:
        tokenizer = Tokenizer.from_dir(found.tokenizer_dir)
    elif need_tokenizer:
        raise ValueError(
            f"{source!r} has no {TOKENIZER_FILE}: text needs a model directory with a tokenizer ({without_tokenizer})"
        )
    model = found.load(dtype=dtype, device=device, quantize=quantize, group_size=group_size)
    use_threads(model, threads)
    if getattr(model, "quantization", None) is not None:
        from rdlm.model.quantize import describe

        print(f"rdlm: quantized {describe(model)}", file=sys.stderr)
    if adapters:
        from rdlm.model.lora_serving import load_adapters

        load_adapters(model, adapters, any_base=any_base)
        for name, files in adapters.items():
            print(f"rdlm: LoRA adapter {name} from {files.directory} (rank {files.spec.rank})", file=sys.stderr)
    return model, tokenizer


def check_fits(context: int, prompt_length: int, new_tokens: int) -> None:
    """Refuse a prompt and --max-new-tokens that do not fit the model's context, saying what would."""
    if prompt_length + new_tokens <= context:
        return
    if prompt_length >= context:
        raise CLIError(
            f"the prompt has {prompt_length} tokens and the model's context is {context}: a prompt of "
            f"at most {context - 1} tokens leaves room for a new one"
        )
    raise CLIError(
        f"the prompt ({prompt_length} tokens) + --max-new-tokens {new_tokens} exceed the model's context "
        f"of {context}: at most --max-new-tokens {context - prompt_length} fits this prompt"
    )


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
    line = (
        f"new tokens {new} | iterations per token mean {result.mean_iterations:.2f} | prefill "
        f"{result.prompt_tokens / max(result.prefill_seconds, 1e-9):.1f} tok/s | decode {decode_tps:.1f} "
        f"tok/s | cache {result.cache_bytes / 2**20:.2f} MiB"
    )
    if result.wave_steps:
        line += (
            f" | parallel: {result.wave_steps} wavefront steps, "
            f"{result.core_passes / max(new - 1, 1):.2f} core passes per token"
        )
    if result.acceptance_rate is not None:
        line += f" | speculative acceptance {result.acceptance_rate:.2f} ({result.accepted}/{result.drafted})"
    if result.compile_seconds:  # building the static step (a CUDA graph, or the CPU's compiled iteration)
        line += f" | compile {result.compile_seconds:.1f} s (not in decode)"
    print(line, file=sys.stderr)
    for row, steps in enumerate(result.iterations):
        print(f"iterations per token [{row}]: {' '.join(map(str, steps))}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)  # a preset is a freshly initialized model: make it reproducible
    text_mode = args.prompt is not None
    source, adapters = model_and_adapters(args)
    model, tokenizer = load_model_and_tokenizer(
        source,
        args.dtype,
        args.device,
        need_tokenizer=text_mode or bool(args.stop),
        quantize=args.quantize,
        group_size=args.quantize_group_size,
        threads=args.threads,
        adapters=adapters,
        any_base=args.lora_any_base,
    )
    if text_mode:
        prompts = [tokenizer.encode(p, add_bos=not args.no_bos) for p in args.prompt]
        stop_tokens: tuple[int, ...] = (tokenizer.eos_id,)
    else:
        prompts = [parse_ids(p) for p in (args.prompt_ids or ["1,2,3"])]
        stop_tokens = ()
    config, engine = config_from_args(args, model, stop_tokens), engine_from_args(args)
    check_prompts(model, prompts)
    check_fits(model.config.context_length, max(map(len, prompts)), config.max_new_tokens)
    decode = tokenizer.decode if tokenizer is not None else None
    if text_mode and len(prompts) == 1 and not args.no_stream:
        print(args.prompt[0], end="", flush=True)
        streamer = TextStreamer(tokenizer)
        try:
            result = generate(model, prompts, config, decode=decode, on_token=streamer, engine=engine)
        except BaseException:
            print(flush=True)  # an error starts on a line of its own, after the text so far
            raise
        streamer.finish()
    else:
        result = generate(model, prompts, config, decode=decode, engine=engine)
        for row, prompt in enumerate(prompts):
            if text_mode:
                print(args.prompt[row] + tokenizer.decode(result.tokens[row], skip_special_tokens=True))
            else:
                print(",".join(str(t) for t in prompt + result.tokens[row]))
    if args.stats:
        print_stats(result)
    return 0
