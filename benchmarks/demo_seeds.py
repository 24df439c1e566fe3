"""`rdlm demo` on many seeds: each seed's numbers, each claim's pass rate and smallest margin.

Runs the demo once per seed (`--parallel` runs side by side, each a `python -m rdlm demo` process with its
own report directory under `--out`), then reads every `results.json` and writes `seeds.json` and
`seeds.md` there. Arguments after `--` go to every `rdlm demo` (e.g. `-- --no-twin --lr 2e-3`, or
`-- --experiment retrofit`: the table then shows that experiment's numbers).
A seed whose report is already there is read, not rerun (`--rerun` to run it again, replacing it), so an
interrupted sweep continues where it stopped; stopping the sweep (Ctrl-C, SIGTERM) stops its demos.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/demo_seeds.py --seeds 100-111 --out seed-sweep
    python benchmarks/demo_seeds.py --seeds 0-4 --parallel 4 --out sweep -- --no-twin --no-depth-matched

The default demo runs its three models in three processes, so on two cores run one seed at a time
(`--parallel 1`, the default); on a machine with more cores, about cores / 3 seeds at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def parse_seeds(text: str) -> list[int]:
    """`0-4,7,100-111` -> [0, 1, 2, 3, 4, 7, 100, ..., 111] (in the order given, no repeats)."""
    seeds: list[int] = []
    for part in text.split(","):
        try:
            low, _, high = part.partition("-")
            span = range(int(low), int(high or low) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"seeds are integers or ranges like 100-111, got {part!r}") from None
        if not span:
            raise argparse.ArgumentTypeError(f"empty seed range {part!r}")
        seeds += [s for s in span if s not in seeds]
    return seeds


def run_seeds(seeds: Sequence[int], out: Path, demo_args: Sequence[str], parallel: int, rerun: bool) -> None:
    """Each seed's demo into out/seed-N, `parallel` at a time; its output goes to out/seed-N.log. A seed is run
    when its report is not complete (no results.json, which the demo writes last) or `rerun`: the demo then
    replaces what is in out/seed-N (--overwrite; the sweep's own directory). Interrupted (Ctrl-C, SIGTERM, an
    error), the sweep stops its running demos, which stop their workers."""
    todo = [s for s in seeds if rerun or not (out / f"seed-{s}" / "results.json").is_file()]
    running: dict[int, tuple[subprocess.Popen, Any, float]] = {}
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    previous = signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    try:
        while todo or running:
            while todo and len(running) < parallel:
                seed = todo.pop(0)
                log = open(out / f"seed-{seed}.log", "w")
                command = [sys.executable, "-m", "rdlm", "demo", "--seed", str(seed), "--out",
                           str(out / f"seed-{seed}"), "--overwrite", "--quiet", *demo_args]
                running[seed] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log,
                                 time.perf_counter())
                print(f"demo_seeds: seed {seed} started", flush=True)
            for seed, (process, log, started) in list(running.items()):
                if process.poll() is not None:
                    log.close()
                    del running[seed]
                    state = "done" if process.returncode == 0 else f"FAILED (exit {process.returncode}, see its log)"
                    print(f"demo_seeds: seed {seed} {state} after {time.perf_counter() - started:.0f} s", flush=True)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_demos([process for process, _, _ in running.values()])


def stop_demos(processes: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM to each demo still running (it kills its workers), then SIGKILL to any left after `grace` s."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _main_cells(row: dict[str, Any]) -> list[str]:
    return [str(row["best_r"]), _pct(row["test_at_best_r"]), _pct(row["test_at_r1"]), _pct(row["test_at_max_r"]),
            f"{_pct(row['harder_at_train_mean_r'])} -> {_pct(row['harder_at_max_r'])}", _pct(row["twin_test"]),
            _pct(row["depth_matched_test"]), f"{_pct(row['exit_steps_fraction'])}%", f"{row['final_loss']:.3f}"]


def _retrofit_cells(results: dict[str, Any]) -> list[str]:
    c, steps = results["claims"], results["steps"]
    return [_pct(c["retrofitted_test_at_train_mean_r"]), _pct(c["control_test"]),
            f"{_pct(c['retrofitted_harder_at_r1'])} -> {_pct(c['retrofitted_harder_at_chosen_r'])} "
            f"(r={c['r_chosen_on_harder_validation']})", _pct(c["control_harder"]),
            f"{steps['retrofitted']} / {steps['control']}", f"{results['flops']['control_over_retrofitted']:.4f}"]


def _gate_cells(results: dict[str, Any]) -> list[str]:
    c, kl = results["claims"], results.get("kl")
    cells = [f"{c['threshold']:g}", f"{_pct(c['test_accuracy_at_exits'])} / {_pct(c['test_accuracy_all_loops'])}",
             f"{c['test_loops_per_answer_token']:.2f} of {c['loops']}",
             f"{c['shortest_words_loops']:.2f} -> {c['harder_loops']:.2f}"]
    cells.append("-" if kl is None else f"{_pct(kl['test']['accuracy'])}, {kl['test']['answer_steps']:.2f} of "
                                        f"{kl['max_steps']}")
    return cells


def _lora_cells(results: dict[str, Any]) -> list[str]:
    c, acc = results["claims"], results["accuracy"]
    d, f = c["deep_r"], c["fixed_r"]

    def gain(kind: str, split: str) -> str:
        overall = acc[kind][split]["overall"]
        return f"{_pct(overall[str(f)])} -> {_pct(overall[str(d)])}"

    base_task = " / ".join(_pct(acc[k]["base_test"]["overall"][str(d)])
                           for k in ("base", "lora_random", "lora_fixed", "full_random"))
    return [_pct(c["base_variant_test"]), gain("lora_random", "test"), gain("lora_random", "harder"),
            gain("lora_fixed", "harder"), _pct(acc["full_random"]["test"]["overall"][str(d)]), base_task]


# Per experiment: the table's columns (after the seed), and the cells of one seed.
COLUMNS = {
    "main": ("best r", "test at best r", "r=1", "r=max", "harder: mean r -> max r", "twin", "depth-matched",
             "exits (of r)", "final loss"),
    "retrofit": ("retrofitted test at mean r", "control test", "retrofitted harder: r=1 -> chosen r",
                 "control harder", "steps retrofitted / control", "FLOPs control / retrofitted"),
    "gate": ("gate threshold", "test: exits / all loops", "loops per answer token (test)",
             "loops: shortest words -> harder", "KL exits (recurrent): test, iterations"),
    "lora": ("base on the new test (r=32)", "LoRA randomized: test r=4 -> 32", "LoRA randomized: harder r=4 -> 32",
             "LoRA fixed: harder r=4 -> 32", "full fine-tune: test r=32",
             "base task test r=32: base / LoRA rand. / LoRA fixed / full"),
}


def seed_row(seed: int, results: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one seed that the table shows."""
    experiment = results.get("experiment", "main")
    common = {"seed": seed, "experiment": experiment, "seconds": results["seconds"],
              "load_average": results.get("load_average"), "cpu": results.get("machine", {}).get("cpu"),
              "checks": {check["claim"]: check["margin"] for check in results["checks"]},
              "units": {check["claim"]: check.get("unit", "fraction") for check in results["checks"]},
              "all_hold": all(check["holds"] for check in results["checks"])}
    if experiment == "retrofit":
        return common | {"cells": _retrofit_cells(results)}
    if experiment == "gate":
        return common | {"cells": _gate_cells(results)}
    if experiment == "lora":
        return common | {"cells": _lora_cells(results)}
    c = results["claims"]
    losses = results["training"]["recurrent"]["losses"]
    tail = losses[-max(1, len(losses) // 20):]
    row = common | {"best_r": c["best_r_on_validation"], "test_at_best_r": c["test_at_best_r"],
                    "test_at_r1": c["test_at_r1"], "test_at_max_r": c["test_at_max_r"],
                    "harder_at_train_mean_r": c["harder_at_train_mean_r"], "harder_at_max_r": c["harder_at_max_r"],
                    "twin_test": c.get("twin_test"), "depth_matched_test": c.get("depth_matched_test"),
                    "exit_steps_fraction": c["exit_answer_steps_fraction"], "final_loss": sum(tail) / len(tail)}
    return row | {"cells": _main_cells(row)}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per claim: on how many seeds it holds, and the smallest margin (with its seed)."""
    claims: dict[str, dict[str, Any]] = {}
    for row in rows:
        for claim, margin in row["checks"].items():
            entry = claims.setdefault(claim, {"holds": 0, "seeds": 0, "smallest_margin": None, "at_seed": None,
                                              "unit": row.get("units", {}).get(claim, "fraction")})
            entry["seeds"] += 1
            entry["holds"] += margin >= -1e-9
            if entry["smallest_margin"] is None or margin < entry["smallest_margin"]:
                entry["smallest_margin"], entry["at_seed"] = margin, row["seed"]
    return {"seeds": [row["seed"] for row in rows], "all_claims_hold": sum(row["all_hold"] for row in rows),
            "claims": claims}


def markdown(rows: Sequence[dict[str, Any]], summary: dict[str, Any], demo_args: Sequence[str]) -> str:
    columns = (*COLUMNS[rows[0]["experiment"]], "all claims", "time (s), load start / end")
    lines = [f"# rdlm demo on {len(rows)} seeds" + (f" (`{' '.join(demo_args)}`)" if demo_args else ""), "",
             "| seed | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for row in rows:
        load = row["load_average"] or {}
        start, end = ((load.get(k) or [None])[0] for k in ("start", "end"))
        cells = [*row["cells"], "pass" if row["all_hold"] else "FAIL", f"{row['seconds']:.0f}, {start} / {end}"]
        lines.append(f"| {row['seed']} | " + " | ".join(cells) + " |")
    lines += ["", f"All claims hold on {summary['all_claims_hold']} of {len(rows)} seeds.", "",
              "| claim | holds | smallest margin (seed) |", "|---|---|---|"]
    for claim, entry in summary["claims"].items():
        margin = (f"{entry['smallest_margin']:+.2f}x" if entry["unit"] == "ratio"
                  else f"{100 * entry['smallest_margin']:+.1f}")
        lines.append(f"| {claim} | {entry['holds']} / {entry['seeds']} | {margin} ({entry['at_seed']}) |")
    cpus = sorted({row["cpu"] for row in rows if row["cpu"]})
    lines += ["", f"Machine: {', '.join(cpus) or 'unknown'}; margins in points (fractions x 100), or as a ratio (x)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    demo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=parse_seeds, required=True, help="seeds, e.g. 100-111 or 0,3,7")
    p.add_argument("--out", default="demo-seeds", help="directory of the reports, seeds.json and seeds.md")
    p.add_argument("--parallel", type=int, default=1, help="demos run side by side")
    p.add_argument("--rerun", action="store_true", help="run seeds whose report is already there again")
    p.add_argument("--no-run", action="store_true", help="only read the reports already there")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be at least 1, got {args.parallel}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        p.error(f"--out {out}: {err.strerror or err}")
    if not args.no_run:
        run_seeds(args.seeds, out, demo_args, args.parallel, args.rerun)
    reports = {seed: json.loads(path.read_text()) for seed in args.seeds
               if (path := out / f"seed-{seed}" / "results.json").is_file()}
    if not reports:
        print("demo_seeds: no seed finished", file=sys.stderr)
        return 1
    kinds = sorted({results.get("experiment", "main") for results in reports.values()})
    if len(kinds) > 1:
        print(f"demo_seeds: the reports under {out} are of different experiments ({', '.join(kinds)}); "
              "give each sweep its own --out", file=sys.stderr)
        return 1
    rows = [seed_row(seed, results) for seed, results in reports.items()]
    summary = summarize(rows)
    (out / "seeds.json").write_text(json.dumps({"demo_args": demo_args, "rows": rows, "summary": summary}, indent=1))
    text = markdown(rows, summary, demo_args)
    (out / "seeds.md").write_text(text)
    print(text)
    return 0 if len(rows) == len(args.seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
