"""`rdlm eval MODEL`: perplexity (on a text file) or task accuracy (lm-eval tasks) against r, with a
plot: the saturation curves of the paper's Figures 1 and 10 for any model and task."""

from __future__ import annotations

import argparse
from pathlib import Path

from rdlm.cli import (
    CLIError,
    add_lora_arguments,
    add_model_argument,
    add_quantize_arguments,
    add_threads_argument,
    model_and_adapters,
)
from rdlm.fileio import claim_output_dir, read_jsonl, read_utf8

OUTPUTS = ("results.json", "plot.png")


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="accuracy or perplexity against the number of iterations r")
    add_model_argument(p, "a model directory, training checkpoint step-N/ or run directory with tokenizer.json")
    p.add_argument("--num-steps", default="1,2,4,8,16,32", help="comma-separated values of r")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="perplexity on this file (.txt: one document; .jsonl: field 'text')")
    source.add_argument("--tasks", help="accuracy on these lm-eval tasks (comma-separated)")
    p.add_argument("--include-path", help="directory of extra lm-eval task YAML files")
    p.add_argument("--metric", help="keep only this lm-eval metric (e.g. acc_norm)")
    p.add_argument("--limit", type=int, help="lm-eval: at most this many documents per task")
    p.add_argument("--model-args", default="", help="extra rdlm model args for lm-eval (k=v,...)")
    p.add_argument("--seq-len", type=int, help="perplexity window (default: the model's context)")
    p.add_argument("--batch-size", type=int, default=8, help="rows (windows or requests) per forward")
    p.add_argument("--init-scale", type=float, default=1.0, help="s_0 noise scale (0: zero state)")
    p.add_argument("--out", default="eval-out", help="directory for results.json and plot.png")
    p.add_argument("--overwrite", action="store_true", help="replace results.json and plot.png already in --out")
    add_threads_argument(p)
    add_quantize_arguments(p)
    add_lora_arguments(p)
    p.set_defaults(func=run)


def read_documents(path: Path) -> list[str]:
    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        docs = []
        for n, record in read_jsonl(path, CLIError):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CLIError(f"{path}:{n}: expected a JSON object with a string 'text' field")
            docs.append(record["text"])
        return docs
    return [read_utf8(path, CLIError)]


def run(args: argparse.Namespace) -> int:
    from rdlm.inference.evaluate import perplexity_vs_steps, plot_sweeps, write_results

    try:
        steps = [int(r) for r in args.num_steps.split(",")]
    except ValueError as err:
        raise CLIError(f"--num-steps must be comma-separated integers, got {args.num_steps!r}") from err
    out = claim_output_dir(args.out, OUTPUTS.__contains__, args.overwrite, "results")  # before minutes of work
    source, adapters = model_and_adapters(args)
    if args.text:
        from rdlm.cli.generate import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(
            source,
            None,  # the weights' own dtype
            need_tokenizer=True,
            without_tokenizer="perplexity reads the text with the model's tokenizer",
            quantize=args.quantize,
            group_size=args.quantize_group_size,
            threads=args.threads,
            adapters=adapters,
            any_base=args.lora_any_base,
        )
        docs = [tokenizer.encode(d, add_bos=True) for d in read_documents(Path(args.text))]
        sweeps = [
            perplexity_vs_steps(
                model,
                docs,
                steps,
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                init_scale=args.init_scale,
                task=Path(args.text).name,
                progress=True,
            )
        ]
    else:
        try:
            from rdlm.integrations.lm_eval import accuracy_vs_steps
        except ImportError as err:
            raise CLIError(f"{err}; accuracy on lm-eval tasks needs lm-eval: pip install 'rdlm[eval]'") from err
        quantize = args.quantize and (
            f"quantize={args.quantize.replace(',', '+').replace('=', ':')},"
            f"quantize_group_size={args.quantize_group_size}"
        )
        threads = args.threads and f"threads={args.threads}"
        lora = ",".join(
            f"lora={files.directory}" + (",lora_any_base=true" if args.lora_any_base else "")
            for files in adapters.values()
        )
        extra = ",".join(a for a in (f"init_scale={args.init_scale}", quantize, threads, lora, args.model_args) if a)
        sweeps = accuracy_vs_steps(
            source,
            args.tasks.split(","),
            steps,
            include_path=args.include_path,
            metric=args.metric,
            model_args=extra,
            batch_size=args.batch_size,
            limit=args.limit,
        )
    plot_sweeps(sweeps, out / "plot.png", title=Path(source).name)
    write_results(sweeps, out / "results.json")  # last: results.json is there once the output is complete
    for sweep in sweeps:
        cells = "  ".join(f"r={r}: {v:.4g}" for r, v in zip(sweep.num_steps, sweep.values, strict=True))
        print(f"{sweep.task} {sweep.metric}: {cells}")
    print(f"wrote {out / 'results.json'} and {out / 'plot.png'}")
    return 0
