"""The reports of the demo's experiments (rdlm.demo.retrofit_demo, rdlm.demo.gate_demo): report.md and the
plots, from results.json's contents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rdlm.demo.report import _pct, _pyplot, _r_axis, _recipe, _save_figure
from rdlm.fileio import write_text


def _header(res: dict[str, Any], title: str) -> list[str]:
    m, load = res["machine"], res["load_average"]
    return [
        f"# rdlm demo: {title}",
        "",
        (
            f"Seed {res['config']['seed']}, {res['seconds']:.0f} s wall ({res['cpu_seconds']:.0f} s CPU) on "
            f"{m['cpu']} ({m['cores']} cores, {m['workers']} processes of {m['threads_per_model']} thread), "
            f"load average {load['start']} at the start, {load['end']} at the end. "
            f"Training recipe: {_recipe(res['config'])}."
        ),
        _timings(res),
        "",
    ]


def _timings(res: dict[str, Any]) -> str:
    t = res.get("timings", {})
    parts = [f"pretraining {t['pretraining']:.0f} s"] if "pretraining" in t else []
    parts += [
        f"{kind}: training {v['train']:.0f} s, scoring {v['score']:.0f} s" for kind, v in t.get("per_model", {}).items()
    ]
    return f"Where the time went: {'; '.join(parts)} (side by side)." if parts else ""


def _checks(res: dict[str, Any]) -> list[str]:
    lines = ["## Claims", "", "| claim | measured | margin | holds |", "|---|---|---|---|"]
    for c in res["checks"]:
        lines.append(f"| {c['claim']} | {c['value']:+.3f} | {c['margin']:+.3f} | {'yes' if c['holds'] else 'NO'} |")
    return lines + [""]


def _accuracy_rows(table: dict[str, Any], splits: tuple[str, ...], label: str) -> list[str]:
    rs = sorted(table[splits[0]]["overall"], key=int)
    lines = [f"| {label} | " + " | ".join(f"r={r}" for r in rs) + " |", "|---|" + "---|" * len(rs)]
    for split in splits:
        lines.append(
            f"| {split.replace('_', ' ')} | " + " | ".join(_pct(table[split]["overall"][r]) for r in rs) + " |"
        )
    return lines + [""]


SPLITS = ("validation", "test", "harder_validation", "harder")
SMOOTH = 25  # steps in the running mean of a plotted training loss


def _smooth(values: list[float]) -> np.ndarray:
    kernel = np.ones(min(SMOOTH, len(values))) / min(SMOOTH, len(values))
    return np.convolve(np.asarray(values, dtype=float), kernel, mode="same")


def write_retrofit_report(out: Path, res: dict[str, Any]) -> list[str]:
    exp, flops, steps = res["retrofit"], res["flops"], res["steps"]
    lines = _header(res, "retrofitting recurrence into a pretrained Llama")
    lines += [
        (
            f"A {exp['source_layers']}-layer Llama ({res['parameters']['llama']:,} parameters) pretrained for "
            f"{steps['pretraining']} steps ({flops['pretraining']:.3g} FLOPs), written as a transformers Llama "
            f"directory (`llama/`), then from that directory: the retrofitted model (prelude "
            f"{exp['prelude']}, core {exp['core']}, coda {exp['coda']}, adapter `{exp['adapter_init']}`; "
            f"{steps['retrofitted']} steps, the mean r ramped {exp['r_curriculum']} from 1 over the first "
            f"{100 * exp['r_curriculum_fraction']:.0f}%) and the control (the Llama trained on, "
            f"{steps['control']} steps). Training FLOPs after pretraining: retrofitted {flops['retrofitted']:.4g}, "
            f"control {flops['control']:.4g} (ratio {flops['control_over_retrofitted']:.4f})."
        ),
        "",
    ]
    lines += _checks(res)
    lines += ["## Accuracy (exact match of the decoded reply, %)", ""]
    lines += _accuracy_rows(res["retrofitted"], SPLITS, "retrofitted")
    lines += _accuracy_rows(res["control"], SPLITS, "control (Llama)")
    lines += [
        (
            "`harder validation` holds words as long as `harder`'s (other prompts); it chooses the r at which "
            "the harder split is scored."
        ),
        "",
    ]
    write_text(out / "report.md", "\n".join(lines))
    return [str(out / "report.md"), *plot_retrofit(out, res)]


def plot_retrofit(out: Path, res: dict[str, Any]) -> list[str]:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    retro, control = res["retrofitted"], res["control"]
    rs = sorted(retro["test"]["overall"], key=int)
    for i, split in enumerate(("test", "harder")):
        left.plot(
            [int(r) for r in rs],
            [100 * retro[split]["overall"][r] for r in rs],
            "o-",
            color=f"C{i}",
            label=f"retrofitted, {split}",
        )
        left.axhline(
            100 * control[split]["overall"][next(iter(control[split]["overall"]))],
            color=f"C{i}",
            ls="--",
            label=f"control (Llama), {split}",
        )
    _r_axis(left, [int(r) for r in rs])
    left.set_ylabel("exact match (%)")
    left.set_ylim(-2, 102)
    left.legend(fontsize=8)
    left.set_title("accuracy against test-time r, at equal training FLOPs")
    training = res["training"]
    offset = 0.0
    for kind, color in (("pretraining", "grey"), ("retrofitted", "C3"), ("control", "C0")):
        h = training[kind]
        flops = offset + np.cumsum(h["flops_per_step"])
        right.plot(flops, _smooth(h["losses"]), color=color, label=kind)
        offset = float(flops[-1]) if kind == "pretraining" else offset
    right.set_yscale("log")
    right.set_xlabel("training FLOPs")
    right.set_ylabel(f"training loss (mean of {SMOOTH} steps)")
    right.legend(fontsize=8)
    fig.tight_layout()
    return [_save_figure(fig, out / "retrofit.png")]


def write_gate_report(out: Path, res: dict[str, Any]) -> list[str]:
    exp, gate = res["gate_settings"], res["gate"]
    lines = _header(res, "the learned exit gate (Ouro) against the zero-shot KL exit (Huginn)")
    lines += [
        (
            f"A looped model of {exp['layers']} layer(s) ({res['parameters']['looped']:,} parameters) trained at "
            f"{exp['loops']} loops on Ouro's objective (expected loss over the gate's exits minus "
            f'{exp["exit_loss_beta"]:g} x their entropy); decoded with `exit_criterion="gate"`, threshold '
            f"q = {gate['threshold']:g} chosen on validation (the loosest within "
            f"{100 * res['config']['exit_tolerance']:g} point(s) of all loops)."
        ),
        "",
    ]
    lines += _checks(res)
    lines += ["## Where the depth goes (test and harder, iterations per decoded answer token)", ""]
    models = [("looped", "gate", gate)] + ([("recurrent", res["kl"]["criterion"], res["kl"])] if "kl" in res else [])
    lines += [
        (
            "| model | exit | threshold | test accuracy (exits / all) | test iterations | harder accuracy "
            "(exits / all) | harder iterations | layer passes per test answer token |"
        ),
        "|---" * 8 + "|",
    ]
    for kind, criterion, sweep in models:
        layers = res["layers"][kind]
        passes = layers["outside"] + layers["per_iteration"] * sweep["test"]["answer_steps"]
        lines.append(
            f"| {kind} | {criterion} | {sweep['threshold']:g} | {_pct(sweep['test']['accuracy'])} / "
            f"{_pct(sweep['fixed_accuracy']['test'])} (all {sweep['max_steps']}) | "
            f"{sweep['test']['answer_steps']:.2f} | {_pct(sweep['harder']['accuracy'])} / "
            f"{_pct(sweep['fixed_accuracy']['harder'])} | {sweep['harder']['answer_steps']:.2f} | "
            f"{passes:.1f} |"
        )
    lines += [
        "",
        (
            "Layer passes count what an exit costs: a loop of the looped model is its stack (the gate reads the "
            "state); an iteration of the recurrent model is its core and, for the KL test, its coda (the "
            "prediction after every iteration), plus its prelude once."
        ),
        "",
        "Iterations per answer token by word length (test, then harder):",
        "",
    ]
    difficulties = sorted({int(d) for s in ("test", "harder") for d in gate[s]["answer_steps_by_difficulty"]})
    lines += ["| model | " + " | ".join(map(str, difficulties)) + " |", "|---|" + "---|" * len(difficulties)]
    for kind, _, sweep in models:
        steps = {int(d): v for s in ("test", "harder") for d, v in sweep[s]["answer_steps_by_difficulty"].items()}
        lines.append(f"| {kind} | " + " | ".join(f"{steps[d]:.1f}" for d in difficulties) + " |")
    fewest = gate.get("fewest_loops")
    if fewest:
        floor = {int(d): v for s in ("test", "harder") for d, v in fewest[s]["by_difficulty"].items()}
        lines.append(
            "| looped, fewest fixed loops within 2 points of all | "
            + " | ".join(str(floor[d]) for d in difficulties)
            + " |"
        )
        lines += [
            "",
            (
                f"The last row is the best a fixed number of loops per word length could do (from the "
                f"fixed-loop accuracies below): {fewest['test']['mean']:.2f} loops per answer token on test, "
                f"against the gate's {gate['test']['answer_steps']:.2f}."
            ),
        ]
    lines += ["", "## Accuracy at a fixed number of loops (%)", ""]
    lines += _accuracy_rows(res["looped"], ("validation", "test", "harder"), "looped")
    write_text(out / "report.md", "\n".join(lines))
    return [str(out / "report.md"), *plot_gate(out, res)]


def plot_gate(out: Path, res: dict[str, Any]) -> list[str]:
    """Left: validation accuracy against layer passes per answer token, every threshold of each exit.
    Right: iterations per answer token against word length at the chosen thresholds."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    models = [("looped", "gate", res["gate"], "C3")] + (
        [("recurrent", res["kl"]["criterion"], res["kl"], "C0")] if "kl" in res else []
    )
    for kind, criterion, sweep, color in models:
        layers = res["layers"][kind]
        cost = [layers["outside"] + layers["per_iteration"] * row["answer_steps"] for row in sweep["validation_sweep"]]
        left.plot(
            cost,
            [100 * row["accuracy"] for row in sweep["validation_sweep"]],
            "o-",
            color=color,
            label=f"{kind}, {criterion} exit (thresholds)",
        )
        full = layers["outside"] + layers["per_iteration"] * sweep["max_steps"]
        left.scatter(
            [full],
            [100 * sweep["fixed_accuracy"]["validation"]],
            marker="*",
            s=120,
            color=color,
            label=f"{kind}, all {sweep['max_steps']} iterations",
        )
        for split, style in (("test", "o-"), ("harder", "s--")):
            by = sweep[split]["answer_steps_by_difficulty"]
            right.plot(
                [int(d) for d in by],
                [layers["outside"] + layers["per_iteration"] * v for v in by.values()],
                style,
                color=color,
                label=f"{kind} ({criterion}), {split}",
            )
    left.set_xscale("log", base=2)
    left.set_xlabel("layer passes per answer token (validation)")
    left.set_ylabel("exact match (%)")
    left.legend(fontsize=7)
    right.set_xlabel("word length (moves)")
    right.set_ylabel("layer passes per answer token")
    right.legend(fontsize=7)
    fig.tight_layout()
    return [_save_figure(fig, out / "gate.png")]


def write_lora_report(out: Path, res: dict[str, Any]) -> list[str]:
    exp, claims, task, steps = res["lora_settings"], res["claims"], res["task"], res["steps"]
    lines = _header(res, "fine-tuning a looped model with LoRA: is the test-time scaling kept?")
    lines += [
        (
            f"The base: the demo's recurrent model ({res['parameters']['base']:,} parameters) trained on "
            f"`{task['base']}` for {steps['base']} steps. Adapted to `{task['variant']}` (new moves "
            f"{_moves(task)} among the old: rules the base never saw) on the same rows, in the same order, for "
            f"{steps['adaptation']} steps each: LoRA (rank {exp['rank']}, alpha {exp['alpha']:g}, on "
            f"{', '.join(exp['parts'])}; AdamW lr {exp['lora_lr']:g}) at randomized depth (r drawn as the "
            f"base drew it, the last {res['config']['backprop_depth']} iterations backpropagated) and at a "
            f"fixed r = {exp['fixed_r']} (every iteration backpropagated), and a full fine-tune at randomized "
            "depth with the demo's learning rates."
        ),
        "",
    ]
    lines += _checks(res)
    rs = sorted(res["accuracy"]["base"]["test"]["overall"], key=int)
    titles = {
        "test": f"Variant, test ({_range_of(res['splits']['test'])} moves)",
        "harder": f"Variant, harder ({_range_of(res['splits']['harder'])} moves, longer than any trained on)",
        "base_test": "Base task, test (what the adaptation forgot)",
    }
    for split, title in titles.items():
        lines += [f"## {title}: exact match of the decoded reply (%)", ""]
        lines += ["| model | " + " | ".join(f"r={r}" for r in rs) + " |", "|---|" + "---|" * len(rs)]
        for kind, table in res["accuracy"].items():
            lines.append(
                f"| {res['labels'][kind]} | " + " | ".join(_pct(table[split]["overall"][r]) for r in rs) + " |"
            )
        lines.append("")
    lines += [
        "## What each arm trained, and its cost",
        "",
        (
            "| arm | trainable parameters | gradients and optimizer state (MiB) | peak memory above the start "
            "(MiB) | training wall / CPU (s) | base weights bitwise unchanged | base task drop at "
            f"r={claims['deep_r']} (points) |"
        ),
        "|---" * 7 + "|",
    ]
    for kind, arm in res["arms"].items():
        peak = "-" if arm["peak_memory_mib"] is None else f"{arm['peak_memory_mib']:.1f}"
        lines.append(
            f"| {res['labels'][kind]} | {arm['trainable_parameters']:,} | {arm['training_state_bytes'] / 2**20:.2f} | "
            f"{peak} | {arm['train_seconds']:.0f} / {arm['train_cpu_seconds']:.0f} | "
            f"{'yes' if arm['base_weights_unchanged'] else 'no'} | {100 * claims['forgetting'][kind]:+.1f} |"
        )
    lines += [
        "",
        (
            f"Memory: {res['memory']}; gradients and optimizer state are counted from the trainable parameters "
            "(float32; Muon keeps one buffer, AdamW two). The arms trained side by side, so their wall times "
            "share the cores; CPU seconds are each arm's own."
        ),
        "",
    ]
    write_text(out / "report.md", "\n".join(lines))
    return [str(out / "report.md"), *plot_lora(out, res)]


def _moves(task: dict[str, Any]) -> str:
    """The variant's moves that the base task does not have, as `name` = (the value each value goes to)."""
    moves = task.get("moves", {})
    new = {m: p for m, p in moves.get("variant", {}).items() if m not in moves.get("base", {})}
    return ", ".join(f"`{m}` = {tuple(p)}" for m, p in new.items()) or "other moves"


def _range_of(split: dict[str, Any]) -> str:
    low, high = split["difficulty_range"]
    return f"{low}-{high}"


def plot_lora(out: Path, res: dict[str, Any]) -> list[str]:
    """Accuracy against r, one line per model: the variant's test and harder splits, the base task's test."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    styles = {"base": ("grey", "--"), "lora_random": ("C3", "-"), "lora_fixed": ("C0", "-"), "full_random": ("C2", ":")}
    titles = (("test", "variant, test"), ("harder", "variant, harder (longer words)"), ("base_test", "base task, test"))
    for ax, (split, title) in zip(axes, titles, strict=True):
        for kind, table in res["accuracy"].items():
            overall = table[split]["overall"]
            rs = sorted(overall, key=int)
            color, style = styles.get(kind, ("k", "-"))
            ax.plot(
                [int(r) for r in rs],
                [100 * overall[r] for r in rs],
                "o" + style,
                color=color,
                label=res["labels"][kind],
            )
        _r_axis(ax, [int(r) for r in rs])
        ax.set_title(title)
    axes[0].set_ylabel("exact match (%)")
    axes[0].set_ylim(-2, 102)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return [_save_figure(fig, out / "lora.png")]
