"""Every GPU claim checked in one call: a suite of parts, each with its own time budget, that fits a short
device window (docs/inference.md, "The GPU suite").

    PYTHONPATH=. python3 benchmarks/gpu_suite.py --out gpu-suite          # on one GPU, at most --budget-s (480)
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/gpu_suite.py --smoke --out /tmp/suite   # CPU, tiny

Parts, in order (gpu_suite_parts.py): correctness (fast paths against the eager path, token for token and
step for step), decode speed at the Huginn-0125 shape against a bandwidth roofline, the server's batch in
process against offline `generate`, training peak memory at fixed r = 8 and r = 64 at the 0.55B shape, and
training MFU at that shape. The suite runs them in order; a part whose budget no longer fits in what is left of the
total is skipped; a part that raises is recorded as failed and the suite goes on; a part still running at
its budget is stopped there (a timer signal; its figures so far are kept) and recorded as overrun.
Writes OUT/gpu_suite.json and OUT/gpu_suite.md, after every part (a run cut off keeps the parts it finished).
`--smoke` runs the same code on the CPU with tiny shapes
and budgets of under a minute a part; what needs CUDA is recorded as skipped there. This is a script, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpu_suite_parts as parts  # noqa: E402  (this folder's)


class Overrun(BaseException):
    """A part ran past its budget (raised inside it by the timer, or by `Context.check`). A BaseException, so
    that code inside the part that catches `Exception` to go on does not swallow it."""


@dataclass
class Part:
    name: str
    run: Callable[["Context", dict], None]   # fills its figures dict (kept when it fails or overruns)
    budget_s: float
    needs_cuda: bool = False
    what: str = ""


@dataclass
class Context:
    """What a part runs on: the device, smoke or not, and its deadline (parts call `check` between cases)."""
    device: torch.device
    smoke: bool
    deadline: float = math.inf

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def check(self) -> None:
        if self.left() <= 0:
            raise Overrun("budget spent")


def gpu_parts() -> list[Part]:
    """The parts on a GPU; their budgets add up to 450 s, leaving 30 s of the default 480 for the rest."""
    return [Part("correctness", parts.correctness, 100, what="fast paths against the eager path"),
            Part("decode_speed", parts.decode_speed, 130, what="decode tokens/s at the Huginn-0125 shape"),
            Part("serving_batch", parts.serving_batch, 60, what="ContinuousBatch against offline generate"),
            # memory before MFU: compiled code keeps its model alive, which would count in the peak
            Part("train_memory", parts.train_memory, 40, needs_cuda=True,
                 what="training peak memory at fixed r = 8 and r = 64"),
            Part("train_mfu", parts.train_mfu, 120, what="training MFU at the 0.55B shape")]


def smoke_parts() -> list[Part]:
    """The same parts on the CPU with tiny shapes (about 10 s in all on two cores); the budgets are a few
    times that, so that a slower or busier machine still runs every part."""
    budgets = {"correctness": 60, "decode_speed": 30, "serving_batch": 30, "train_mfu": 30, "train_memory": 5}
    return [Part(p.name, p.run, budgets[p.name], p.needs_cuda, p.what) for p in gpu_parts()]


@contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise `Overrun` in this thread once `seconds` have passed (SIGALRM; only the main thread can take
    signals, elsewhere only the parts' own checks stop them). Python code is interrupted between bytecodes;
    a call into C (a kernel, a device sync) finishes first."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise Overrun(f"stopped at its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_part(part: Part, ctx: Context, left: float) -> dict:
    """Run one part within its budget: its record (name, status, reason, seconds, figures)."""
    record = {"name": part.name, "what": part.what, "budget_s": part.budget_s, "status": "skipped",
              "reason": "", "seconds": 0.0, "figures": {}}
    if part.needs_cuda and not ctx.cuda:
        record["reason"] = "needs CUDA"
        return record
    if part.budget_s > left:
        record["reason"] = f"its budget ({part.budget_s:.0f} s) does not fit in the {max(left, 0):.0f} s left"
        return record
    t0 = time.perf_counter()
    ctx.deadline = t0 + part.budget_s
    try:
        with time_box(part.budget_s):
            part.run(ctx, record["figures"])
        record["status"] = "ok"
    except Overrun as err:
        record["status"], record["reason"] = "overrun", str(err)
    except Exception as err:  # recorded; the suite goes on with the next part
        record["status"], record["reason"] = "failed", f"{type(err).__name__}: {err}"[:500]
        record["traceback"] = traceback.format_exc(limit=8)[-3000:]
    ctx.deadline = math.inf
    try:
        parts.release(ctx.device)
    except Exception as err:  # a device left broken by the part: the next parts will say so too
        record["release_error"] = f"{type(err).__name__}: {err}"[:300]
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def run_suite(suite: list[Part], ctx: Context, budget_s: float, progress: Callable[[str], None] = print,
              after_part: Callable[[dict], None] | None = None) -> dict:
    """Run the parts in order within `budget_s` in all; the report (a JSON-ready dict), also handed to
    `after_part` after each part as it stands then."""
    start = time.perf_counter()
    report = {"suite": "gpu_suite", "smoke": ctx.smoke, "device": describe_device(ctx.device),
              "torch": torch.__version__, "python": platform.python_version(), "budget_s": budget_s,
              "seconds": 0.0, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": []}
    for part in suite:
        record = run_part(part, ctx, budget_s - (time.perf_counter() - start))
        report["parts"].append(record)
        report["seconds"] = round(time.perf_counter() - start, 2)
        reason = f" ({record['reason']})" if record["reason"] else ""
        progress(f"[gpu_suite] {part.name}: {record['status']}{reason}, {record['seconds']:.1f} s")
        if after_part is not None:
            after_part(report)
    return report


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads, {os.cpu_count()} cores)"


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "-"
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value).replace("|", "/")


def markdown(report: dict) -> str:
    """The report as markdown: one summary table, then a table per part's figures."""
    lines = [f"# GPU suite{' (smoke, CPU)' if report['smoke'] else ''}", "",
             f"{report['device']}, torch {report['torch']}, {report['started']}; "
             f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget.", "",
             "| part | what | status | seconds | budget s | reason |", "|---|---|---|---|---|---|"]
    for p in report["parts"]:
        lines.append(f"| {p['name']} | {p['what']} | {p['status']} | {p['seconds']:.1f} | {p['budget_s']:.0f} | "
                     f"{cell(p['reason'] or '')} |")
    for p in report["parts"]:
        for table, rows in p["figures"].items():
            if not isinstance(rows, list) or not rows:
                continue
            columns = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["", f"## {p['name']}: {table}", "", "| " + " | ".join(columns) + " |",
                      "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join("**NO**" if c == "match" and row.get(c) is False else cell(row.get(c))
                                        for c in columns) + " |" for row in rows]
        notes = {k: v for k, v in p["figures"].items() if not isinstance(v, list)}
        if notes:
            lines += ["", f"{p['name']}: " + "; ".join(f"{k} {cell(v)}" for k, v in notes.items())]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "gpu_suite.json", out / "gpu_suite.md"
    paths[0].write_text(json.dumps(report, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(report))
    return paths


def positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_suite.json and gpu_suite.md")
    p.add_argument("--budget-s", type=positive, default=None,
                   help="seconds for the whole suite (default 480; 180 with --smoke)")
    p.add_argument("--smoke", action="store_true", help="the CPU, tiny shapes, budgets of under a minute a part")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--parts", default=None, help="comma-separated part names to run (default: all)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU machine, or pass --smoke for the CPU run")
    suite = smoke_parts() if args.smoke else gpu_parts()
    if args.parts:
        names = args.parts.split(",")
        unknown = sorted(set(names) - {part.name for part in suite})
        if unknown:
            p.error(f"unknown part(s) {', '.join(unknown)}; available: {', '.join(x.name for x in suite)}")
        suite = [part for part in suite if part.name in names]
    if args.smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    budget = args.budget_s if args.budget_s is not None else (180.0 if args.smoke else 480.0)
    out = Path(args.out)
    try:  # refused before anything runs, not after the whole suite
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        p.error(f"--out {args.out}: cannot create that folder ({err})")
    report = run_suite(suite, Context(device, args.smoke), budget, after_part=lambda so_far: write(so_far, out))
    json_path, md_path = write(report, out)
    print(f"[gpu_suite] wrote {json_path} and {md_path} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
