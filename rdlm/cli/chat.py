"""`rdlm chat`: an interactive chat with the chat template of Huginn-0125
(docs/checkpoint-format.md#tokenizer).

Each user line becomes a turn `<|begin_header|>user<|end_header|>\\n\\nTEXT<|end_turn|>`; the reply is
generated after `<|begin_header|>Huginn<|end_header|>\\n\\n` until `<|end_turn|>` (or end of text),
streamed as it is produced. `/reset` forgets the conversation, `/exit` (or end of input) quits.
Works with piped input too: `printf 'hello\\n' | rdlm chat --model DIR`.

When the conversation no longer fits the model's context with room for a reply of --max-new-tokens, its
oldest exchanges are dropped (a note says how many; the system message stays); when the last message alone
leaves less room, the reply gets what is left. A message that alone fills the context is not sent, and
the chat goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from rdlm.cli import at_least, model_and_adapters
from rdlm.cli.generate import (
    TextStreamer,
    add_generation_args,
    config_from_args,
    engine_from_args,
    load_model_and_tokenizer,
    print_stats,
)
from rdlm.inference.generate import generate


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chat",
        help="interactive chat with a model directory (needs tokenizer.json)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="a model directory, training checkpoint step-N/ or run directory with tokenizer.json (default "
        "with --lora: the adapter's base)",
    )
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--stats", action="store_true", help="print iterations per token and speed after each reply")
    add_generation_args(p)
    for action in p._actions:
        if action.dest == "max_new_tokens":  # generate's 0 times a prefill; a chat reply needs a token
            action.type = at_least(1)
    p.set_defaults(func=run, max_new_tokens=256)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    source, adapters = model_and_adapters(args)
    model, tokenizer = load_model_and_tokenizer(
        source,
        args.dtype,
        args.device,
        need_tokenizer=True,
        quantize=args.quantize,
        group_size=args.quantize_group_size,
        threads=args.threads,
        adapters=adapters,
        any_base=args.lora_any_base,
        without_tokenizer="chat reads and writes text: give a run directory or model directory with "
        "tokenizer.json, e.g. one trained with `rdlm train --tokenizer ...`, or `rdlm generate "
        "--prompt-ids` for a model without one",
    )
    stops = tuple(i for i in (tokenizer.end_turn_id, tokenizer.eos_id) if i is not None)
    config, engine = config_from_args(args, model, stop_tokens=stops), engine_from_args(args)
    # A tokenizer without the chat tokens (a task model's, e.g. `rdlm demo`'s): each line is a prompt of
    # its own, completed as `rdlm generate` would, with no conversation around it.
    plain = not tokenizer.has_chat
    interactive = sys.stdin.isatty()
    opening = [{"role": "system", "content": args.system}] if args.system else []
    context = model.config.context_length
    messages = list(opening)
    if interactive:
        print(
            "rdlm chat: /reset forgets the conversation, /exit quits."
            if not plain
            else "rdlm chat: this model has no chat format; each line is completed on its own. /exit quits.",
            file=sys.stderr,
        )
    # Bytes, decoded here: a line that is not UTF-8 is named and skipped, not the end of the chat.
    read_line = sys.stdin.buffer.readline if hasattr(sys.stdin, "buffer") else sys.stdin.readline
    number = 0
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        raw = read_line()
        number += 1
        if not raw:
            return 0
        try:
            line = raw if isinstance(raw, str) else raw.decode("utf-8")
        except UnicodeDecodeError as err:
            print(
                f"rdlm chat: input line {number} is not UTF-8 (byte 0x{raw[err.start]:02x} at {err.start}); skipped",
                file=sys.stderr,
            )
            continue
        if line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(opening)
            continue
        if plain:
            prompt = tokenizer.encode(text, add_bos=True)
        else:
            messages.append({"role": "user", "content": text})
            prompt, dropped = fit_conversation(tokenizer, messages, len(opening), context, config.max_new_tokens)
            if dropped:
                del messages[len(opening) : len(opening) + dropped]
                print(
                    f"rdlm chat: note: dropped the oldest {dropped // 2} exchange(s) of the conversation so that "
                    f"it fits the model's context of {context} tokens with room for a reply",
                    file=sys.stderr,
                )
        if len(prompt) >= context:
            if not plain:
                messages.pop()
            print(
                f"rdlm chat: message not sent: it makes a prompt of {len(prompt)} tokens, and the model's "
                f"context is {context}; the conversation goes on",
                file=sys.stderr,
            )
            continue
        room = context - len(prompt)
        turn = config if room >= config.max_new_tokens else dataclasses.replace(config, max_new_tokens=room)
        print("Huginn> ", end="", flush=True)
        # The reply's first token usually carries a word's leading space: "Huginn> " already ends in one.
        streamer = TextStreamer(tokenizer, strip_leading=True)
        try:
            result = generate(model, [prompt], turn, decode=tokenizer.decode, on_token=streamer, engine=engine)
        except BaseException:
            print(flush=True)  # an error starts on a line of its own, after the reply so far
            raise
        streamer.finish()
        if not plain:
            messages.append({"role": "assistant", "content": streamer.text.emitted})
        if args.stats:
            print_stats(result)


def fit_conversation(tokenizer, messages: list[dict], keep: int, context: int, room: int) -> tuple[list[int], int]:
    """(prompt, dropped): the chat prompt of `messages` without the fewest of its oldest messages after the
    first `keep` (the system message), dropped an exchange (a message and its reply) at a time, that leaves
    `room` tokens of `context` for the reply; with only the last message left, its prompt as it is. A last
    message that alone fills the context drops nothing (it will not be sent)."""
    alone = tokenizer.apply_chat_template(messages[:keep] + messages[-1:], add_generation_prompt=True)
    if len(alone) >= context:
        return alone, 0
    dropped = 0
    while True:
        kept = messages[:keep] + messages[keep + dropped :]
        prompt = tokenizer.apply_chat_template(kept, add_generation_prompt=True)
        if len(prompt) + room <= context or len(kept) <= keep + 1:
            return prompt, dropped
        dropped += 2
