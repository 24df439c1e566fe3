"""What a job needs before it starts: a device that exists, memory that fits, time that ends.

A recurrent-depth model multiplies its cost by r, so one mistyped flag (`-r 1e9`, `--micro-batch-size
100000`) asks for a job that runs for months or until memory runs out. These checks estimate such a
job before any work and refuse it in one line, or warn with the estimate where it may fit but is long.

The estimates are lower bounds, so a refusal is certain, never a guess: memory counts only the
tensors the job must hold at once; time counts matmul FLOPs at a peak throughput above any one
device's (`PEAK_FLOPS`) plus a floor per layer call (`LAYER_SECONDS`: a kernel launch on a GPU, a few
operator dispatches on the CPU), which is what bounds a small model at a large r.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch

from rdlm.checks import check_int
from rdlm.model.flops import ConfigSizes, flops_per_token

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+, and annotations are not evaluated here (from __future__)

# FLOP/s no single device of its kind reaches (dense bf16 on the fastest GPUs is about 2.3e15; one CPU
# core with AVX-512 FMA about 2e11): the time estimates are lower bounds.
PEAK_FLOPS = {"cuda": 5e15, "cpu_core": 2e11}
# Seconds one layer's forward takes at the least, whatever its size: several kernels of >= 1 us on a
# GPU (CUDA graphs included); some dozen operator dispatches of >= 1 us each on the CPU.
LAYER_SECONDS = {"cuda": 2e-6, "cpu": 1e-5}
# A job whose lower bound exceeds REFUSE_SECONDS in total, or UNIT_SECONDS for one unit of work (one
# token, one optimizer step, one batch), is refused; one above WARN_SECONDS is announced.
REFUSE_SECONDS = 30 * 86400.0
UNIT_SECONDS = 3600.0
WARN_SECONDS = 3600.0
# Set to 1 for a job that really is that long (pretraining on one node): time refusals become warnings.
# Memory refusals stay: what cannot fit cannot run.
ALLOW_LONG_RUNS = "RDLM_ALLOW_LONG_RUNS"


class ResourceError(ValueError):
    """A job that cannot fit in memory or would not finish; refused before it starts."""


class LongRunWarning(UserWarning):
    """A job that may fit but takes long (the message gives the estimate)."""


def check_device(device: str | torch.device, flag: str = "--device") -> torch.device:
    """The device, refused in one line when this machine or this torch build does not have it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ResourceError(f"{flag}: {device!r} is not a device ({err})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ResourceError(f"{flag} {device}: {build}; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ResourceError(f"{flag} {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ResourceError(f"{flag} {device}: MPS is not available on this machine; use --device cpu")
    elif dev.type not in ("cpu", "meta", "mps") and not getattr(torch, dev.type, None):
        raise ResourceError(f"{flag} {device}: not available in this torch build; use --device cpu")
    return dev


# Threads. A model under SMALL_MODEL_PARAMETERS does too little per operation for intra-op threads to pay
# off, and on a machine where other work runs OpenMP's busy-waiting makes each extra thread a loss:
# benchmarks/bench_threads.py measured `generate` of the small preset on 2 busy cores beside a CPU-burning
# process at 3.5 / 11 tok/s (batch 1 / 16) with torch's 2 threads against 31 / 240 with one
# (OMP_WAIT_POLICY unset, as a shell leaves it; PASSIVE mostly avoids the loss, and gains little over one
# thread). Larger models get the cores the load average leaves free when they start.
SMALL_MODEL_PARAMETERS = 20_000_000


def available_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity where the system has one, else every CPU)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def default_threads(num_parameters: int) -> int:
    """CPU threads for a model's work when none are asked for: 1 for a small model, else the cores not busy
    with other work (the one-minute load average) when it starts, at least 1."""
    if num_parameters < SMALL_MODEL_PARAMETERS:
        return 1
    cores = len(available_cpus())
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system
        busy = 0.0
    return max(1, min(cores, round(cores - busy)))


def use_threads(model, threads: int | None = None) -> int:
    """Set torch's intra-op threads for `model`'s work: `threads` when given, else `default_threads` for a
    model on the CPU (a GPU model keeps torch's own). Returns the threads set."""
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads))
    elif next(model.parameters()).device.type == "cpu":
        torch.set_num_threads(default_threads(model.num_parameters()))
    return torch.get_num_threads()


def memory_bytes(device: torch.device | str) -> int:
    """Total memory of the device: GPU memory on CUDA, physical RAM otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(need: float, device: torch.device | str, what: str) -> None:
    """Refuse `what` when its lower-bound size `need` (bytes) exceeds the device's whole memory."""
    have = memory_bytes(device)
    if need > have:
        raise ResourceError(
            f"{what} needs at least {format_bytes(need)}, more than the "
            f"{format_bytes(have)} of {torch.device(device).type} memory; refused"
        )


def forward_seconds(
    config, device: torch.device | str, tokens: float, calls: float, num_steps: float, grad_steps: float = 0
) -> float:
    """A lower bound on the seconds `calls` forward passes over `tokens` tokens in all take at r =
    num_steps (with a backward over the last `grad_steps` iterations when training)."""
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    peak = PEAK_FLOPS["cuda"] if kind == "cuda" else PEAK_FLOPS["cpu_core"] * (os.cpu_count() or 1)
    flops = tokens * flops_per_token(ConfigSizes(config), 0, max(num_steps - grad_steps, 0), grad_steps)
    layers = config.prelude_layers + config.coda_layers + num_steps * config.core_layers
    return flops / peak + calls * layers * LAYER_SECONDS[kind]


def check_time(total: float, unit: float, what: str, unit_name: str) -> None:
    """Refuse `what` when its lower bound `total` (seconds) or that of one `unit_name` (`unit`) is beyond
    any wait; warn when the total is long."""
    allowed = os.environ.get(ALLOW_LONG_RUNS, "") not in ("", "0")
    refusal = None
    if unit > UNIT_SECONDS:
        refusal = f"{what}: one {unit_name} would take at least {format_seconds(unit)}"
    elif total > REFUSE_SECONDS:
        refusal = f"{what} would take at least {format_seconds(total)}"
    if refusal is not None and not allowed:
        raise ResourceError(f"{refusal}; refused (a lower bound; {ALLOW_LONG_RUNS}=1 runs it anyway)")
    if total > WARN_SECONDS:
        warnings.warn(
            f"{what} will take at least {format_seconds(total)} (a lower bound)", LongRunWarning, stacklevel=3
        )


def format_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.3g} {unit}"
    return f"{n / 1024:.3g} PiB"


def format_seconds(s: float) -> str:
    for limit, unit, size in (
        (120, "seconds", 1),
        (7200, "minutes", 60),
        (172800, "hours", 3600),
        (365 * 86400 * 2, "days", 86400),
    ):
        if s < limit:
            return f"{s / size:.3g} {unit}"
    return f"{s / (365 * 86400):.3g} years"


# ------------------------------------------------------------------------------------------------
# Measured, not estimated: the process's resident memory


def resident_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident memory in bytes from Linux's /proc/self/status (VmRSS: now; VmHWM: the peak
    since the process started or the last `ResidentPeak` reset); None where there is no such file."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


class ResidentPeak:
    """The peak resident memory of this process within the block: Linux's high-water mark (VmHWM) is reset to
    the current resident set on entry (/proc/self/clear_refs, "5") and read on exit, so an earlier peak of the
    process does not hide the block's. `start` and `peak` are bytes, `mib` the peak above the start; all None
    where that cannot be done (getrusage's ru_maxrss keeps the process's lifetime peak)."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.peak: int | None = None

    def __enter__(self) -> Self:
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            return self
        self.start = resident_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.start is not None:
            self.peak = resident_bytes("VmHWM")

    @property
    def mib(self) -> float | None:
        return None if self.start is None or self.peak is None else round((self.peak - self.start) / 2**20, 1)
